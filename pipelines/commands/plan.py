"""`remodel plan`: candidate architectures under a parameter / active-parameter / memory budget.

Needs no weights: any source pipelines.commands.inspection accepts (checkpoint dir, config-only dir, config.json
path, shipped name such as 'nemotron-h-56b', an HF config dict or a ModelConfig). The grid and its
arithmetic are in compress/search_space.py; here every returned candidate is rebuilt as a ModelConfig
and re-counted with models.params.count_params / memory_bytes (the plan's numbers are exact, and
checked to be).

Budgets: params and active_params in parameters; memory_gb in GiB (2**30 bytes, the unit of inspect
and every report) of bf16 weights + router bias (fp32) + KV cache and Mamba state for `batch` sequences of
`seq_len` tokens (default 1 x 4096; models.params.memory_bytes), the inference figure; train_memory_gb in
GiB per rank of distilling the candidate from the source at tp / ep / dp, recompute and train_batch
(compress.train_memory, the estimate `distill`'s report gives beside what its ranks hold). A candidate meets every budget given; the window
keeps those whose tightest budget is within `tol` (default 2%) and that are maximal (no single width
or layer could be given back within the budgets); ranking: closeness (the mean slack over the
budgets, in steps of 0.1%), then most parameters kept (see compress.search_space.search). With SCORES
the `pool` (200) closest are ranked by estimated loss instead (compress/estimate.py: from the scores
alone), and `search` prunes and measures the best of those.
Parameters alone do not pick an architecture: thousands of shapes land within 0.1% of a budget.
The published 56B -> 47B (MiniPuzzle) and 8B -> 4B (Minitron-SSM) shapes are in the grid with their
exact counts, but were chosen by measured accuracy; restrict `axes` to a recipe's knobs (e.g.
('ffn_size', 'depth') for MiniPuzzle, 'width' for Minitron-SSM) and add the deployment memory budget
to get near them, then let `remodel search` rank candidates by loss.

Depth: how many layers of each type go is part of the candidate. Which ones: with SCORES (a
`remodel score` directory), the least important of that type by `loss_increase` when present, else
`block_importance` (the pruner's own metric, compress.prune.depth_metric); without scores an evenly
spaced placeholder choice within each type (pattern and drop_layers then only illustrate the counts;
score the model before pruning to a candidate). Where the family places its layer types by a rule (Family.depth_forms:
Jamba's attention and experts every period layers from an offset) only counts some placement can write are searched,
and the layers are the writable set of least score (without scores: nearest the evenly spaced choice).
"""
from __future__ import annotations

import math
import os
import shlex
import time

from remodel.compress.search_space import METRICS, WIDTHS, Serving, build_space, depth_units, extremes, search
from remodel.models.config import ModelConfig
from remodel.models.families.depth_forms import choose
from remodel.models.kinds import KINDS, routed, used
from remodel.models.errors import RemodelError
from remodel.compress.train_memory import TrainSetup, train_memory_bytes
from remodel.models.params import count_params, memory_bytes

from .configs import PlanOptions
from .inspection import fmt_bytes, fmt_count, resolve_source, stored_bytes
from .options import given, make
from .plan_file import candidate_config, check_plan_out, write_plan

FIELDS = {a: w.path for a, w in WIDTHS.items()}  # axis -> its config path
SHORT = {a: w.short for a, w in WIDTHS.items()}  # axis -> table column label


FLAGS = {"params": "--params", "active_params": "--active-params", "memory_bytes": "--memory-gb",
         "train_bytes": "--train-memory-gb"}


def _budgets(params, active_params, memory_gb, train_memory_gb=None) -> dict:
    """{metric: limit}: parameters, and the memory budgets given in GiB (2**30 bytes) as bytes."""
    out = {}
    for key, v, scale in (("params", params, 1), ("active_params", active_params, 1),
                          ("memory_bytes", memory_gb, 2**30), ("train_bytes", train_memory_gb, 2**30)):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise RemodelError(f"{FLAGS[key]} must be a positive number, got {v!r}")
        out[key] = int(v * scale)
    if not out:
        raise RemodelError("give a budget: --params, --active-params, --memory-gb or --train-memory-gb")
    return out


