"""`remodel upcycle`'s defaults where the options leave them open: the settings README recommends (measured in
bench/RESULTS.md "Fresh data": two virtual groups per token, a router that does not renormalise)."""
from __future__ import annotations

from remodel.models.families import FAMILIES

# a family's renormalising default router -> its raw counterpart, where one was measured (nemotron_h's sigmoid);
# the softmax families keep topk-softmax: softmax-topk was not measured (README "Upcycling")
RAW = {"sigmoid": "sigmoid-raw"}


def default_router(family_default: str, exact: bool) -> str:
    """The router of --router None: the raw counterpart of the family's, or the family's own (exact) with --exact."""
    return family_default if exact else RAW.get(family_default, family_default)


def default_top_k(experts: int, granularity: int) -> int:
    """--top-k None: 2G, two virtual groups per token (at most N, the number of experts)."""
    return min(2 * granularity, experts)


def router_defaults() -> str:
    """The --router defaults per source family, for --help (the commonest one as 'the others')."""
    by: dict[str, list] = {}
    for name, f in FAMILIES.items():
        by.setdefault(f.upcycle_router(), []).append(name)
    common = max(by, key=lambda r: len(by[r]))
    parts = []
    for r, names in by.items():
        raw = default_router(r, exact=False)
        if r != common:
            parts.append(f"{raw} for {', '.join(names)} sources" + (f" ({r} with --exact)" if raw != r else ""))
    return "; ".join(parts + [f"{default_router(common, exact=False)} for the others"])
