"""The one configuration every remodel model is described by.

A model is a stack of pre-norm residual layers, one character each in `pattern`:
  M  Mamba-2 mixer            *  GQA self-attention (RoPE or none)
  -  dense MLP (relu2/SwiGLU)  E  mixture of experts (+ optional shared expert)
  P  attention and Mamba-2 in parallel on the same input, their outputs summed (Falcon-H1)
A Llama decoder layer is the pair "*-" (its two norms are the two layers' norms), so Llama,
Mistral and Qwen2 are the pattern "*-" * L, and Mixtral / Qwen-MoE are "*E" * L.
Widths are homogeneous across layers of one type (what Minitron / MiniPuzzle prune to).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .errors import RemodelError
from .kinds import KINDS, used
from .section import (MAX_LAYERS, MAX_MTP, MAX_SMALL, MAX_VOCAB, MAX_WIDTH, Section, check_field, defaults_from, ints,
                      plain, reals)

__all__ = ["ModelConfig", "KindView", "Scales", "Slot", "OWNERS", "SECTIONS", "path_of", "MAX_LAYERS", "MAX_MTP", "MAX_SMALL", "MAX_VOCAB", "MAX_WIDTH"]


@dataclass(frozen=True)
class Scales(Section):
    """The trunk's scalar multipliers (1: off; Granite and Falcon-H1 set them): the embeddings times
    embedding_multiplier, every layer's output times residual_multiplier before it joins the residual
    stream, the logits times lm_head_multiplier and divided by logits_scaling. Part of the model, not of
    its weights: training keeps them as they are."""
    embedding_multiplier: float = reals(1.0, gt=0, variant="multipliers", raw=("embedding_multiplier",))
    residual_multiplier: float = reals(1.0, gt=0, variant="multipliers", raw=("residual_multiplier",))
    logits_scaling: float = reals(1.0, gt=0, variant="multipliers", raw=("logits_scaling",))
    lm_head_multiplier: float = reals(1.0, gt=0, variant="projections", raw=("lm_head_multiplier",))


def section_classes() -> dict:
    """{section name: its class}: the trunk's scales, then one per registered kind, in registry order."""
    return {"scales": Scales, **{k.name: k.config for k in KINDS.values() if k.config is not None}}


def _owners() -> dict:
    """{field name: the sections declaring it}: a bare field name in the constructor or replace() is
    accepted where exactly one section declares it (an input convenience; reads name the section)."""
    out: dict = {}
    for name, cls in section_classes().items():
        for f in cls.names():
            out.setdefault(f, []).append(name)
    return out


SECTIONS = section_classes()
OWNERS = _owners()


@dataclass(frozen=True)
class Slot:
    """One trunk layer: its kind and the config section that kind reads (the instance ModelConfig holds;
    layers of one kind share it: widths are homogeneous per kind)."""
    index: int
    kind: object  # models.spec.LayerKind
    section: Section | None