def _fmt(metric: str, v: int) -> str:
    return fmt_bytes(v) if metric.endswith("_bytes") else fmt_count(v)


def _label(metric: str) -> str:
    return {"memory_bytes": "memory", "train_bytes": "train memory"}.get(metric, metric)


def _ranges(ex: dict, budgets: dict) -> str:
    return "; ".join(f"{_label(m)}: smallest reachable {_fmt(m, ex[m][0])}, largest {_fmt(m, ex[m][1])} "
                     f"(source {_fmt(m, ex[m][2])})" for m in budgets)


def _train_setup(o: PlanOptions, cfg: ModelConfig) -> TrainSetup:
    """The job --train-memory-gb sizes: distilling a candidate from MODEL (the teacher) at the given layout."""
    return TrainSetup(tp=o.tp, ep=o.ep, dp=o.dp, recompute=o.recompute, batch=o.train_batch, seq_len=o.seq_len,
                      teacher_params=count_params(cfg)["total"]).check()


def _load_depth_scores(scores, cfg: ModelConfig, family: str):
    """-> (per-unit scores list, metric name, the score tensors) from a SCORES directory, checked against the
    model."""
    from remodel.compress.prune import depth_metric
    from remodel.compress.scores import load_scores

    from .prune import check_scores_match

    tensors, meta = load_scores(scores)
    check_scores_match(cfg, meta, scores)
    metric = depth_metric(tensors)
    s = tensors.get(metric)
    if s is None or tuple(s.shape) != (cfg.num_layers,):
        got = "missing" if s is None else f"shape {list(s.shape)}"
        raise RemodelError(f"{scores}: '{metric}' is {got}, expected [{cfg.num_layers}] (one per layer)")
    s = s.double().tolist()
    return [sum(s[i] for i in u) for u in depth_units(cfg, family)], metric, tensors


def _used_axes(cfg: ModelConfig) -> set:
    """The width axes MODEL has (hidden, and those of its layer kinds): a dense model's plan carries no MoE fields."""
    kinds = used(cfg)
    return {a for a, w in WIDTHS.items() if w.layer is None or any(a in k.widths for k in kinds)}


def _drop(sp, removed: dict, unit_scores) -> list[int]:
    """Unit indices to drop: per type the least important (ties: lower index), or evenly spaced, among the sets
    the family can write (models.families.depth_forms.choose)."""
    out = []
    for t, r in removed.items():
        js = sp.units[t]
        if not r:
            continue
        if unit_scores is not None:
            out += sorted(js, key=lambda j: (unit_scores[j], j))[:r]
        else:  # placeholder without scores: r units spread evenly over the type's n
            out += [js[int((i + 0.5) * len(js) / r)] for i in range(r)]
    # where the family places its layer types by a rule (Jamba's period and offset) and these break it: the set it
    # holds of least scores, or without scores the one sharing the most units with the evenly spaced choice
    n = sum(map(len, sp.units.values()))
    cost = unit_scores if unit_scores is not None else [float(j not in out) for j in range(n)]
    return choose(sp.cfg, sp.family, removed, cost, out)


