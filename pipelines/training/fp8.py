"""FP8 training of the Linear layers with torchao.float8 (torchtitan's route; CUDA, H100-class GPUs).

`fp8_modules` picks the Linear layers that run in FP8 under the Nemotron-H FP8 recipe's exceptions: the
first and the last block and lm_head stay in bf16, and so do the MoE routers (their logits pick experts)
and any Linear whose widths are not multiples of 16 (the FP8 matmul's alignment). `apply_fp8` swaps
exactly those for torchao's Float8Linear (dynamic tensorwise scaling) before the model is sharded; the
teacher's forward can run in FP8 as well. On CUDA each swapped Linear's forward runs torch.compile'd
(`fp8_linear_class`), as torchao and torchtitan prescribe: eager, its amax, scale and cast kernels made the 8B
window's FP8 step 0.76x bf16 on an H200 (bench/RESULTS.md "GPU").
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import warnings

from torch import nn

from remodel.models.errors import RemodelError

from .compiled import Compiled

COMPILE = True  # on CUDA the FP8 Linears' forward runs torch.compile'd; False: eager there too


# what --fp8 uses and what transformers' quantizers import when a model loads (each registers pytree constants)
TORCHAO_MODULES = ("torchao", "torchao.float8", "torchao.prototype.safetensors.safetensors_support")


@functools.cache
def import_torchao_quietly() -> bool:
    """Import torchao once, before anything else does (transformers' model loading imports it), with the
    notices it prints on a machine without its CUDA extensions ("Failed to load ... _C_mxfp8") and torch's
    pytree deprecation lines silenced: only those two loggers and the import's own warnings, for the
    import alone. -> whether torchao is installed and importable."""
    if importlib.util.find_spec("torchao") is None:
        return False
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in TORCHAO_MODULES:
                importlib.import_module(name)
        return True
    except Exception:  # noqa: BLE001 - a broken torchao: --fp8 says so itself when asked for
        return False
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def fp8_modules(model) -> list[str]:
    """Names of the Linear modules that run in FP8 (see the module doc)."""
    last = len(model.layers) - 1
    names = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or not name.startswith("layers."):
            continue
        block = int(name.split(".")[1])
        if block in (0, last) or ".gate" in name or m.in_features % 16 or m.out_features % 16:
            continue
        names.append(name)
    return names


def apply_fp8(model, device) -> list[str]:
    """Swap the `fp8_modules` of `model` for torchao Float8Linear; -> their names. CUDA only."""
    if getattr(device, "type", str(device)) != "cuda":
        raise RemodelError("--fp8 needs a CUDA GPU with FP8 matmuls (H100-class); this run is on "
                           f"{device}")
    return convert(model)


def convert(model) -> list[str]:
    """The module swap itself (device-independent, so CPU tests can check what is converted)."""
    import_torchao_quietly()
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise RemodelError("--fp8 needs torchao: pip install -e '.[gpu]'") from None
    chosen = set(fp8_modules(model))
    convert_to_float8_training(model, config=Float8LinearConfig(),
                               module_filter_fn=lambda m, fqn: fqn in chosen)
    for name in chosen:  # the same module, its class swapped for the subclass (state and hooks kept)
        model.get_submodule(name).__class__ = fp8_linear_class()
    return sorted(chosen)


def _on_gpu(x) -> bool:
    """Whether the input is where the compiled form pays (the tests force it on CPU tensors)."""
    return x.is_cuda


@functools.cache
def fp8_linear_class():
    """torchao's Float8Linear with its forward torch.compile'd on CUDA (COMPILE), where the amax, scaling and
    casts fuse into a few kernels around the FP8 matmul; eager elsewhere. One compiled function serves every
    module (the module is its argument), so each weight shape compiles once; where compiling fails it runs
    eager with one warning (`Compiled`)."""
    from torchao.float8.float8_linear import Float8Linear

    compiled = Compiled(Float8Linear.forward, "FP8 Linear")  # torch.compile is lazy: nothing built until a call

    class Fp8Linear(Float8Linear):
        def forward(self, x):
            if not (COMPILE and _on_gpu(x)):
                return super().forward(x)
            return compiled(self, x)
    return Fp8Linear
