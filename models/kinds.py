"""The registry of layer kinds: pattern character -> LayerKind (models/spec.py). Adding a kind is one
module (its nn.Module and spec) and one line here; every operation then asks the spec."""
from __future__ import annotations

import dataclasses

from .attention import ATTENTION, FULL_ATTENTION
from .errors import RemodelError
from .gated_deltanet import GATED_DELTANET
from .kda import KDA
from .mamba import MAMBA
from .mamba1 import MAMBA1
from .mla import MLA
from .mlp import MLP_KIND
from .moe import MOE
from .parallel_mixer import PARALLEL
from .short_conv import SHORT_CONV
from .spec import WIDTHS, LayerKind, widths



def post_norm(k: LayerKind, char: str) -> LayerKind:
    """Kind k with its norm after the mixer (OLMo 2 / OLMo-hybrid): the same module, widths and config
    section (declared once, by k), under its own pattern character; it does not upcycle."""
    return dataclasses.replace(k, char=char, name=k.name + "_post_norm", post_norm=True, declares=(), config=None,
                               section=k.name, upcycles_to=None)


KINDS: dict[str, LayerKind] = {k.char: k for k in (MAMBA, ATTENTION, MLP_KIND, MOE, PARALLEL, GATED_DELTANET, SHORT_CONV,
                                                   MAMBA1, MLA, FULL_ATTENTION, KDA,
                                                   post_norm(ATTENTION, "A"), post_norm(MLP_KIND, "="))}
BY_NAME: dict[str, LayerKind] = {k.name: k for k in KINDS.values()}




def _in_kind_order() -> None:
    """WIDTHS (every kind above has entered its own: models.spec.LayerKind) in one order whatever order the
    kind modules were imported in: the trunk's, then each kind's as KINDS lists them. Import WIDTHS and
    widths from here: complete by then."""
    order = [n for n in WIDTHS if WIDTHS[n].layer is None] + [w.name for k in KINDS.values() for w in k.declares]
    ordered = {n: WIDTHS[n] for n in order} | WIDTHS
    WIDTHS.clear()
    WIDTHS.update(ordered)


_in_kind_order()
PRUNABLE = tuple(n for n, w in WIDTHS.items() if w.unit)
UNITS = tuple(dict.fromkeys((*(w.unit for w in WIDTHS.values() if w.unit and w.unit != "hidden"), *(
    a for k in KINDS.values() for a in k.hidden_units),  # per-layer keep-dict axes (hidden_units: kept at hidden's count)
    *(a for k in KINDS.values() for a in k.units))))  # and those a width's keep also sets (KDA's gate ranks)


def kind(c: str) -> LayerKind:
    """The kind of a pattern character, or of a kind name ('mamba')."""
    k = KINDS.get(c) or BY_NAME.get(c)
    if k is None:
        raise RemodelError(f"unknown layer kind {c!r} (known: {' '.join(KINDS)} or {', '.join(BY_NAME)})")
    return k


def used(cfg, mtp: bool = True) -> list[LayerKind]:
    """The kinds present in the trunk (and the MTP head), in registry order."""
    chars = set(cfg.pattern + (cfg.mtp_pattern if mtp else ""))
    return [k for c, k in KINDS.items() if c in chars]


def layer_kinds(cfg) -> list[LayerKind]:
    """The kind of every trunk layer, in order."""
    return [s.kind for s in cfg.slots]


def count(cfg, k: LayerKind) -> int:
    """Trunk layers of kind k."""
    return cfg.pattern.count(k.char)


def upcycled_pattern(cfg) -> str:
    """The pattern after upcycling: every layer of a kind that upcycles becomes its MoE kind."""
    return "".join(KINDS[c].upcycles_to or c for c in cfg.pattern)


def routed(cfg) -> bool:
    """Whether any trunk layer holds routed experts."""
    return any(k.routed for k in used(cfg, mtp=False))