def _candidate(sp, row: dict, budgets: dict, unit_scores, metric, rank: int) -> dict:
    cfg = sp.cfg
    drop = _drop(sp, row["removed"], unit_scores)
    w = row["widths"]
    new = candidate_config(cfg, {"widths": w, "drop_layers": drop}, sp.family)
    pattern = new.pattern
    c, mem = count_params(new), memory_bytes(new, dtype_bytes=sp.dtype_bytes, batch=sp.batch, seq_len=sp.seq_len)
    train = train_memory_bytes(new, sp.train, largest_active=sp.largest_active)
    exact = [c["total"], c["active"], mem["total"], train["total"]]
    if exact != row["metrics"]:  # the grid's arithmetic against models.params: must never differ
        raise AssertionError(f"plan arithmetic {row['metrics']} != count_params/memory_bytes/train_memory_bytes "
                             f"{exact} for {w} {pattern}")
    changed = {a: [cfg.value(FIELDS[a]), v] for a, v in w.items() if v != cfg.value(FIELDS[a])}
    by_kind = {}
    for t, r in row["removed"].items():
        for ch in t:
            if r:
                by_kind[KINDS[ch].name] = by_kind.get(KINDS[ch].name, 0) + r
    targets = {a: v for a, (_, v) in changed.items()}
    if drop:
        targets["drop_layers"] = drop
    values = dict(zip(METRICS, exact))
    return {
        "rank": rank,
        "widths": {a: v for a, v in w.items() if a in _used_axes(cfg)},
        "changed": changed,
        "removed": row["removed"],  # units removed per unit type ('M', '-', '*', 'E' or '*-' pairs)
        "layers_removed": by_kind,  # layers removed per layer kind
        "drop_layers": drop,  # unit indices (what `remodel prune --drop-layers` takes)
        "depth_choice": (metric if unit_scores is not None else "evenly spaced (placeholder, no scores)") if drop else None,
        "drop_cost": sum(unit_scores[j] for j in drop) if unit_scores is not None and drop else None,
        "num_layers": len(pattern),
        "pattern": pattern,
        "params": c["total"],
        "active_params": c["active"],
        "memory_bytes": mem["total"],
        "weight_bytes": mem["weights"],
        "cache_bytes": mem["cache"],
        "train_memory_bytes": train["total"],  # per rank (compress.train_memory; `distill` reports it too)
        "train_memory": {k: v for k, v in train.items() if k != "setup"},
        "under_budget": {m: budgets[m] - values[m] for m in budgets},
        "distance": row["distance"],
        "prune_targets": targets,
    }


def _estimate(sp, tensors: dict, c: dict) -> float:
    from remodel.compress.estimate import estimate_loss
    return estimate_loss(sp.cfg, tensors, c["prune_targets"], sp.family)


def _by_estimate(sp, cands: list, tensors: dict, top: int) -> list:
    """The `top` candidates of lowest estimated loss (compress.estimate; ties: closer to the budget), re-ranked."""
    for c in cands:
        c["estimate"] = _estimate(sp, tensors, c)
    best = sorted(cands, key=lambda c: (c["estimate"], c["rank"]))[:top]
    for i, c in enumerate(best):
        c["closeness_rank"], c["rank"] = c["rank"], i + 1
    return best


def _removed_str(removed: dict) -> str:
    return " ".join(f"{r}{t}" for t, r in removed.items() if r) or "-"