@dataclass(init=False)
class ModelConfig:
    """The trunk's fields plus one config section per layer kind (`sections`, each owned by its kind's
    module) and the trunk's `scales`. A section is read by its name (cfg.attention.num_attention_heads); a
    section field is no attribute of the config. The constructor and replace() take trunk fields, whole
    sections, and "section.field" keys (a bare field name only where one section alone declares it)."""
    vocab_size: int = ints(dataclasses.MISSING, 1, MAX_VOCAB, raw={"vocab_size": 1})
    hidden_size: int = ints(dataclasses.MISSING, 1, MAX_WIDTH, raw={"hidden_size": 1})
    pattern: str = plain(dataclasses.MISSING)
    norm_eps: float = reals(1e-5, gt=0, lt=1, raw=("rms_norm_eps", "layer_norm_epsilon"))
    norm_offset: float = reals(0.0, ge0=True, lt=2, doc="every RMSNorm scales by (offset + w); 1: zero-centred weights",
                               variant="zero_centred_norm")
    tie_word_embeddings: bool = False
    # the embedding row that gets no gradient from the input lookup: transformers' nn.Embedding padding_idx
    # (pad_token_id in the families that build their embedding with it, models.families.Family.padding_idx); the
    # row's weights stay as loaded (it is still read, and a tied lm_head still trains it). None: every row trains
    padding_idx: int | None = ints(None, 0, MAX_VOCAB - 1, none_ok=True)
    # MTP (multi-token prediction, Nemotron 3 Super): `mtp_layers` steps of the `mtp_pattern` blocks
    # after the trunk, sharing its widths, embeddings and lm_head (models/mtp.py); 0: none
    mtp_layers: int = ints(0, 0, MAX_MTP, raw={"num_nextn_predict_layers": 0})
    mtp_pattern: str = ""
    extra: dict = field(default_factory=dict)  # HF fields carried through untouched (bos/eos ids, ...)
    sections: dict = field(default_factory=dict)

    def __init__(self, vocab_size, hidden_size, pattern, *, sections=None, **given):
        d = self.__dict__
        d.update(vocab_size=vocab_size, hidden_size=hidden_size, pattern=pattern)
        for f in dataclasses.fields(self)[3:-1]:
            d[f.name] = given.pop(f.name) if f.name in given else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
        secs = {n: cls() for n, cls in SECTIONS.items()}
        for n, v in {**(sections or {}), **{n: given.pop(n) for n in list(given) if n in SECTIONS}}.items():
            secs[n] = _section(n, v)
        for n, fields in _by_section(given).items():
            secs[n] = secs[n].replace(**fields)
        d["sections"] = _filled(secs)
        self.validate()

    # ---- the sections, by name ------------------------------------------------------------
    def __getattr__(self, name):
        secs = self.__dict__.get("sections")
        if secs is None or name.startswith("__") or name not in secs:
            owners = OWNERS.get(name)
            hint = f" (a field of section {', '.join(owners)}: cfg.{owners[0]}.{name})" if owners else ""
            raise AttributeError(f"ModelConfig has no field {name!r}{hint}")
        return secs[name]

    def __setattr__(self, name, value):
        if name in OWNERS or name in SECTIONS:
            raise AttributeError(f"ModelConfig sections are immutable: use cfg.replace(**{{'section.{name}': ...}})")
        object.__setattr__(self, name, value)

    def reads(self, section: str | None) -> bool:
        """Whether this config holds `section` (None: the trunk); a KindView holds only its kind's."""
        return True

    def view(self, kind) -> "KindView":
        """What `kind`'s module is given: the trunk and the sections the kind reads (LayerKind.sections)."""
        return KindView(self, kind.sections)

    def value(self, path: str):
        """A trunk field ("hidden_size") or a section's ("mamba.n_groups") by its path."""
        section, _, name = path.rpartition(".")
        return getattr(self.sections[section] if section else self, name)

    def get(self, name: str, section: str | None = None):
        """The field `name` as a kind's code reads it: a path, a trunk field, a field of `section`,
        or else of the one section that declares it (path_of)."""
        return self.value(path_of(name, section))

    # ---- derived sizes -------------------------------------------------------------
    @property
    def slots(self) -> tuple:
        """The trunk as layer slots, in order (the pattern names their kinds)."""
        return tuple(Slot(i, KINDS[c], KINDS[c].slot_section(self.sections.get(KINDS[c].section_name)))
                     for i, c in enumerate(self.pattern))

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    @property
    def mamba_inner(self) -> int:
        return self.mamba.mamba_num_heads * self.mamba.mamba_head_dim

    @property
    def moe_input_size(self) -> int:
        return self.moe.moe_latent_size or self.hidden_size

    @property
    def mtp_full_pattern(self) -> str:
        """Every MTP block in order (vLLM numbers them flat: mtp.layers.0 .. len-1)."""
        return self.mtp_pattern * self.mtp_layers

    def count(self, layer_char: str) -> int:
        return self.pattern.count(layer_char)

    def replace(self, **changes) -> "ModelConfig":
        """A copy with `changes` (trunk fields, whole sections, "section.field" keys) applied."""
        trunk = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        sections = {**trunk.pop("sections"), **{n: changes.pop(n) for n in list(changes) if n in SECTIONS}}
        return ModelConfig(**{**trunk, **changes}, sections=sections)

    def flat(self) -> dict:
        """Every field by its path (trunk fields bare, section fields "section.field"), for reports and
        differences."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sections"}
        for n, s in self.sections.items():
            out.update({f"{n}.{k}": getattr(s, k) for k in s.names()})
        return out

    def to_dict(self) -> dict:
        """JSON: the trunk's fields and the sections of the kinds present (or away from their defaults)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sections"}
        present = {k.section_name for k in used(self)}
        for n, s in self.sections.items():
            if n in present or s != _fill(SECTIONS[n](), self.sections):  # (a default taken from another field)
                d[n] = s.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """The inverse of to_dict; a flat dict (every section field at the top, as configs written before
        the sections) reads the same."""
        if not isinstance(d, dict):
            raise RemodelError(f"a remodel config must be an object, got {type(d).__name__}")
        d = {k: float("inf") if k.rpartition(".")[2] == "time_step_max" and v == "inf" else v for k, v in d.items()}
        missing = [k for k in ("vocab_size", "hidden_size", "pattern") if k not in d]
        if missing:
            raise RemodelError(f"remodel config lacks {', '.join(missing)}")
        return cls(**d)

    # ---- validation: one line naming the problem -------------------------------------
    def validate(self) -> None:
        def need(ok, msg):
            if not ok:
                raise RemodelError(f"invalid config: {msg}")

        self._check_numbers(need)
        need(self.padding_idx is None or self.padding_idx < self.vocab_size,
             f"padding_idx {self.padding_idx} is not a row of the {self.vocab_size}-token embedding")
        need(len(self.pattern) > 0, "the layer pattern is empty")
        bad = sorted(set(self.pattern + self.mtp_pattern) - set(KINDS))
        need(not bad, f"unknown layer characters {bad} in pattern (allowed: {' '.join(KINDS)})")
        need(self.mtp_layers >= 0 and bool(self.mtp_layers) == bool(self.mtp_pattern),
             "MTP needs both mtp_layers > 0 and a non-empty mtp_pattern (or neither)")
        need(set(self.mtp_pattern) <= set(self.pattern),
             f"MTP layer types {self.mtp_pattern!r} must also occur in the trunk (they share its widths)")
        sc = self.scales
        need(not self.mtp_layers or (sc.logits_scaling, sc.embedding_multiplier, sc.lm_head_multiplier) == (1, 1, 1),
             "MTP layers read the trunk's final hidden states and embeddings unscaled: logits_scaling, "
             "embedding_multiplier and lm_head_multiplier must be 1")
        for k in used(self):
            k.validate(self.view(k), need)  # each kind checks its own sections

    def _check_numbers(self, need) -> None:
        """Every size an int (not bool) within its field's bounds, every float finite and in range, the
        pattern bounded: before anything is allocated from them."""
        for f in dataclasses.fields(self):
            check_field(f, getattr(self, f.name), need)
        for name in ("pattern", "mtp_pattern"):
            need(isinstance(getattr(self, name), str), f"{name} must be a string")
        need(len(self.pattern) <= MAX_LAYERS and len(self.mtp_pattern) <= MAX_LAYERS,
             f"{len(self.pattern)} layers (pattern length), at most {MAX_LAYERS}")
        for s in self.sections.values():
            s.check(need)


