"""The counts of depth units removed per type that the search may propose: all of them, unless the family places
its layer types by a rule (Family.depth_forms, e.g. Jamba's attention / expert period and offset) under which some
counts leave no pattern it can write (models.families.depth_forms.possible). Counts are coded as mixed-radix integers
over the unit types (radix removable + 1) so the search filters its combination tables with numpy."""
from __future__ import annotations

import itertools

import numpy as np

from remodel.models.families.depth_forms import constrained, possible


def _code(sp, counts) -> int:
    c = 0
    for t, r in zip(sp.types, counts):
        c = c * (sp.removable[t] + 1) + r
    return c


def allowed_codes(sp) -> np.ndarray | None:
    """The codes of every removed-count vector (one count per type, sp.types' order, within sp.removable and
    sp.max_removed) the family can write; None: the family has no placement rule (or nothing is removable)."""
    if not sp.max_removed or not constrained(sp.cfg, sp.family):
        return None
    ranges = [range(sp.removable[t] + 1) for t in sp.types]
    return np.array(sorted(_code(sp, rs) for rs in itertools.product(*ranges)
                           if sum(rs) <= sp.max_removed and possible(sp.cfg, sp.family, dict(zip(sp.types, rs)))),
                    dtype=np.int64)


def removal_ok(sp, removed: dict) -> bool:
    """Whether removing removed[t] units of each type is a count the search may propose."""
    return sp.depth_ok is None or bool(np.isin(_code(sp, [removed.get(t, 0) for t in sp.types]), sp.depth_ok))


def counts_ok(sp, opts: list, o: np.ndarray) -> np.ndarray:
    """Per combination (row of o: each type's option index into opts[k], the search's tables) whether its
    removed counts are allowed."""
    if sp.depth_ok is None:
        return np.ones(len(o), dtype=bool)
    code = np.zeros(len(o), dtype=np.int64)
    for k, (_, r, _) in enumerate(opts):
        code = code * (sp.removable[sp.types[k]] + 1) + r[o[:, k]]
    return np.isin(code, sp.depth_ok)
