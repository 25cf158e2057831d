"""How different the routed experts of one MoE layer are: the mean pairwise cosine of their flattened
weights (up, gate and down of an expert concatenated into one vector).

"same_shard" averages over the pairs built from the same dense shard by the virtual-group upcycle
(expert e holds shard e mod G, so e and e' with e = e' mod G): 1.0 for naive copies, lower once the
copies differ (Drop-Upcycling, or training). "all_pairs" averages over every pair (shards of different
neurons are near-orthogonal, so it mixes two populations when G > 1). The Gram matrix is summed in
float64, a block of columns at a time; a LazyExperts projection is read once per distinct shard.
"""
from __future__ import annotations

import torch

from .virtual_groups import LazyExperts

UPCYCLE_KEY = "remodel_upcycle"  # config.json: how an upcycled checkpoint's experts were built


def _gram(t: torch.Tensor, cols: int = 1 << 16) -> torch.Tensor:
    """[n, ...] -> the [n, n] float64 Gram matrix of the flattened rows."""
    flat = t.detach().reshape(len(t), -1)
    g = torch.zeros(len(t), len(t), dtype=torch.float64, device=flat.device)
    for c in range(0, flat.shape[1], cols):
        b = flat[:, c:c + cols].double()
        g += b @ b.T
    return g


def expert_gram(projections) -> torch.Tensor:
    """[N, N] float64 Gram matrix of the experts' flattened weights over all `projections` (each a fused
    [N, ...] tensor or LazyExperts)."""
    total = None
    for t in projections:
        if isinstance(t, LazyExperts):
            e = torch.arange(t.n) % len(t.shards)
            g = _gram(t.shards)[e][:, e]
        else:
            g = _gram(t)
        total = g if total is None else total + g.to(total.device)
    return total.cpu()


def similarity(gram: torch.Tensor, granularity: int | None = None) -> dict:
    """{"all_pairs": mean cosine over every pair of experts, "same_shard": over the pairs e = e' mod G
    (None when G is unknown or no two experts share a shard)}."""
    n = len(gram)
    norm = gram.diagonal().clamp_min(1e-300).sqrt()
    cos = gram / norm[:, None] / norm[None, :]
    i, j = torch.triu_indices(n, n, 1)
    out = {"all_pairs": cos[i, j].mean().item() if n > 1 else None, "same_shard": None}
    if granularity:
        same = (i % granularity) == (j % granularity)
        out["same_shard"] = cos[i[same], j[same]].mean().item() if bool(same.any()) else None
    return out


def expert_similarity(projections, granularity: int | None = None) -> dict:
    return similarity(expert_gram([p for p in projections if p is not None]), granularity)