TRUNK_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))
DERIVED = {"mamba_inner": "mamba", "moe_input_size": "moe"}  # ModelConfig properties: the section each reads


class KindView:
    """One layer kind's config: the trunk's fields (and its scales) and the sections the kind reads, nothing
    else, so a module that reads another kind's section fails at once (issue 54: a kind receives its section)."""

    def __init__(self, cfg: ModelConfig, sections: tuple):
        self.__dict__.update(config=cfg, sections={n: cfg.sections[n] for n in ("scales", *sections)})

    def __getattr__(self, name):
        if name in ("config", "sections") or name.startswith("__"):  # a copy before __init__ (deepcopy, pickle)
            raise AttributeError(name)
        if name in TRUNK_FIELDS - {"sections"} or DERIVED.get(name) in self.sections or name in (
                "num_layers", "mtp_full_pattern", "count"):
            return getattr(self.config, name)
        if name in self.sections:
            return self.sections[name]
        raise AttributeError(f"a layer kind given sections {sorted(self.sections)} read {name!r}")

    def reads(self, section: str | None) -> bool:
        return section is None or section in self.sections

    def value(self, path: str):
        section, _, name = path.rpartition(".")
        return getattr(getattr(self, section) if section else self, name)

    def get(self, name: str, section: str | None = None):
        """As ModelConfig.get, within the view's sections."""
        return self.value(path_of(name, section))

    def view(self, kind) -> "KindView":
        return self.config.view(kind)

    def replace(self, **changes) -> "KindView":
        """The same view of the config with `changes` (of its own sections' fields) applied."""
        return KindView(self.config.replace(**changes), tuple(n for n in self.sections if n != "scales"))


