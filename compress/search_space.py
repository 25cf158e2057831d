"""Candidate architectures under a budget, by arithmetic alone (Minitron NAS / MiniPuzzle search space).

A candidate is one homogeneous width per axis plus a number of layers removed per layer type:
  widths  the source value, or a multiple of the axis divisor cut by at most `max_width_cut`:
          hidden and LatentMoE latent 256, FFN / expert FFN / shared expert 512, Mamba head_dim 8,
          experts 8 (and a multiple of n_group), Mamba heads a multiple of n_groups (group-aware pruning
          keeps the same number per group), attention heads a multiple of num_key_value_heads, Gated
          DeltaNet key heads one by one and value heads in whole groups of the kept key heads (at most
          each key head's own: the combinations compress.prune accepts, _joint_ok). A width
          below 8x its divisor steps by the largest power of two <= width / 8 instead (expert FFN 1856
          by 128, latent 1024 by 128, a 32-wide toy model by 4), so every axis offers a handful of
          values; the source's own value is always kept even when it is no multiple (Nano's hidden
          2688 = 10.5 x 256). Expert FFN and latent (hidden, without a latent) stay multiples of 8
          (transformers' grouped expert matmul, as compress.prune checks); Llama hidden stays a
          multiple of the heads.
  depth   per layer type (M, *, -, E; for Llama/Mixtral/Qwen the '*-' / '*E' decoder layer, dropped as
          a pair like compress.prune.layer_units), up to `max_type_cut` of that type (one always kept)
          and `max_depth_cut` of all layers together. MiniPuzzle's 56B -> 47B removed 9/54 M, 6/54 -,
          5/10 * (17% of the layers, half the attention), hence 0.5 per type and 0.2 overall.
The default maximum width cut is 0.45, not the reference's "~40%": the published Minitron-SSM
8B -> 4B cut the FFN by 42.9% (21504 -> 12288). The default axes leave out Mamba head_dim and
attention heads (Minitron-SSM: pruning heads beats pruning head_dim; NVIDIA leaves attention heads
alone in hybrids); name them in `axes` (or use the preset "all") to search them too.

Every metric is additive over layers at fixed *outer* widths, so the search runs per outer point over
per-type option arrays (numpy outer sums, pruned by the budget as it goes). The outer widths are the
hidden size and every axis two unit types share (Bamba's 'M-' and '*-' decoder layers share the FFN,
Granite's 'ME' and '*E' the experts): one value for all layers, never one per type. Widths one config.json key
of the family holds (Family.one_key: Jamba's MLP and expert FFN, both its intermediate_size) are one knob: one
option list (the values valid for each of them), applied to all of them. Exact total and active
parameters (models.params' per-layer formulas; pipelines.commands.plan re-checks every candidate it returns
with count_params) and memory as models.params.memory_bytes counts it (weights at `dtype_bytes`,
router correction bias fp32, KV cache of `batch` x `seq_len` tokens in bf16, Mamba conv state bf16 +
SSM state fp32).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from remodel.models.config import ModelConfig
from remodel.models.kinds import KINDS, used
from remodel.models.errors import RemodelError
from remodel.models.families import depth_units, family as family_of
from remodel.models.hf import default_family
from remodel.models.kinds import PRUNABLE, WIDTHS as ALL_WIDTHS, widths as cfg_widths
from remodel.models.params import per_layer

from .depth_counts import allowed_codes, counts_ok, removal_ok
from .prune import group_width
from .train_memory import TrainSetup, base_bytes, layer_figures, unit_bytes

WIDTHS = {n: ALL_WIDTHS[n] for n in PRUNABLE}  # the search axes: the kinds' prunable Widths (models.kinds)
# {axis of whole groups: the axis counting those groups}, where both are searched (Gated DeltaNet value heads in
# key-head groups; compress.prune.group_width)
_GROUPED = {a: g for a in WIDTHS if (g := group_width(a))}
ALL_AXES = tuple(WIDTHS) + ("depth",)
DEFAULT_AXES = ("hidden_size", "ffn_size", "mamba_heads", "experts", "expert_ffn_size", "shared_expert_size",
                "latent_size", "depth")
PRESETS = {"default": DEFAULT_AXES, "width": DEFAULT_AXES[:-1], "depth": ("depth",), "all": ALL_AXES}
METRICS = ("params", "active_params", "memory_bytes", "train_bytes")
NM = len(METRICS)
MAX_AXIS_VALUES = 32  # widths per axis: more multiples of the step and the step grows (a huge config)
MAX_REMOVABLE = 64  # units of one type a candidate may remove (the largest shipped model: 27)
MAX_TYPE_OPTIONS = 2 * 10**6  # (widths x units removed) options of one unit type at one hidden size
MAX_FIRST_PAIR = 10**8  # options of the first two unit types crossed (the largest table _feasible builds)
INVALID = 2**58  # metrics of a width combination that breaks a constraint between axes: fits no budget


def parse_axes(axes) -> tuple:
    """None / a preset name / 'a,b,c' / a sequence of axis names -> a tuple of axis names."""
    if axes is None:
        return DEFAULT_AXES
    if isinstance(axes, str):
        axes = PRESETS.get(axes) or [a.strip().replace("-", "_") for a in axes.split(",") if a.strip()]
    bad = [a for a in axes if a not in ALL_AXES]
    if bad or not axes:
        raise RemodelError(f"unknown search axes {bad or '(none)'} (known: {', '.join(ALL_AXES)}; "
                           f"presets: {', '.join(PRESETS)})")
    return tuple(axes)


def step_for(size: int, divisor: int) -> int:
    """The reference divisor, or the largest power of two <= size / 8 when that is smaller (>= 1)."""
    return max(1, min(divisor, 2 ** int(math.log2(max(size // 8, 1)))))


def _valid(cfg: ModelConfig, axis: str, v: int) -> bool:
    """Whether every trunk kind's own rules allow width v on this axis (LayerKind.target_problem)."""
    return not any(k.target_problem(cfg, axis, v) for k in used(cfg, mtp=False))


