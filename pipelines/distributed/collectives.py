"""Autograd-aware collectives for tensor, expert and vocabulary parallelism (Megatron's f / g ops).

Each is the identity when the group is None or has one rank, so single-process code runs unchanged.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F


def group_size(group) -> int:
    """Ranks in `group` (1 for None: no parallelism)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index in `group` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x, group):
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def chunk_bounds(T: int, n: int, r: int):
    """(chunk size, start, end) of rank r's block when T rows are split over n ranks."""
    c = -(-T // n)
    return c, min(r * c, T), min((r + 1) * c, T)


def _all_gather_rows(x, group, T: int):
    """Rows of every rank (each at most ceil(T/n), in rank order) -> [T, ...]."""
    n = group_size(group)
    c = -(-T // n)
    x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, c - x.shape[0])).contiguous()
    out = x.new_empty((n * c,) + tuple(x.shape[1:]))
    dist.all_gather_single(out, x, group=group)  # all_gather_into_tensor is deprecated in torch 2.13
    return out[:T]


class _Adjoint(torch.autograd.Function):
    """forward(x) = fwd(x), backward(g) = bwd(g): a collective paired with its adjoint."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.bwd(g), None, None


def _same(x):
    return x.view_as(x)


def _own_rows(x, group, T):
    _, a, b = chunk_bounds(T, group_size(group), group_rank(group))
    return x[a:b]


def scale_grad(x, scale: float):
    """Identity forward; the gradient scaled by `scale` (EP experts under FSDP's mean)."""
    return _Adjoint.apply(x, _same, lambda g: g * scale)


def copy_to_group(x, group):
    """Identity forward, all-reduce(sum) backward: a replicated tensor entering per-rank-partial work."""
    return x if group_size(group) == 1 else _Adjoint.apply(x, _same, functools.partial(_all_reduce, group=group))


def reduce_from_group(x, group):
    """All-reduce(sum) forward, identity backward: partial results becoming a replicated tensor."""
    return x if group_size(group) == 1 else _Adjoint.apply(x, functools.partial(_all_reduce, group=group), _same)


def all_reduce_sum(x, group):
    """All-reduce(sum) both ways: a replicated sum consumed by per-rank-partial work (the vocab LSE)."""
    reduce = functools.partial(_all_reduce, group=group)
    return x if group_size(group) == 1 else _Adjoint.apply(x, reduce, reduce)


def split_rows(x, group):
    """This rank's contiguous block of the rows of a replicated tensor; backward all-gathers."""
    if group_size(group) == 1:
        return x
    T = x.shape[0]
    return _Adjoint.apply(x, lambda t: _own_rows(t, group, T).clone(), lambda g: _all_gather_rows(g, group, T))


def gather_rows(x, group, T: int):
    """All ranks' row blocks (from `split_rows`) -> the replicated [T, ...]; backward keeps own block."""
    if group_size(group) == 1:
        return x
    return _Adjoint.apply(x, lambda t: _all_gather_rows(t, group, T), lambda g: _own_rows(g, group, T).contiguous())


