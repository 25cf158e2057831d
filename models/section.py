"""A config section: the fields one layer kind (or the trunk's scales) owns, each with its bounds.

Each kind module declares `Config(Section)` with its fields; ModelConfig holds one instance per kind
(models/config.py). A field's metadata says how it is checked (`ints`, `reals`, `vector`), so the bounds
live with the field, and ModelConfig's validation reads them there.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import ClassVar

# Bounds of a config's sizes: far above any real model, low enough that nothing allocates or loops
# without bound on a hostile config.json (models.hf checks the raw JSON against them too).
MAX_VOCAB = 2**24
MAX_WIDTH = 2**20  # hidden, FFN, expert FFN, shared expert, latent
MAX_SMALL = 2**16  # heads, head dims, groups, SSM state, experts, top-k
MAX_LAYERS = 8192  # pattern characters (a Llama decoder layer is two)
MAX_MTP = 64


def ints(default, lo: int, hi: int, none_ok: bool = False, doc: str = "", raw: dict | None = None):
    """An int field in lo..hi (None allowed when none_ok). raw: {config.json key: its lowest value} of the
    Hugging Face keys that hold this field in some family (checked on the raw JSON up to hi: `raw_bounds`)."""
    return dataclasses.field(default=default, metadata={"check": ("int", lo, hi, none_ok), "doc": doc,
                                                        "raw": raw or {}})


def reals(default, gt=None, lt=None, inf_ok: bool = False, ge0: bool = False, doc: str = "", variant: str = "",
          raw: tuple = ()):
    """A finite float field > gt (>= 0 when ge0) and < lt, or None where that is its default; inf_ok allows +inf
    (stored as "inf" in JSON).
    variant: the group of family numerics it belongs to (its default is 'off'; models.families asks
    which families hold each group). raw: the config.json keys that hold it (`raw_bounds`)."""
    return dataclasses.field(default=default, metadata={"check": ("real", gt, lt, inf_ok, default is None, ge0), "doc": doc,
                                                        "variant": variant, "raw": dict.fromkeys(raw)})


def vector(default: tuple, doc: str = "", variant: str = ""):
    """A tuple of len(default) finite numbers > 0 (a list from JSON is the same vector)."""
    return dataclasses.field(default=default, metadata={"check": ("vector", len(default)), "doc": doc,
                                                        "variant": variant})


def plain(default, doc: str = "", variant: str = "", default_from: str = ""):
    """A field checked by its kind's validate (a string choice, a flag, a dict). default_from: the path of another
    section's field ("mlp.mlp_act") whose value a config takes for this one when it is None (ModelConfig fills it
    in; a Hugging Face family holding one key for both exports it only while the two agree)."""
    return dataclasses.field(default=default, metadata={"doc": doc, "variant": variant, "default_from": default_from})


def defaults_from(section) -> dict:
    """{field: the path it defaults from} of a section's fields declaring default_from."""
    return {f.name: f.metadata["default_from"] for f in dataclasses.fields(section) if f.metadata.get("default_from")}


def variants(classes, group: str) -> dict:
    """{field: default} of the fields of the section classes whose metadata names `group`."""
    return {f.name: f.default for cls in classes for f in dataclasses.fields(cls) if f.metadata.get("variant") == group}


def raw_bounds(classes) -> tuple[dict, dict]:
    """The config.json bounds the fields of `classes` declare (metadata "raw"): ({key: (lo, hi)} of the int
    keys, {key: (excluded low, +inf allowed)} of the float keys); a key two fields name gets the wider bound."""
    ints_, floats = {}, {}
    for f in (f for cls in classes for f in dataclasses.fields(cls)):
        spec = f.metadata.get("check")
        for key, lo in f.metadata.get("raw", {}).items():
            if spec[0] == "int":
                old = ints_.get(key, (lo, spec[2]))
                ints_[key] = (min(old[0], lo), max(old[1], spec[2]))
            else:
                floats[key] = (-1e-300 if spec[5] else spec[1], spec[3])
    return ints_, floats


def _int_ok(name, v, lo, hi, none_ok, need):
    if v is None and none_ok:
        return
    need(not isinstance(v, bool) and isinstance(v, numbers.Integral), f"{name} expected int, got {type(v).__name__} {v!r}")
    need(lo <= v <= hi, f"{name} must be in {lo}..{hi:,}, got {v}")


def _real_ok(name, v, gt, lt, inf_ok, none_ok, ge0, need):
    if v is None and none_ok:
        return
    ok = not isinstance(v, bool) and isinstance(v, numbers.Real) and not math.isnan(v)
    ok = ok and (math.isfinite(v) or (inf_ok and v > 0)) and (gt is None or v > gt) and (lt is None or v < lt)
    ok = ok and (not ge0 or v >= 0)
    need(ok, f"{name} must be a finite number{f' > {gt}' if gt is not None else ' >= 0'}"
             f"{f' and < {lt}' if lt is not None else ''}, got {v!r}")


def check_field(f: dataclasses.Field, v, need) -> None:
    """need(ok, message) for one field's value against its metadata's bounds."""
    spec = f.metadata.get("check")
    if spec is None:
        return
    if spec[0] == "int":
        _int_ok(f.name, v, *spec[1:], need)
    elif spec[0] == "real":
        _real_ok(f.name, v, *spec[1:], need)
    else:
        ok = isinstance(v, tuple) and len(v) == spec[1] and all(
            not isinstance(x, bool) and isinstance(x, numbers.Real) and math.isfinite(x) and x > 0 for x in v)
        need(ok, f"{f.name} must be {spec[1]} finite numbers > 0, got {v!r}")


@dataclass(frozen=True)
class Section:
    """Base of a kind's config section: frozen (configs share sections), checked by `check`, JSON by
    to_dict / from_dict (+inf as "inf", vectors as lists). RENAMED: {a field's former name: its name}, read
    from configs written before the rename."""
    RENAMED: ClassVar[dict] = {}

    def __post_init__(self):
        for f in dataclasses.fields(self):  # a list from JSON is the same vector
            if f.metadata.get("check", ("",))[0] == "vector" and isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))

    def check(self, need) -> None:
        for f in dataclasses.fields(self):
            check_field(f, getattr(self, f.name), need)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: ("inf" if isinstance(v, float) and math.isinf(v) else list(v) if isinstance(v, tuple) else v)
                for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict):
        from .errors import RemodelError
        if not isinstance(d, dict):
            raise RemodelError(f"config section {cls.__name__} must be an object, got {type(d).__name__}")
        d = {cls.RENAMED.get(k, k): v for k, v in d.items()}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise RemodelError(f"unknown remodel config fields: {sorted(unknown)}")
        return cls(**{k: float("inf") if v == "inf" else v for k, v in d.items()})

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> tuple:
        return tuple(f.name for f in dataclasses.fields(cls))