def format_plan(d: dict) -> str:
    """The table `plan` prints."""
    lines = [f"{d['source']}: {d['family']}, {fmt_count(d['source_params']['params'])} params"
             + (f" ({fmt_count(d['source_params']['active_params'])} active)" if d["moe"] else "")
             + f", {d['source_layers']} layers, {fmt_bytes(d['source_params']['memory_bytes'])}"
             + (f" (stored: {fmt_bytes(d['source_stored_bytes'])})" if d.get("source_stored_bytes") else "")]
    train = "train_bytes" in d["budgets"]
    t = d["train"]
    lines.append("budget: " + ", ".join(f"{_label(m)} <= {_fmt(m, v)}" for m, v in d["budgets"].items())
                 + f" (window: tightest within {100 * d['tol']:g}%); memory = bf16 weights + cache at batch "
                 f"{d['batch']} x {d['seq_len']} tokens" + (
                     f"; train memory per rank = distilling from the source: fp32 weights + grads + Adam + teacher "
                     f"+ activations, tp {t['tp']} ep {t['ep']} dp {t['dp']}, recompute {t['recompute']}, batch "
                     f"{t['batch']} x {t['seq_len']}" if train else ""))
    sp = ", ".join(f"{SHORT[a]} {len(v)} ({v[-1]}..{v[0]})" for a, v in d["space"].items() if len(v) > 1)
    dep = ", ".join(f"{t} <= {n}" for t, n in d["depth"].items() if n)
    lines.append(f"space: {sp or 'no widths'}; depth: {dep + ' (total <= ' + str(d['max_removed']) + ')' if dep else 'none'}"
                 f"; {d['grid']:,} points, {d['window']:,} in the window, {d['maximal']:,} maximal; {d['seconds']:.2f} s")
    if d["note"]:
        lines.append(d["note"])
    lines.append(f"ranked by estimated loss increase (est. loss, in {d['depth_metric']} units: the dropped layers' "
                 f"scores + each kept layer's score x the share of its importance cut) over the {d['pool']} closest"
                 if d["scored"] else "ranked by closeness to the budget (give --scores to rank by estimated loss)")
    axes = [a for a, v in d["space"].items() if len(v) > 1]
    head = ["#", "params"] + (["active"] if d["moe"] else []) + ["memory"] + (["train"] if train else []) + ["under"] \
        + [SHORT[a] for a in axes] \
        + ["removed", "layers"] + (["est. loss"] if d["scored"] else [])
    rows = []
    for c in d["candidates"] + d.get("released", []) + d.get("field", []):
        m = min(d["budgets"], key=lambda k: c["under_budget"][k] / d["budgets"][k])
        r = [str(c.get("field", c["rank"])), fmt_count(c["params"])] + ([fmt_count(c["active_params"])] if d["moe"] else []) \
            + [fmt_bytes(c["memory_bytes"])] + ([fmt_bytes(c["train_memory_bytes"])] if train else []) \
            + [f"{100 * c['under_budget'][m] / d['budgets'][m]:.3f}%"] \
            + [str(c["widths"][a]) for a in axes] + [_removed_str(c["removed"]), str(c["num_layers"])] \
            + ([f"{c['estimate']:.4g}"] if d["scored"] else [])
        rows.append(r)
    width = [max(len(x) for x in col) for col in zip(head, *rows)]
    cmds = ["command"] + [c.get("command", "") for c in d["candidates"] + d.get("released", []) + d.get("field", [])]
    for r, cmd in zip([head] + rows, cmds):
        lines.append("  ".join(x.rjust(n) for x, n in zip(r, width)) + "  " + cmd)
    if d["candidates"]:
        c = d["candidates"][0]
        how = f" ({c['depth_choice']})" if c["depth_choice"] else ""
        lines.append(f"#1 pattern{how}: {c['pattern']}")
    for c in d.get("released", []):
        lines.append(f"released: {c['released']} (shipped config, counted here from the source with its widths and "
                     f"layers): pattern {c['pattern']}")
    if d.get("field"):
        lines.append("field rows (experts / MLA heads / kv_lora_rank -25% / -50%): the published cuts, shown "
                     "whatever the budget (under < 0: over it)")
    return "\n".join(lines)


