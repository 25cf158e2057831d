"""Activation recomputation, applied to a HybridLM from outside (torchtitan's `apply_ac` shape).

none       every layer keeps what autograd saves.
selective  the cheap, memory-heavy internals run under non-reentrant checkpoint and are recomputed
           in backward (Megatron's selective recomputation): the Mamba conv + scan + gated norm, the
           attention core (q/k norm, RoPE, SDPA), the MLP / expert activation with the down projection
           that reads it. The q/k/v, in_proj, up/gate matmul outputs stay saved.
full       each Block runs under non-reentrant checkpoint and is recomputed from its input (its
           `recompute` flag, read by Block.forward), so FSDP2's hooks on the Block (`fully_shard` per
           layer) stay outside the checkpointed region and parameter names do not change.
Recomputation replays the same ops on the same inputs: losses and gradients are bit-identical on CPU.
Under no_grad (evaluation, scoring) nothing is checkpointed.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .errors import RemodelError

RECOMPUTE_MODES = ("none", "selective", "full")


def maybe_checkpoint(module, fn, *args):
    """fn(*args), under non-reentrant checkpoint when `module.recompute_core` is set (selective mode)
    and autograd records; the mixers call this around their internal core."""
    if getattr(module, "recompute_core", False) and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def set_recompute(model, mode: str):
    """Set the recomputation mode of every layer of `model` (a HybridLM, possibly sharded); returns it.
    Setting "none" undoes any earlier mode. Raises RemodelError for an unknown mode."""
    if mode not in RECOMPUTE_MODES:
        raise RemodelError(f"--recompute must be one of {', '.join(RECOMPUTE_MODES)}, not {mode!r}")
    for block in model.layers:
        block.recompute = mode == "full"
        for m in block.modules():
            if hasattr(type(m), "recompute_core"):
                m.recompute_core = mode == "selective"
    model.recompute = mode
    return model
