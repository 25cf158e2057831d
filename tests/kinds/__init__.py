"""Each layer kind's zero-masked reference, in its own module here named after the kind's config section
(tests/kinds/<section>.py, found by that name: a new kind brings its module and edits no shared test file;
tests/test_masking.py fails for a registered kind without one). Written by hand from what the kind computes,
never from the pruning code (compress/, the layout table) it checks. A module holds:

  AXES               the keep-dict axes it masks: exactly its kind's units (LayerKind.units, hidden_units)
  outputs(mixer)     the Linears (or expert tensors) that write the layer's output to the residual stream
  mask(cfg, mixer, keep, p)   the layer's dropped units (keep entries under prefix p) zeroed in place
  FP64               optional: compare a model holding this kind in float64 (tests/test_families.py)
"""
import importlib

import torch


def masking(kind):
    """The masking module of a LayerKind (a post-norm variant shares its base kind's: the same section)."""
    return importlib.import_module(f"{__name__}.{kind.section_name}")


def dropped(kept, n):
    """The indices in 0..n-1 not in `kept`."""
    m = torch.ones(n, dtype=torch.bool)
    m[kept] = False
    return m.nonzero()[:, 0]


def kept_mean_rmsnorm(norm, n_kept):
    """An RMSNorm over the kept channels only. The masked input is exactly zero on the dropped channels,
    so sum(x^2) is the kept channels' sum; the pruned model divides it by n', the unpruned one would
    divide by n. This patch divides by n' (what pruning does), nothing else."""
    def forward(x):
        dtype, cd = x.dtype, torch.promote_types(x.dtype, torch.float32)
        x = x.to(cd)
        x = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / n_kept + norm.eps)
        return ((norm.weight.to(cd) + norm.offset) * x).to(dtype)
    norm.forward = forward
