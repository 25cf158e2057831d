"""A cheap estimate of the loss a pruned shape costs, from SCORES alone (no weights, no data): what `plan` ranks
its candidates by when given scores, and so which candidates `search` prunes and measures.

Each layer l is worth w[l], its depth score: loss_increase (the loss increase, nats/token, when l alone is
removed) when the scores have it, else block_importance; a negative or NaN value counts as 0. A dropped layer
costs w[l]; a kept layer costs w[l] x the share of it the width cuts remove, 1 - (1 - f_hidden)(1 - f_l), where
f_l is the largest share of activation importance removed at one of its score sites (the units compress.prune
drops for the same targets) and f_hidden that of the residual stream. First order and additive: it orders
shapes, it does not predict a loss (search measures that).
"""
from __future__ import annotations

import torch

from remodel.models.config import ModelConfig
from remodel.models.kinds import KINDS

from .prune import depth_metric, kept_layers, plan_keep


def layer_worth(cfg: ModelConfig, scores: dict) -> list[float]:
    """w[l] of every layer (see the module doc)."""
    s = scores[depth_metric(scores)].double()
    return torch.nan_to_num(s, nan=0.0).clamp(min=0).tolist()[:cfg.num_layers]


def removed_share(s: torch.Tensor, axes: tuple, keep: dict, prefix: str) -> float:
    """The share of score tensor `s` (one dimension per axis in `axes`) on the units `keep` drops."""
    t = s.double().clamp(min=0)
    total = float(t.sum())
    for d, a in enumerate(axes):
        idx = keep.get(prefix + a)
        if idx is None:
            continue
        t = t.index_select(d, idx) if idx.dim() == 1 else t.gather(d, idx)  # 2-D: per row (expert FFN)
    return 1.0 - float(t.sum()) / total if total > 0 else 0.0


def estimate_loss(cfg: ModelConfig, scores: dict, targets: dict, family: str | None = None) -> float:
    """The estimated loss increase of pruning `cfg` to `targets` (compress.prune.plan_keep's), in the unit of
    the depth metric (nats/token for loss_increase)."""
    keep = plan_keep(cfg, scores, targets, family)
    w = layer_worth(cfg, scores)
    kept = set(kept_layers(cfg, keep))
    f_hidden = removed_share(scores["hidden"], ("hidden",), keep, "") if "hidden" in keep else 0.0
    total = sum(w[i] for i in range(cfg.num_layers) if i not in kept)
    for i in sorted(kept):
        p = f"layers.{i}."
        f = max((removed_share(scores[p + site], axes, keep, p) for site, axes in KINDS[cfg.pattern[i]].scored.items()
                 if p + site in scores and any(p + a in keep for a in axes)), default=0.0)
        total += w[i] * (1.0 - (1.0 - f_hidden) * (1.0 - f))
    return total
