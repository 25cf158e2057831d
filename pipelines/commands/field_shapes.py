"""The field's shapes beside `plan`'s candidates (issue 56): the cuts published for fine-grained MoEs and MLA
models, whatever the budget, each the source with one width cut and counted exactly by models.params:
  experts       25% and 50% of the routed experts removed (REAP-style expert-pruned releases of GLM-4.x,
                Qwen3-30B-A3B, DeepSeek-V3 / Kimi-K2, MiniMax-M2), the count kept a multiple of n_group;
  mla_heads     25% and 50% of the MLA attention heads removed;
  kv_lora_rank  the MLA key / value latent rank cut by 25% and 50%.
A cut `remodel prune` would refuse (compress.prune.validate_targets) is left out. Rows are marked "field"; their
`under` column says by how much each misses the budget when it does.
"""
from __future__ import annotations

from remodel.compress.prune import validate_targets
from remodel.compress.search_space import WIDTHS
from remodel.models.errors import RemodelError

from .plan_file import candidate_config
from .released import shape_row

CUTS = (0.25, 0.5)
AXES = ("experts", "mla_heads", "kv_lora_rank")


def _step(cfg, axis: str) -> int:
    """What a cut value must be a multiple of: the expert groups (n_group) for experts, else 1."""
    return (cfg.moe.n_group or 1) if axis == "experts" else 1


def cut_value(cfg, axis: str, cut: float) -> int | None:
    """`axis`'s size with the share `cut` removed (rounded down to its step), or None when that is no cut."""
    n, g = WIDTHS[axis].of(cfg), _step(cfg, axis)
    v = int(n * (1 - cut)) // g * g
    return v if 0 < v < n else None


def field_rows(sp, axes: set, budgets: dict) -> list[dict]:
    """plan's rows for each of the field's cuts (see the module doc) the source `sp.cfg` has an axis for."""
    cfg, rows = sp.cfg, []
    base = {a: WIDTHS[a].of(cfg) for a in axes}
    for axis in (a for a in AXES if a in axes):
        for cut in CUTS:
            v = cut_value(cfg, axis, cut)
            try:
                if v is None or not validate_targets(cfg, {axis: v}, sp.family):
                    continue
                new = candidate_config(cfg, {"widths": {**base, axis: v}, "drop_layers": []}, sp.family)
            except RemodelError:
                continue
            row = shape_row(sp, new, {**base, axis: v}, [], budgets)
            rows.append({"rank": "field", "field": f"{axis} -{round(100 * cut)}%", **row, "depth_choice": None})
    return rows