def path_of(name: str, section: str | None = None) -> str:
    """The path of a field a kind names: itself when dotted or a trunk field; `section.name` when that
    section declares it; else the one section that declares it (two: name the section)."""
    if "." in name or name in TRUNK_FIELDS:
        return name
    if section and name in SECTIONS[section].names():
        return f"{section}.{name}"
    owners = OWNERS.get(name, ())
    if len(owners) != 1:
        raise RemodelError(f"config field {name!r} is declared by {len(owners)} sections: name it as section.field")
    return f"{owners[0]}.{name}"


def _by_section(given: dict) -> dict:
    """{section: {field: value}} of "section.field" keys and bare names one section alone declares."""
    out: dict = {}
    unknown = []
    for key, v in given.items():
        section, name = _current(*key.rpartition(".")[::2])
        owners = [section] if section else OWNERS.get(name, [])
        if (section and section not in SECTIONS) or not owners or name not in SECTIONS[owners[0]].names():
            unknown.append(key)
        elif len(owners) > 1:
            raise RemodelError(f"config field {name!r} is declared by {', '.join(owners)}: name it as section.field")
        else:
            out.setdefault(owners[0], {})[name] = v
    if unknown:
        raise RemodelError(f"unknown remodel config fields: {sorted(unknown)}")
    return out


def _current(section: str, name: str) -> tuple[str, str]:
    """(section, field) of a field a section has since renamed (its RENAMED: configs, reports and score files
    written before the rename read the same), else as given."""
    for n, cls in SECTIONS.items():
        if section in ("", n) and name in cls.RENAMED:
            return n, cls.RENAMED[name]
    return section, name


def _filled(secs: dict) -> dict:
    """The sections with every field left None that declares default_from ("mlp.mlp_act") set to that field's
    value: configs, reports and score files written before the field existed read as they did."""
    return {n: _fill(s, secs) for n, s in secs.items()}


def _fill(s: Section, secs: dict) -> Section:
    fill = {f: getattr(secs[p.partition(".")[0]], p.partition(".")[2])
            for f, p in defaults_from(s).items() if getattr(s, f) is None}
    return s.replace(**fill) if fill else s


def _section(name: str, v) -> Section:
    """A section given whole: an instance of its class, or its to_dict()."""
    cls = SECTIONS[name]
    if isinstance(v, cls):
        return v
    if isinstance(v, dict):
        return cls.from_dict(v)
    raise RemodelError(f"config section {name!r} must be an object, got {type(v).__name__}")
