"""Hugging Face formats: configs in and out, for every supported family.

Configs are parsed through transformers' own config classes, so their defaults and legacy field
names are the oracle's; `check_exportable` refuses a family that cannot hold a model exactly. Tensor
names live in models.hf_adapter (one declarative key map per family) and are re-exported here:
`weight_table`, `to_hf_name`, `from_hf_name`.
"""
from __future__ import annotations

import json

import math

from .config import MAX_LAYERS, SECTIONS, ModelConfig
from .errors import RemodelError
from .families import FAMILIES, default_family
from .families.tower import OUTER
from .families.family import GROUPS, ROPE_TYPES, cfg_choice, cfg_float, projected, scaled, varied
from .hf_adapter import KEY_MAPS, from_hf_name, to_hf_name, weight_table
from .checkpoint import without_absent_mtp  # noqa: F401 (also named here, where HF configs are read)
from .layout import shapes
from .kinds import used
from .section import defaults_from, raw_bounds

__all__ = ["FAMILIES", "KEY_MAPS", "check_exportable", "config_from_hf", "config_to_hf", "default_family",
           "from_hf_name", "our_shapes", "to_hf_name", "weight_table", "without_absent_mtp"]

PASSTHROUGH = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
# config.json fields around a nested text model's config that the writers set themselves (models.families.tower)
_OWN = ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype", "tie_word_embeddings")
_BLOCK_TYPES = {t for f in FAMILIES.values() for t in f.block_types}  # per-layer type names of any family


