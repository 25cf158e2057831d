"""Released pruned shapes beside `plan`'s candidates (issue 59): when the source is a shipped config
(models/configs), each other shipped config of the same family that is a pruned shape of it (every width no
larger, its layers a subsequence of the source's layer units, the same tensors otherwise) and meets the budgets
is a row marked "released": the source config with those widths and layers, counted by models.params (not
copied from the file), e.g. NVIDIA's Nemotron-H 47B (from 56B: hidden 8192, FFN 30720, 98 layers, 46.79B)
and Nemotron-H 4B (from 8B, widths only).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from remodel.compress.search_space import WIDTHS
from remodel.compress.train_memory import train_memory_bytes
from remodel.models.config import ModelConfig
from remodel.models.families import depth_units
from remodel.models.files import read_json
from remodel.models.hf import config_from_hf, our_shapes
from remodel.models.kinds import KINDS
from remodel.models.params import count_params, memory_bytes

from .inspection import CONFIGS
from .plan_file import candidate_config


def _unit_types(cfg: ModelConfig, family: str) -> list[str]:
    return ["".join(cfg.pattern[i] for i in u) for u in depth_units(cfg, family)]


def _dropped(src: list, kept: list) -> list[int] | None:
    """Unit indices of `src` not matched when `kept` is read as a subsequence of it (first match), or None."""
    drop, k = [], 0
    for j, t in enumerate(src):
        if k < len(kept) and kept[k] == t:
            k += 1
        else:
            drop.append(j)
    return drop if k == len(kept) else None


def _shape_of(cfg: ModelConfig, other: ModelConfig, family: str, axes: set) -> dict | None:
    """{"widths", "drop_layers"} that turn `cfg` into `other`'s tensors, or None when `other` is no pruned shape."""
    drop = _dropped(_unit_types(cfg, family), _unit_types(other, family))
    w = {a: WIDTHS[a].of(other) for a in axes}
    if drop is None or not drop and all(w[a] == WIDTHS[a].of(cfg) for a in axes) \
            or any(not isinstance(v, int) or v > WIDTHS[a].of(cfg) for a, v in w.items()):
        return None
    try:
        new = candidate_config(cfg, {"widths": w, "drop_layers": drop}, family)
    except Exception:  # noqa: BLE001 - widths this source cannot take: not one of its shapes
        return None
    return {"widths": w, "drop_layers": drop, "config": new} if our_shapes(new) == our_shapes(other) else None


def released_rows(sp, where: str, axes: set, budgets: dict) -> list[dict]:
    """The released rows (see the module doc) of plan's space `sp` that meet every budget, as plan's candidate
    rows plus "released": the shipped config's name; [] when the source (`where`) is not a shipped config."""
    cfg, family, p = sp.cfg, sp.family, Path(where)
    if p.suffix != ".json" or p.resolve().parent != CONFIGS.resolve():
        return []
    rows = []
    for f in sorted(CONFIGS.glob("*.json")):
        hf = read_json(f)
        if f.resolve() == p.resolve() or hf.get("model_type") != family:
            continue
        shape = _shape_of(cfg, config_from_hf(hf), family, axes)
        if shape is None:
            continue
        row = shape_row(sp, shape.pop("config"), shape["widths"], shape["drop_layers"], budgets)
        if all(row["under_budget"][m] >= 0 for m in budgets):
            rows.append({"rank": "released", "released": f.stem, **row})
    return rows


def shape_row(sp, new: ModelConfig, widths: dict, drop: list[int], budgets: dict) -> dict:
    """A row of plan's table for `new`, the source (`sp.cfg`) with `widths` and the layer units `drop` removed:
    counted by models.params (total, active, memory, train memory per rank) and the prune targets that make it."""
    cfg, types = sp.cfg, _unit_types(sp.cfg, sp.family)
    c = count_params(new, sp.family)
    mem = memory_bytes(new, dtype_bytes=sp.dtype_bytes, batch=sp.batch, seq_len=sp.seq_len)
    train = train_memory_bytes(new, sp.train, largest_active=sp.largest_active)["total"]
    values = {"params": c["total"], "active_params": c["active"], "memory_bytes": mem["total"], "train_bytes": train}
    changed = {a: [WIDTHS[a].of(cfg), v] for a, v in widths.items() if v != WIDTHS[a].of(cfg)}
    gone = Counter(new.pattern)
    by_kind = {KINDS[ch].name: n - gone[ch] for ch, n in Counter(cfg.pattern).items() if n - gone[ch]}
    targets = {a: v for a, (_, v) in changed.items()} | ({"drop_layers": drop} if drop else {})
    row = {k: v for k, v in values.items() if k != "train_bytes"} | {"train_memory_bytes": train}
    return {**row, "weight_bytes": mem["weights"], "cache_bytes": mem["cache"], "widths": widths, "changed": changed,
            "removed": dict(Counter(types[j] for j in drop)), "layers_removed": by_kind, "drop_layers": drop,
            "depth_choice": "as released", "num_layers": new.num_layers, "pattern": new.pattern,
            "under_budget": {m: b - values[m] for m, b in budgets.items()}, "prune_targets": targets}