def _joint_ok(sp: "Space", d: dict, t: str | None = None) -> bool:
    """Constraints between axes, for the layers of unit type t (None: every layer): the width rules the family
    declares (models/families/width_rules.py: hidden a multiple of the heads, the Mamba width of hidden) where
    those layers have the widths, and whole groups of a grouped width."""
    fam = family_of(sp.family)

    def has(axis):
        return any(axis in KINDS[c].widths for c in (t if t is not None else sp.cfg.pattern))
    if any(all(has(a) for a in r.axes) and not r.holds(d) for r in fam.width_rules):
        return False  # a constraint the family's config imposes (hidden a multiple of the heads, ...)
    for a, g in _GROUPED.items():  # a width of whole groups whose group count is searched too (GDN value heads)
        if has(a) and d[a] and not _groups_hold(sp.cfg, a, g, d[a], d[g]):
            return False
    return True


def _groups_hold(cfg: ModelConfig, axis: str, group_axis: str, v: int, g: int) -> bool:
    """Whether `g` kept groups (of the width group_axis) hold `v` units of `axis` as compress.prune keeps them: the
    same number in every group, at most each group's own (a kept GDN key head keeps at most its value heads)."""
    src_g = WIDTHS[group_axis].of(cfg)
    return bool(g) and v % g == 0 and v <= WIDTHS[axis].of(cfg) // src_g * g