def plan(model=None, params=None, opts: PlanOptions | None = None, **kw) -> dict:
    """Print and return the `top` candidates under the budget (see the module docstring); the options are
    PlanOptions (pipelines/commands/configs.py), given as `opts` or by name.

    axes: which knobs to search: None (default: hidden, FFN, Mamba heads, experts, expert FFN, shared
    expert, LatentMoE latent, depth), a preset ('width', 'depth', 'all') or names from compress.search_space.ALL_AXES.
    divisors: {axis: divisor} overriding the reference width divisors (e.g. scaled with a miniature).
    """
    o = make(PlanOptions, opts, **given(model=model, params=params), **kw)
    model, params, active_params, memory_gb, scores = o.model, o.params, o.active_params, o.memory_gb, o.scores
    tol, top, batch, seq_len = o.tol, o.top, o.batch, o.seq_len
    if o.out is not None:
        check_plan_out(o.out, o.overwrite)  # before any work
    cfg, hf, ckpt, where = resolve_source(model)
    t0 = time.time()
    budgets = _budgets(params, active_params, memory_gb, o.train_memory_gb)
    if not 0 <= tol < 1:
        raise RemodelError(f"tol must be in [0, 1), got {tol}")
    if top < 1:
        raise RemodelError(f"top must be >= 1, got {top}")
    sp = build_space(cfg, o.axes, o.max_width_cut, o.max_depth_cut, o.max_type_cut,
                     Serving(batch=batch, seq_len=seq_len, train=_train_setup(o, cfg)), family=(hf or {}).get("model_type"), divisors=o.divisors)
    unit_scores, metric, tensors = _load_depth_scores(scores, cfg, sp.family) if scores is not None else (None,) * 3
    ex = extremes(sp)
    src = {m: ex[m][2] for m in METRICS}
    if all(src[m] <= b for m, b in budgets.items()):
        raise RemodelError(f"nothing to prune: the source already fits the budget; {_ranges(ex, budgets)}")
    short = [m for m, b in budgets.items() if b < ex[m][0]]
    if short:
        raise RemodelError(f"budget below every candidate ({', '.join(short)}); {_ranges(ex, budgets)} "
                           f"(max cuts: width {o.max_width_cut:g}, depth {o.max_depth_cut:g})")
    pool = top if tensors is None else max(top, o.pool)  # with scores: the estimate ranks the closest `pool`
    rows, stats = search(sp, budgets, tol, pool)
    note = None
    if not rows:
        rows, _ = search(sp, budgets, tol, pool, window_only=False)
        if not rows:
            raise RemodelError(f"no candidate meets every budget together; {_ranges(ex, budgets)}")
        note = f"note: no candidate within {100 * tol:g}% of the budget; the closest ones below it follow"
    cands = [_candidate(sp, r, budgets, unit_scores, metric, i + 1) for i, r in enumerate(rows)]
    if tensors is not None:
        cands = _by_estimate(sp, cands, tensors, top)
    from .released import released_rows
    released = released_rows(sp, where, _used_axes(cfg), budgets)
    from .field_shapes import field_rows
    field = field_rows(sp, _used_axes(cfg), budgets)
    for c in released + field if tensors is not None else ():
        c["estimate"] = _estimate(sp, tensors, c)
    out = {
        "source": where, "family": sp.family, "source_layers": cfg.num_layers, "moe": routed(cfg),
        "source_params": src, "budgets": budgets, "tol": tol, "batch": batch, "seq_len": seq_len,
        "train": dict(sp.train.__dict__), "source_stored_bytes": stored_bytes(ckpt),  # as stored (FP8: + scales)
        "axes": [a for a in sp.axes if a == "depth" or a in _used_axes(cfg)], "space": {a: v for a, v in sp.values.items() if a in _used_axes(cfg)}, "depth": dict(sp.removable),
        "max_removed": sp.max_removed, "grid": sp.size(), "window": stats["window"], "maximal": stats["maximal"],
        "reachable": {m: {"smallest": ex[m][0], "largest": ex[m][1]} for m in METRICS},
        "scored": unit_scores is not None, "depth_metric": metric, "note": note, "pool": len(rows),
        "seconds": time.time() - t0, "candidates": cands, "released": released, "field": field,
    }
    return _finish(o, out, cfg)


def _command(model, c: dict, plan_out, scores) -> str:
    """The command that writes candidate `c`: prune --plan PLAN --candidate K, or (no PLAN written) its targets."""
    m = shlex.quote(str(model)) if isinstance(model, (str, os.PathLike)) else "MODEL"
    if plan_out is not None:
        return f"remodel prune {m} OUT --plan {shlex.quote(str(plan_out))} --candidate {c['rank']}"
    flags = [f"--{a.replace('_', '-')} {v}" for a, v in c["prune_targets"].items() if a != "drop_layers"]
    if c["drop_layers"]:
        flags.append("--drop-layers " + ",".join(map(str, c["drop_layers"])))
    src = f"--scores {shlex.quote(str(scores))}" if scores is not None else "--scores SCORES"
    return " ".join([f"remodel prune {m} OUT {src}", *flags])


def _finish(o: PlanOptions, out: dict, cfg: ModelConfig) -> dict:
    """Each row's command, the PLAN file (--out), the table."""
    for c in out["candidates"]:
        c["command"] = _command(o.model, c, o.out, o.scores)
    for c in out["released"] + out["field"]:
        c["command"] = _command(o.model, c, None, o.scores)
    if o.out is not None:
        write_plan(o.out, out, cfg)
    if o.verbose and not o.json:
        print(format_plan(out))
    return out
