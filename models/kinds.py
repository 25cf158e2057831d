"""The registry of layer kinds: pattern character -> LayerKind (models/spec.py). Adding a kind is one
module (its nn.Module and spec) and one line here; every operation then asks the spec."""
from __future__ import annotations

from .attention import ATTENTION
from .errors import RemodelError
from .mamba import MAMBA
from .mlp import MLP_KIND
from .moe import MOE
from .parallel_mixer import PARALLEL
from .spec import LayerKind

KINDS: dict[str, LayerKind] = {k.char: k for k in (MAMBA, ATTENTION, MLP_KIND, MOE, PARALLEL)}
BY_NAME: dict[str, LayerKind] = {k.name: k for k in KINDS.values()}


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
    return [KINDS[c] for c in cfg.pattern]


def count(cfg, k: LayerKind) -> int:
    """Trunk layers of kind k."""
    return cfg.pattern.count(k.char)


def upcycled_pattern(cfg) -> str:
    """The pattern after upcycling: every layer of a kind that upcycles becomes its MoE kind."""
    return "".join(KINDS[c].upcycles_to or c for c in cfg.pattern)


def routed(cfg) -> bool:
    """Whether any trunk layer holds routed experts."""
    return any(k.routed for k in used(cfg, mtp=False))