# config.json keys -> (lo, hi), checked on the raw JSON before transformers sees it (a string, list, bool
# or an unbounded value there would otherwise reach list allocations such as ["full_attention"] * layers):
# the keys each config field declares (models.section.raw_bounds), the shape keys a family holds beyond
# them (Family.raw) and the trunk's own. _RAW_FLOATS: key -> (excluded low, +inf allowed), every one finite
# unless allowed (time_step_max).
_TRUNK_RAW = {"num_hidden_layers": (1, MAX_LAYERS // 2), "max_position_embeddings": (1, 2**40)}
_RAW_INTS, _RAW_FLOATS = raw_bounds([ModelConfig, *SECTIONS.values()])
_RAW_INTS.update({**_TRUNK_RAW, **{k: v for f in FAMILIES.values() for k, v in f.raw.items()}})
_RAW_LISTS = {"layers_block_type": MAX_LAYERS, "hybrid_override_pattern": MAX_LAYERS,
              "mtp_layers_block_type": MAX_LAYERS}


def check_raw_config(d: dict, where: str = "config.json") -> None:
    """One-line RemodelError naming the key and `where` for a config.json value of the wrong JSON type
    (a string, list or bool where a number belongs) or out of bounds (models.config's MAX_*)."""
    def bad(key, why):
        raise RemodelError(f"{where}: {key!r} {why}")

    for key, (lo, hi) in _RAW_INTS.items():
        v = d.get(key)
        if v is None or (key == "mamba_d_head" and v == "auto"):  # bamba derives it from the expansion
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            bad(key, f"expected int, got {type(v).__name__} {v!r}")
        if not lo <= v <= hi:
            bad(key, f"must be in {lo}..{hi:,}, got {v}")
    rope = d.get("rope_parameters")
    floats = {**d, "rope_theta": rope.get("rope_theta") if isinstance(rope, dict) else d.get("rope_theta")}
    for key, (lo, inf_ok) in _RAW_FLOATS.items():
        v = floats.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            bad(key, f"expected a number, got {type(v).__name__} {v!r}")
        if math.isnan(v) or v <= lo or (math.isinf(v) and not inf_ok):
            bad(key, f"must be finite and {'>= 0' if lo < 0 else '> 0'}, got {v!r}")
    _check_raw_rope(d, where)
    for key, most in _RAW_LISTS.items():
        v = d.get(key)
        if v is None:
            continue
        want = str if key == "hybrid_override_pattern" else list
        if not isinstance(v, want) or (want is list and not all(isinstance(x, str) for x in v)):
            bad(key, f"expected {'a string' if want is str else 'a list of layer-type strings'}, got "
                     f"{type(v).__name__}")
        if len(v) > most:
            bad(key, f"has {len(v):,} layers, at most {most:,}")
        if isinstance(v, list) and set(v) - _BLOCK_TYPES:
            bad(key, f"has unknown layer types {sorted(set(v) - _BLOCK_TYPES)} (known: {', '.join(sorted(_BLOCK_TYPES))})")


def _check_raw_rope(d: dict, where: str) -> None:
    """RoPE fields as transformers would read them: rope_parameters / rope_scaling an object of a known
    type, partial_rotary_factor in (0, 1] and factor > 0 (a string there raised ValueError in a reader)."""
    if d.get("partial_rotary_factor") is not None:
        cfg_float(d, "partial_rotary_factor", None, lo=0, hi=1, where=f"{where}: ")
    for key in ("rope_parameters", "rope_scaling"):
        rp = d.get(key)
        if rp is None:
            continue
        if not isinstance(rp, dict):
            raise RemodelError(f"{where}: {key!r} must be an object, got {type(rp).__name__} {rp!r}")
        for t in ("rope_type", "type"):
            if t in rp:
                cfg_choice(rp, t, None, ROPE_TYPES, f"{where}: {key} ")
        if rp.get("partial_rotary_factor") is not None:
            cfg_float(rp, "partial_rotary_factor", None, lo=0, hi=1, where=f"{where}: {key} ")
        if rp.get("factor") is not None:
            cfg_float(rp, "factor", None, lo=0, where=f"{where}: {key} ")


def _hf_config(d: dict, where: str = "config.json"):
    from transformers import AutoConfig, PretrainedConfig

    d = PretrainedConfig._decode_special_floats(d)  # {"__float__": "Infinity"} as transformers writes it
    mt = d.get("model_type")
    if not isinstance(mt, str) or mt not in FAMILIES:
        raise RemodelError(f"unsupported model_type {mt!r} (supported: {', '.join(FAMILIES)})")
    d = {k: v for k, v in d.items() if k not in ("model_type", "architectures", "transformers_version")}
    check_raw_config(d, where)
    inner = _nested(d, mt, where)
    try:
        h = AutoConfig.for_model(mt, **d)
    except Exception as e:  # transformers' own validation ("Validation error for field 'x':\n  TypeError: ...")
        msg = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise RemodelError(f"invalid {mt} config: {msg}") from None
    if inner is None:
        _require(d, h, mt)
    else:  # the text model's config, nested: its fields are required and bounded there
        _require(inner, getattr(h, FAMILIES[mt].nested), FAMILIES[mt].text.name)
    return h


def _nested(d: dict, mt: str, where: str) -> dict | None:
    """The text model's config.json object of a family that nests it (Family.nested), checked as a config.json
    of its own (check_raw_config); None for a family that does not nest it."""
    key = FAMILIES[mt].nested
    if not key:
        return None
    inner = d.get(key)
    if not isinstance(inner, dict):
        raise RemodelError(f"{where}: {mt} config has no {key!r} object (the text model's config), got {inner!r}")
    check_raw_config(inner, f"{where} {key}")
    return inner


def _require(d: dict, h, mt: str):
    """One-line RemodelError naming the first shape-defining field the raw config.json lacks (transformers
    fills in defaults for the model it describes, e.g. hidden_size 4096, which would silently describe
    another model than the weights); alternatives in a tuple."""
    need = [("vocab_size",), ("hidden_size",)] + FAMILIES[mt].required(h)
    amap = dict(getattr(h, "attribute_map", {}) or {})  # a family may save a field under another name
    for alts in need:
        alts = tuple(dict.fromkeys([*alts, *(amap[k] for k in alts if k in amap),
                                    *(x for x, t in amap.items() if t in alts)]))
        if not any(d.get(k) is not None for k in alts):
            raise RemodelError(f"{mt} config has no {' or '.join(map(repr, alts))}: it sets the model's shapes "
                               f"(transformers would assume {getattr(h, alts[0], None)!r}); add it to config.json")


def config_from_hf(d: dict, source=None) -> ModelConfig:
    """HF config.json dict -> ModelConfig (one-line RemodelError when unsupported or out of bounds, naming
    the key and `source`, the file it came from: "config.json" when not given). Checked on the raw JSON
    (check_raw_config), by transformers' config class, then by ModelConfig.validate: before any weight."""
    where = str(source) if source is not None else "config.json"
    h = _hf_config(d, where)
    nested = FAMILIES[h.model_type].nested
    text = getattr(h, nested) if nested else h
    extra = {k: getattr(text, k) for k in PASSTHROUGH if getattr(text, k, None) is not None}
    if nested:  # every field around the text model's config, as transformers reads it, written back on export
        around = json.loads(h.to_json_string())  # (transformers' non-default fields)
        extra[OUTER] = {k: v for k, v in around.items() if k not in _OWN + (nested,)}
    try:
        cfg = FAMILIES[h.model_type].from_hf(h, extra)
    except RemodelError as e:
        raise RemodelError(f"{where}: {e}") from None
    row = _padding_idx(FAMILIES[h.model_type], getattr(text, "pad_token_id", None), cfg.vocab_size)
    return cfg if row == cfg.padding_idx else cfg.replace(padding_idx=row)


def _padding_idx(fam, pad, vocab: int) -> int | None:
    """The embedding row transformers builds as nn.Embedding's padding_idx for a `fam` model with pad_token_id `pad`
    (a negative id counts from the end, as nn.Embedding reads it); None where the family has none (Family.padding_idx)
    or the id is not a row (transformers refuses to build that model; remodel reads it with every row trained)."""
    if not fam.padding_idx or isinstance(pad, bool) or not isinstance(pad, int) or not -vocab <= pad < vocab:
        return None
    return pad % vocab


def check_exportable(cfg: ModelConfig, family: str) -> None:
    """Refuse (one line) a family that cannot represent this model exactly."""
    def need(ok, why):
        if not ok:
            raise RemodelError(f"cannot export to {family}: {why}")

    need(isinstance(family, str) and family in FAMILIES, f"unknown target (supported: {', '.join(FAMILIES)})")
    off = scaled(cfg)
    need(FAMILIES[family].multipliers or not off, f"{family} has no scalar multipliers ({', '.join(off)}; "
         f"supported by {', '.join(n for n, f in FAMILIES.items() if f.multipliers)})")
    odd = projected(cfg)
    need(FAMILIES[family].projections or not odd, f"{family} has no per-projection multipliers or Mamba norm "
         f"variants ({', '.join(odd)}; supported by {', '.join(n for n, f in FAMILIES.items() if f.projections)})")
    for group in GROUPS:
        odd = varied(cfg, group)
        need(group in FAMILIES[family].variants or not odd, f"{family} has no {group.replace('_', ' ')} variant "
             f"({', '.join(odd)}; supported by {', '.join(n for n, f in FAMILIES.items() if group in f.variants) or 'none'})")
    for k in used(cfg):  # a field the families' config.json holds in one key with the field it defaults from
        for f, path in defaults_from(cfg.sections[k.section_name]).items():
            own, theirs = cfg.value(f"{k.section_name}.{f}"), cfg.value(path)
            need(own == theirs, f"{family} holds {path} and {k.section_name}.{f} in one key ({theirs!r} != {own!r})")
    FAMILIES[family].check_one_key(cfg, need)  # the fields one config.json key holds agree (Family.one_key)
    FAMILIES[family].check(cfg, need)


def config_to_hf(cfg: ModelConfig, family: str) -> dict:
    """ModelConfig -> HF config.json dict, built and checked by transformers' config class."""
    check_exportable(cfg, family)
    if FAMILIES[family].nested:
        return _nested_to_hf(cfg, family)
    d = {k: v for k, v in cfg.extra.items() if k in PASSTHROUGH}
    d.update(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, tie_word_embeddings=cfg.tie_word_embeddings,
             architectures=[FAMILIES[family].arch])
    d.update(FAMILIES[family].to_hf(cfg))
    if FAMILIES[family].padding_idx and "pad_token_id" not in d:  # the frozen row, where no source id is carried
        d["pad_token_id"] = cfg.padding_idx
    h = _hf_config({"model_type": family, **d})
    out = json.loads(h.to_json_string(use_diff=False))
    out["architectures"] = [FAMILIES[family].arch]
    return out


def _nested_to_hf(cfg: ModelConfig, family: str) -> dict:
    """The config.json of a family that nests its text model's config (Family.nested): the fields read around
    it (ModelConfig.extra[OUTER]) with the text model's config as its own family writes it."""
    fam = FAMILIES[family]
    text = {k: v for k, v in config_to_hf(cfg, fam.text.name).items() if k not in ("architectures", "dtype")}
    d = {**cfg.extra[OUTER], fam.nested: text, "tie_word_embeddings": cfg.tie_word_embeddings}
    out = json.loads(_hf_config({"model_type": family, **d}).to_json_string(use_diff=False))
    out["architectures"] = [fam.arch]
    return out


# ---- tensor names (models.hf_adapter; re-exported here, where callers import them) -----------------

def our_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Every parameter of our model definition with its shape (models.layout; the MTP blocks last)."""
    return shapes(cfg)
