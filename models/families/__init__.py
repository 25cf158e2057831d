"""The registry of Hugging Face model families (models/families/family.py: the spec each one fills in).

Adding a family is one module (ending in `REGISTER = (ITS_FAMILY,)`) and one line in MODULES (and its name
in DEFAULT_ORDER when it should be the default export of some models); the CLI's `--to` choices and every
check come from here.
"""
from __future__ import annotations

from importlib import import_module

from remodel.models.errors import RemodelError

from .family import Family, projected, scaled

MODULES = (  # one line per family module, in registry order
    "nemotron_h",
    "llama",
    "llama_moe",
    "bamba",
    "granite",
    "falcon_h1",
    "granite_dense",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "qwen3_5_vision",
    "olmo_hybrid",
    "glm4_moe",
    "lfm2",
    "lfm2_moe",
    "minimax_m2",
    "jamba",
    "deepseek_v3",
    "glm4_moe_lite",
    "gpt_oss",
    "kimi_linear",
)
FAMILIES: dict[str, Family] = {f.name: f for m in MODULES for f in import_module(f"{__name__}.{m}").REGISTER}
DEFAULT_ORDER = tuple(FAMILIES[n] for n in ("gpt_oss", "qwen3_moe", "qwen2_moe", "mixtral", "qwen3", "llama", "bamba",
                                             "granitemoehybrid", "falcon_h1", "qwen3_5_moe_text", "qwen3_next",
                                             "qwen3_5_text", "olmo_hybrid", "glm4_moe", "lfm2",
                                             "lfm2_moe", "jamba", "minimax_m2", "deepseek_v3", "kimi_linear",
                                             "nemotron_h"))  # the first that claims
UPCYCLE_TARGETS = tuple(name for name, f in FAMILIES.items() if f.moe)


def family(name: str, what: str = "family") -> Family:
    """The registered family `name`; one-line RemodelError naming the supported ones otherwise."""
    f = FAMILIES.get(name) if isinstance(name, str) else None
    if f is None:
        raise RemodelError(f"unknown {what} {name!r} (supported: {', '.join(FAMILIES)})")
    return f


def upcycle_defaults(what: str) -> str:
    """The `remodel upcycle` defaults per source family, for --help: what='router' or 'to'."""
    by: dict[str, list] = {}
    for name, f in FAMILIES.items():
        by.setdefault(f.upcycle_router() if what == "router" else f.upcycle_help, []).append(name)
    return "; ".join(f"{v} for {', '.join(names)} sources" for v, names in by.items())


def depth_units(cfg, name: str | None = None) -> list:
    """The decoder layers of family `name` (default: the model's default family) as our layer indices."""
    return family(name or default_family(cfg)).depth_units(cfg)


def default_family(cfg) -> str:
    """The family a model exports to when none is named (one holding its multipliers, when it has any)."""
    plain, straight = not scaled(cfg), not projected(cfg)
    held = (f.name for f in DEFAULT_ORDER if (plain or f.multipliers) and (straight or f.projections) and f.claims(cfg))
    return next(held, DEFAULT_ORDER[-1].name)  # the last claims all: its export check says what it lacks
