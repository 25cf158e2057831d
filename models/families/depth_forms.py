"""Which decoder layers depth pruning may drop where a family places its layer types by a rule (Family.depth_forms:
Jamba puts attention and experts every period layers from an offset). plan asks `possible` for each count of units
removed per type (a count no placement can write is never proposed) and `choose` for the layers; prune re-places a
plan's layers with `choose`. A family without such a rule (depth_forms None) keeps the caller's own choice."""
from __future__ import annotations

import itertools

from remodel.models.errors import RemodelError

from . import depth_units, family as family_of

def unit_types(cfg, family: str) -> list[str]:
    """The type (its layers' pattern characters) of each depth unit of `cfg` in family `family`."""
    return ["".join(cfg.pattern[i] for i in u) for u in depth_units(cfg, family)]

def _forms(cfg, family: str, removed: dict):
    return family_of(family).depth_forms(unit_types(cfg, family), {t: r for t, r in removed.items() if r})

def constrained(cfg, family: str) -> bool:
    """Whether the family restricts which units may go (its depth_forms is not None)."""
    return _forms(cfg, family, {}) is not None

def _embeds(form: tuple, types: list) -> bool:
    """Whether `form` is a subsequence of `types`."""
    it = iter(types)
    return all(any(t == f for t in it) for f in form)

def possible(cfg, family: str, removed: dict) -> bool:
    """Whether some set of units dropping removed[t] of each type t leaves a pattern the family holds."""
    forms = _forms(cfg, family, removed)
    types = unit_types(cfg, family)
    return forms is None or any(_embeds(f, types) for f in forms)

def _cheapest(form: tuple, types: list, cost: list) -> tuple[float, list] | None:
    """(dropped cost, dropped unit indices) of the embedding of `form` in `types` whose dropped units cost least
    (ties: the first found); None if `form` is no subsequence of `types`."""
    n, m = len(types), len(form)
    best = [[None] * (m + 1) for _ in range(n + 1)]  # best[i][k]: most kept cost of types[:i] holding form[:k]
    kept = [[False] * (m + 1) for _ in range(n + 1)]  # whether best[i][k] keeps unit i-1
    best[0][0] = 0.0
    for i in range(n):
        for k in range(m + 1):
            if best[i][k] is None:
                continue
            if best[i + 1][k] is None or best[i][k] > best[i + 1][k]:
                best[i + 1][k], kept[i + 1][k] = best[i][k], False  # unit i dropped
            if k < m and types[i] == form[k] and (best[i + 1][k + 1] is None or best[i][k] + cost[i] > best[i + 1][k + 1]):
                best[i + 1][k + 1], kept[i + 1][k + 1] = best[i][k] + cost[i], True  # unit i kept
    if best[n][m] is None:
        return None
    drop, k = [], m
    for i in range(n, 0, -1):
        if kept[i][k]:
            k -= 1
        else:
            drop.append(i - 1)
    drop.sort()
    return sum(cost[j] for j in drop), drop

def choose(cfg, family: str, removed: dict, cost: list, first: list) -> list[int]:
    """The units to drop: `first` (the caller's choice of removed[t] units per type) when the family holds what it
    leaves, else of the sets it holds the one whose units' `cost` (one per unit) sums least; -> sorted indices."""
    forms = _forms(cfg, family, removed)
    types = unit_types(cfg, family)
    if forms is None or tuple(t for j, t in enumerate(types) if j not in set(first)) in set(forms):
        return sorted(first)
    found = [c for c in (_cheapest(f, types, cost) for f in forms) if c is not None]
    if not found:
        raise RemodelError(f"{family} cannot drop {_counts(removed)} from {''.join(types)}: no such layers leave "
                           "a pattern it holds")
    return min(found, key=lambda c: (c[0], c[1]))[1]

def _counts(removed: dict) -> str:
    return ", ".join(f"{r} {t!r} unit(s)" for t, r in removed.items() if r)


def choose_any(cfg, family: str, cost: list, first: list) -> list[int]:
    """As many units as `first` (the least costly whatever their types): `first` when the family holds what it
    leaves, else over every count per type it can write the set of least `cost` (prune --num-layers)."""
    types = unit_types(cfg, family)
    if _forms(cfg, family, {}) is None or not family_of(family).holds(cfg):  # no rule, or not its model anyway
        return sorted(first)
    kinds, k = sorted(set(types)), len(first)
    found = []
    for rs in itertools.product(*(range(min(types.count(t), k) + 1) for t in kinds)):
        removed = dict(zip(kinds, rs))
        if sum(rs) == k and possible(cfg, family, removed):
            got = choose(cfg, family, removed, cost, first)
            found.append((sum(cost[j] for j in got), got))
    if not found:
        raise RemodelError(f"--num-layers: {family} cannot drop {k} of its layers from {''.join(types)}: none leave a "
                           "pattern it holds")
    return min(found)[1]