def axis_values(cfg: ModelConfig, axis: str, max_cut: float, divisor: int | None = None,
                groups: list[int] | None = None) -> list[int]:
    """The widths searched on one axis, the source's first, then decreasing (`divisor` overrides the
    axis' reference divisor, e.g. scaled down with the widths of a miniature model; `groups`: the searched
    counts of the groups a width of whole groups is made of, when that count is searched too: every multiple of
    one of them is a candidate, _joint_ok keeps the combinations the kept groups hold)."""
    w = WIDTHS[axis]  # the width's own rules: whole groups, or the divisor's step (times the groups)
    divisor = divisor or w.divisor
    size = w.of(cfg)
    if not size or (w.layer is not None and not any(axis in k.widths for k in used(cfg, mtp=False))):  # no kind has it
        return [size]
    if w.multiple_of:
        step = math.gcd(*groups) if groups else w.of(cfg, w.multiple_of)
    elif divisor is None:  # a count searched unit by unit (GDN key heads, each a whole group)
        step = 1
    else:
        step = step_for(size, divisor)
        if w.step_lcm and w.of(cfg, w.step_lcm) > 1:
            step = math.lcm(step, w.of(cfg, w.step_lcm))
    lo = max(math.ceil((1 - max_cut) * size - 1e-9), 1)
    step *= max(1, math.ceil(((size - 1) // step - (lo - 1) // step) / MAX_AXIS_VALUES))  # <= MAX_AXIS_VALUES
    top = (size - 1) // step * step  # multiples of the step only: never a loop over every width
    return [size] + [v for v in range(top, lo - 1, -step) if v > 0 and _valid(cfg, axis, v)]


@dataclass
class Space:
    """The searched grid: width values per axis, unit types and how many of each may go."""
    cfg: ModelConfig
    family: str
    axes: tuple
    values: dict  # axis -> [widths], the source's first (one value: not searched)
    types: list  # unit strings in order of first appearance ('M', '-', '*', 'E' or '*-' / '*E')
    units: dict  # unit string -> [unit index] (into depth_units)
    removable: dict  # unit string -> most units of that type removable
    max_removed: int  # units removable over all types together
    batch: int
    seq_len: int
    dtype_bytes: int
    train: TrainSetup = TrainSetup()  # the training job of the train_bytes metric
    largest_active: int = 0  # the source's largest layer (active params): replayed under full recomputation
    ties: dict = field(default_factory=dict)  # {axis: the axis it is tied to}: one knob (tie)
    depth_ok: np.ndarray | None = None  # removed counts the family can write (compress.depth_counts); None: all

    def _axes_of(self, t: str) -> list[str]:
        """The searched knobs of the kinds in t (their specs): an axis tied to another counts as that one."""
        return list(dict.fromkeys(self.ties.get(a, a) for a, w in WIDTHS.items()
                                  if w.layer is not None and any(a in KINDS[c].widths for c in t)
                                  and len(self.values[a]) > 1))

    def full(self, d: dict) -> dict:
        """Widths d with every tied axis at the value of the axis it is tied to (where d has that one)."""
        return {**d, **{a: d[b] for a, b in self.ties.items() if b in d}}

    def outer_axes(self) -> list[str]:
        """Axes every layer shares: hidden, and each searched axis that two or more unit types use."""
        shared = [a for a in WIDTHS if sum(a in self._axes_of(t) for t in self.types) > 1]
        return ["hidden_size"] + shared

    def type_axes(self, t: str) -> list[str]:
        """The searched width axes only unit type t depends on (the outer axes apart)."""
        outer = self.outer_axes()
        return [a for a in self._axes_of(t) if a not in outer]

    def outer_points(self) -> list[dict]:
        """Every combination of the outer axes' values, the source's first (each axis' values in order)."""
        axes = self.outer_axes()
        return [dict(zip(axes, w)) for w in itertools.product(*(self.values[a] for a in axes))]

    def size(self) -> int:
        """Number of grid points (before the depth total cap)."""
        n = math.prod(len(self.values[a]) for a in self.outer_axes())
        for t in self.types:
            n *= math.prod(len(self.values[a]) for a in self.type_axes(t)) * (self.removable[t] + 1)
        return n


@dataclass(frozen=True)
class Serving:
    """What the memory metric counts: weights at dtype_bytes, the inference cache of `batch` sequences of
    `seq_len` tokens (models.params.memory_bytes)."""
    batch: int = 1
    seq_len: int = 4096
    dtype_bytes: int = 2
    train: TrainSetup = TrainSetup()  # the train_bytes metric's job (compress.train_memory)


def build_space(cfg: ModelConfig, axes=None, max_width_cut: float = 0.45, max_depth_cut: float = 0.2,
                max_type_cut: float = 0.5, serving: Serving = Serving(), family: str | None = None,
                divisors: dict | None = None) -> Space:
    """divisors: {axis: divisor} overriding WIDTHS' divisors (hidden, FFN, head_dim, experts, expert FFN, shared)."""
    family = family or default_family(cfg)
    axes = parse_axes(axes)
    divisors = dict(divisors or {})
    for a, v in divisors.items():
        if a not in WIDTHS or WIDTHS[a].divisor is None or isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise RemodelError(f"bad divisor {a}={v!r} (positive integers for: "
                               f"{', '.join(k for k, w in WIDTHS.items() if w.divisor)})")
    for name, v in (("max_width_cut", max_width_cut), ("max_depth_cut", max_depth_cut), ("max_type_cut", max_type_cut)):
        if not 0 <= v < 1:
            raise RemodelError(f"{name} must be in [0, 1), got {v}")
    fixed = family_of(family).fixed_fields(cfg)  # e.g. the hidden size a vision tower's merger projects into
    groups = tied_groups(cfg, family)  # searched as one knob when any of them is named
    named = set(axes) | {a for g in groups if set(g) & set(axes) for a in g}
    values = {a: axis_values(cfg, a, max_width_cut, divisors.get(a)) if a in named and WIDTHS[a].field not in fixed
              else [WIDTHS[a].of(cfg)]
              for a in WIDTHS}
    for a, g in _GROUPED.items():  # a width of whole groups whose group count is searched: multiples of any kept count
        if a in axes and WIDTHS[a].field not in fixed and len(values[g]) > 1:
            values[a] = axis_values(cfg, a, max_width_cut, divisors.get(a), groups=values[g])
    ties = tie(cfg, groups, values)
    by_type: dict = {}
    for j, u in enumerate(depth_units(cfg, family)):
        by_type.setdefault("".join(cfg.pattern[i] for i in u), []).append(j)
    deep = "depth" in axes
    removable = {t: min(int(max_type_cut * len(js) + 1e-9), len(js) - 1, MAX_REMOVABLE) if deep else 0
                 for t, js in by_type.items()}
    n_units = sum(len(js) for js in by_type.values())
    sp = Space(cfg, family, axes, values, list(by_type), by_type, removable,
               int(max_depth_cut * n_units + 1e-9) if deep else 0, serving.batch, serving.seq_len,
               serving.dtype_bytes, serving.train.check(), max((a for _, a in layer_figures(cfg)), default=0), ties)
    _check_size(sp)
    sp.depth_ok = allowed_codes(sp)
    return sp


def tied_groups(cfg: ModelConfig, family: str) -> list[list[str]]:
    """The groups of axes one config.json key of the family holds (Family.tied_fields: Jamba's MLP and expert FFN,
    both its intermediate_size): each group is one knob of the search."""
    groups = [[a for a in WIDTHS if WIDTHS[a].path in g] for g in family_of(family).tied_fields(cfg)]
    return [g for g in groups if len(g) > 1]


def tie(cfg: ModelConfig, groups: list, values: dict) -> dict:
    """Every axis of a group gets the one option list valid for all of them (`values`, updated in place; the source
    alone where one of them is held): -> {axis: the group's first axis, the knob} for the others."""
    ties = {}
    for g in groups:
        both = [v for v in values[g[0]] if all(v in values[a] for a in g)]
        for a in g:
            values[a] = both if len(both) > 1 else [WIDTHS[a].of(cfg)]
        ties.update({a: g[0] for a in g[1:]})
    return ties


def _check_size(sp: Space) -> None:
    """Refuse (one line) a grid whose per-type option tables would not fit in memory or time (a config of
    extreme widths and depth); every shipped model is far below the bounds."""
    n = [math.prod(len(sp.values[a]) for a in sp.type_axes(t)) * (sp.removable[t] + 1) for t in sp.types]
    for t, k in zip(sp.types, n):
        if k > MAX_TYPE_OPTIONS:
            raise RemodelError(f"search space too large: {k:,} options for layer type {t!r} (at most "
                               f"{MAX_TYPE_OPTIONS:,}); search fewer axes (--axes) or a smaller width cut")
    if len(n) > 1 and n[0] * n[1] > MAX_FIRST_PAIR:
        raise RemodelError(f"search space too large: {n[0]:,} x {n[1]:,} options for layer types {sp.types[0]!r} "
                           f"and {sp.types[1]!r} (at most {MAX_FIRST_PAIR:,}); search fewer axes (--axes)")


# ---- exact metrics by parts ----------------------------------------------------------------------

def unit_metrics(sp: Space, t: str, d: dict) -> np.ndarray:
    """[params, active params, memory bytes, train bytes] of one unit of type t at widths d (pre-norms included)."""
    cfg = sp.cfg
    one = per_layer(cfg, d)
    H = d["hidden_size"]
    out = np.zeros(NM, dtype=np.int64)
    for k in map(KINDS.__getitem__, t):  # weights, the kind's fp32 buffers and its bf16 / fp32 inference cache
        p = one[k.name] + H
        a = p - (one["routed"] - one["routed"] * cfg.moe.num_experts_per_tok // d["experts"] if k.routed else 0)
        v = cfg.view(k)
        m = p * sp.dtype_bytes + 4 * k.buffer_elements(v, d) + sum(k.cache_bytes(v, d, sp.batch, sp.seq_len).values())
        out += np.array([p, a, m, unit_bytes(sp.train, p, a, H)], dtype=np.int64)
    return out


def base_metrics(sp: Space, H: int) -> np.ndarray:
    """Embeddings, lm_head and the final norm at hidden size H: [params, active, memory, train bytes] (the
    latter with the logits, the teacher and a full-recompute replay of the source's largest layer)."""
    cfg = sp.cfg
    p = cfg.vocab_size * H * (1 if cfg.tie_word_embeddings else 2) + H
    return np.array([p, p, p * sp.dtype_bytes, base_bytes(sp.train, p, cfg.vocab_size, H, sp.largest_active)],
                    dtype=np.int64)


def evaluate(sp: Space, widths: dict, removed: dict) -> np.ndarray:
    """[params, active, memory] of one candidate: widths {axis: value} (missing: source), removed {type: n}."""
    d = sp.full({**cfg_widths(sp.cfg), **widths})
    out = base_metrics(sp, d["hidden_size"])
    for t in sp.types:
        out += (len(sp.units[t]) - removed.get(t, 0)) * unit_metrics(sp, t, d)
    return out


def _options(sp: Space, t: str, G: dict):
    """Every (widths, removed) option of unit type t at outer widths G: metrics [n, NM], removed [n], rows."""
    axes, n = sp.type_axes(t), len(sp.units[t])
    base = {**cfg_widths(sp.cfg), **G}
    rows, mets = [], []
    for w in itertools.product(*(sp.values[a] for a in axes)):
        d = sp.full({**base, **dict(zip(axes, w))})
        one = unit_metrics(sp, t, d) if _joint_ok(sp, d, t) else np.full(NM, INVALID, dtype=np.int64)
        for r in range(sp.removable[t] + 1):
            rows.append((dict(zip(axes, w)), r))
            mets.append((n - r) * one if one[0] != INVALID else one)
    return np.array(mets, dtype=np.int64).reshape(-1, NM), np.array([r for _, r in rows], dtype=np.int64), rows


def extremes(sp: Space) -> dict:
    """{metric: (smallest reachable, largest reachable below the source, source)} over the grid."""
    src = evaluate(sp, {}, {})
    smallest = np.full(NM, INVALID, dtype=np.int64)
    for G in sp.outer_points():  # per type and units removed the smallest option, then a
        each = sp.depth_ok is not None  # the counts per type, not their total, where the family restricts them
        dp = {() if each else 0: base_metrics(sp, G["hidden_size"])}  # knapsack over the total-removal cap
        for t in sp.types:
            mets, rem, _ = _options(sp, t, G)
            best = {r: mets[rem == r].min(axis=0) for r in range(sp.removable[t] + 1)}
            new = {}
            for R, v in dp.items():
                for r, m in best.items():
                    K = R + (r,) if each else R + r
                    if (sum(K) if each else K) <= sp.max_removed:
                        new[K] = np.minimum(new[K], v + m) if K in new else v + m
            dp = new
        ok = [v for K, v in dp.items() if not each or removal_ok(sp, dict(zip(sp.types, K)))]
        smallest = np.minimum(smallest, np.min(np.stack(ok), axis=0))
    # largest below the source: every metric is monotone in every knob, so a single step attains it
    steps = [({a: v[1]}, {}) for a, v in sp.values.items() if len(v) > 1 and a not in sp.ties]
    steps += [({}, {t: 1}) for t in sp.types if sp.removable[t] > 0 and removal_ok(sp, {t: 1})]
    steps = [s for s in steps if _joint_ok(sp, sp.full({**cfg_widths(sp.cfg), **s[0]}))]
    largest = np.max(np.stack([evaluate(sp, w, r) for w, r in steps]), axis=0) if steps else src
    return {m: (int(smallest[k]), int(largest[k]), int(src[k])) for k, m in enumerate(METRICS)}


# ---- the search ------------------------------------------------------------------------------------

class _Grid(NamedTuple):
    """The search's tables: the outer points Gs, outer point -> its index, each point's per-type options
    (_options) and each type's one-step-larger option indices (_step_ups)."""
    Gs: list
    at: dict
    opts: list
    ups: list


def _step_ups(sp: Space, rows: list) -> list[np.ndarray]:
    """For one type's option rows: per knob (each searched width axis, then depth), the index of the
    option one step larger on that knob alone (-1: already the source's)."""
    at = {(tuple(w.items()), r): o for o, (w, r) in enumerate(rows)}

    def bigger(w: dict, a: str):
        i = sp.values[a].index(w[a])
        return {**w, a: sp.values[a][i - 1]} if i else None

    ups = []
    for a in rows[0][0]:
        ups.append([at[(tuple(bigger(w, a).items()), r)] if bigger(w, a) else -1 for w, r in rows])
    ups.append([at[(tuple(w.items()), r - 1)] if r else -1 for w, r in rows])
    return [np.array(u, dtype=np.int64) for u in ups]


def search(sp: Space, budgets: dict, tol: float = 0.02, top: int = 20, window_only: bool = True,
           resolution: float = 0.001):
    """Candidates meeting every budget ({metric in METRICS: limit}), ranked; -> (best `top` rows, stats).

    slack = (limit - value) / limit per budget given; the window: the tightest budget's slack <= tol;
    distance = the mean slack over the budgets given (one budget: its slack), so that with several
    budgets the candidates closest to all of them rank first. Only *maximal* candidates are kept:
    growing any one knob by one step (a width to its next larger value, one layer back) would break
    a budget; anything else wastes budget. Ranking: distance in steps of `resolution` (0.1%: closer
    than that is no real difference), then most parameters kept (the fewest units removed, counted
    in parameters; with a params budget alone this is the same order as the distance, while under
    an active-parameter budget alone it puts shapes that drop experts, which free almost no active
    parameters, after those that keep them), then distance, then fewest layers removed. With window_only the
    enumeration skips partial sums that cannot reach the window (fast); otherwise the `top` closest
    feasible candidates come back whatever their distance.
    Each row: {"widths": {axis: value} (every axis), "removed": {type: units}, "metrics": [params,
    active, memory], "distance"}. stats: {"window": in the window, "maximal": of those, maximal}.
    """
    on = np.array([m in budgets for m in METRICS])
    if not on.any():
        raise RemodelError("give at least one budget (params, active params or memory)")
    lim = np.array([float(budgets.get(m, 0)) for m in METRICS])
    Gs = sp.outer_points()
    at = {tuple(G.values()): j for j, G in enumerate(Gs)}  # outer point -> its index
    opts = [[_options(sp, t, G) for t in sp.types] for G in Gs]
    ups = [_step_ups(sp, rows) for _, _, rows in opts[0]]
    radix = [len(o[1]) for o in opts[0]]
    grid = _Grid(Gs, at, opts, ups)

    def fits(m):  # [n, NM] metrics -> meets every budget
        return np.all(~on | (m <= lim), axis=1)

    found, stats = [], {"window": 0, "maximal": 0}
    for gi, G in enumerate(Gs):
        acc, rem, idx = _feasible(sp, opts[gi], G["hidden_size"], fits, on, lim, tol if window_only else None)
        slack = (lim[on] - acc[:, on]) / lim[on]
        dist, win = slack.mean(axis=1), slack.min(axis=1) <= tol
        stats["window"] += int(win.sum())
        o = np.stack([idx // math.prod(radix[k + 1:]) % radix[k] for k in range(len(radix))], axis=1) \
            if len(acc) else np.zeros((0, len(radix)), dtype=np.int64)
        keep = ~_can_grow(sp, grid, gi, acc, o, fits) & counts_ok(sp, opts[gi], o)
        stats["maximal"] += int((keep & win).sum())
        sel = np.flatnonzero(keep & win) if window_only else np.flatnonzero(keep)[np.argsort(dist[keep], kind="stable")[:top]]
        found.append((gi, acc[sel], rem[sel], o[sel], dist[sel]))
    if not any(len(f[1]) for f in found):
        return [], stats
    return _ranked(sp, opts[0], Gs, found, top, resolution), stats


def _feasible(sp: Space, opts: list, H: int, fits, on, lim, tol: float | None):
    """Every combination of the unit types' options at hidden H that can meet the budgets, built type by
    type (pruning partial sums that cannot): -> (metrics [n, NM], units removed [n], mixed-radix index [n]).
    tol: also drop partial sums from which no budget can come within tol (the window); None: keep them."""
    lo = [o[0].min(axis=0) for o in opts]
    most = [o[0].max(axis=0) for o in opts]
    acc = base_metrics(sp, H)[None, :]
    rem = np.zeros(1, dtype=np.int64)
    idx = np.zeros(1, dtype=np.int64)
    for k, (mets, r, _) in enumerate(opts):
        least, big = sum(lo[k + 1:], np.zeros(NM, dtype=np.int64)), sum(most[k + 1:], np.zeros(NM, dtype=np.int64))
        acc = (acc[:, None, :] + mets[None, :, :]).reshape(-1, NM)
        rem = (rem[:, None] + r[None, :]).reshape(-1)
        idx = (idx[:, None] * len(mets) + np.arange(len(mets))[None, :]).reshape(-1)
        ok = (rem <= sp.max_removed) & fits(acc + least)  # even the smallest completion breaks a budget
        if tol is not None:  # some budget must stay reachable within tol
            ok &= np.any(on & (acc + big >= (1 - tol) * lim), axis=1)
        acc, rem, idx = acc[ok], rem[ok], idx[ok]
    return acc, rem, idx


def _can_grow(sp: Space, grid: _Grid, gi: int, acc, o, fits):
    """Per candidate: can a single knob (one type's width or layer count, or an outer width) grow by one
    step within every budget? Those are not maximal."""
    opts, Gs, at, ups = grid.opts, grid.Gs, grid.at, grid.ups
    grow = np.zeros(len(acc), dtype=bool)
    for k, (mets, _, _) in enumerate(opts[gi]):
        for up in ups[k]:
            u = up[o[:, k]]
            grown = o.copy()
            grown[:, k] = np.maximum(u, 0)  # a count the family cannot write is no growth
            grow |= (u >= 0) & fits(acc + mets[grown[:, k]] - mets[o[:, k]]) & counts_ok(sp, opts[gi], grown)
    for a, v in Gs[gi].items():  # an outer width one step larger, every type's option unchanged
        i = sp.values[a].index(v)
        if i:
            j = at[tuple({**Gs[gi], a: sp.values[a][i - 1]}.values())]
            grown = base_metrics(sp, Gs[j]["hidden_size"])[None, :] + sum(opts[j][k][0][o[:, k]] for k in range(o.shape[1]))
            grow |= fits(grown)
    return grow


def _ranked(sp: Space, opts: list, Gs: list, found: list, top: int, resolution: float) -> list:
    """The best `top` rows over every outer point, in the order the search docstring gives."""
    A, R, O, D = (np.concatenate([f[j] for f in found]) for j in (1, 2, 3, 4))
    Gj = np.concatenate([np.full(len(f[1]), f[0]) for f in found])
    order = np.lexsort((R, D, -A[:, 0], np.floor(D / resolution) if resolution > 0 else D))[:top]
    rows = []
    for j in order:
        widths, removed = {a: int(v) for a, v in Gs[Gj[j]].items()}, {}
        for k, t in enumerate(sp.types):
            w, r = opts[k][2][O[j, k]]
            widths.update(w)
            removed[t] = r
        widths = sp.full(widths)
        rows.append({"widths": {a: widths.get(a, v[0]) for a, v in sp.values.items()}, "removed": removed,
                     "metrics": [int(x) for x in A[j]], "distance": float(D[j])})
    return rows
