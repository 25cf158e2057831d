"""Autograd-aware collectives for tensor, expert and vocabulary parallelism (Megatron's f / g ops).

Each is the identity when the group is None or has one rank, so single-process code runs unchanged.
"""
from __future__ import annotations

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


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _AllReduceSum(_ReduceFromGroup):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _SplitRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.T = group, x.shape[0]
        _, a, b = chunk_bounds(x.shape[0], group_size(group), group_rank(group))
        return x[a:b].clone()

    @staticmethod
    def backward(ctx, g):
        return _all_gather_rows(g, ctx.group, ctx.T), None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, T):
        ctx.group, ctx.T = group, T
        return _all_gather_rows(x, group, T)

    @staticmethod
    def backward(ctx, g):
        _, a, b = chunk_bounds(ctx.T, group_size(ctx.group), group_rank(ctx.group))
        return g[a:b].contiguous(), None, None


class ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient scaled by `scale` (EP experts under FSDP's mean)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def copy_to_group(x, group):
    """Identity forward, all-reduce(sum) backward: a replicated tensor entering per-rank-partial work."""
    return x if group_size(group) == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x, group):
    """All-reduce(sum) forward, identity backward: partial results becoming a replicated tensor."""
    return x if group_size(group) == 1 else _ReduceFromGroup.apply(x, group)


def all_reduce_sum(x, group):
    """All-reduce(sum) both ways: a replicated sum consumed by per-rank-partial work (the vocab LSE)."""
    return x if group_size(group) == 1 else _AllReduceSum.apply(x, group)


def split_rows(x, group):
    """This rank's contiguous block of the rows of a replicated tensor; backward all-gathers."""
    return x if group_size(group) == 1 else _SplitRows.apply(x, group)


def gather_rows(x, group, T: int):
    """All ranks' row blocks (from `split_rows`) -> the replicated [T, ...]; backward keeps own block."""
    return x if group_size(group) == 1 else _GatherRows.apply(x, group, T)


