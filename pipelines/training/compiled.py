"""A function torch.compile'd where that pays (CUDA), with eager as the fallback: the compiled form is a
speed-up, never a requirement (a GPU machine without Triton or a C compiler still trains)."""
from __future__ import annotations

import warnings

import torch


class Compiled:
    """fn torch.compile'd (`dynamic` as torch.compile takes it). Where dynamo cannot trace fn or the compiler
    cannot build its kernels (both raised before anything runs), fn runs eager from then on, with one warning
    naming `what`; an error that is fn's own then surfaces from the eager call, as it would have."""

    def __init__(self, fn, what: str, dynamic=None):
        self.fn, self.what, self.run = fn, what, torch.compile(fn, dynamic=dynamic)

    def __call__(self, *args):
        if self.run is not self.fn:
            try:
                return self.run(*args)
            except torch._dynamo.exc.TorchDynamoException as e:
                warnings.warn(f"{self.what}: torch.compile failed ({str(e).splitlines()[0][:200]}); it runs "
                              f"eager from now on", stacklevel=2)
                self.run = self.fn
        return self.fn(*args)
