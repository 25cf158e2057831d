"""The spec of a Hugging Face model family: what config import/export, the key map, depth pruning,
upcycling and the CLI read about a family instead of testing its name.

One module per family (models/families/*.py) defines its Family instances; models/families/__init__.py
lists them. A new family is one such module and one registry line.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from dataclasses import dataclass, field

from remodel.models.attention import ATTENTION
from remodel.models.config import SECTIONS, ModelConfig
from remodel.models.section import variants
from remodel.models.kinds import used

# The family numerics, declared by the kinds' config sections (metadata "variant") at their plain values:
# the scalar multipliers (a family without `multipliers` needs these plain) and the per-projection multipliers
# and Mamba norm variants (a family without `projections` needs these plain)
MULTIPLIERS = variants(SECTIONS.values(), "multipliers")
PROJECTIONS = variants(SECTIONS.values(), "projections")
# every other variant group (a family holds it when it names it in Family.variants): {group: {field: plain}}
_CLASSES = (ModelConfig, *SECTIONS.values())
GROUPS = {g: variants(_CLASSES, g) for g in sorted({f.metadata.get("variant") for c in _CLASSES
                                                     for f in dataclasses.fields(c)} - {None, "", "multipliers", "projections"})}


def varied(cfg, group: str) -> list[str]:
    """The fields of variant group `group` that `cfg` holds away from their plain values, as 'name=value'."""
    return [f"{k}={cfg.get(k)}" for k, plain in GROUPS[group].items() if cfg.get(k) != plain]


def projected(cfg) -> list[str]:
    """The PROJECTIONS fields of `cfg` away from their plain values, as 'name=value'."""
    return [f"{k}={cfg.get(k)}" for k, plain in PROJECTIONS.items() if cfg.get(k) != plain]


def plain_attention_scale(cfg) -> float | None:
    """cfg.attention.attention_scale, None where it is the default 1/sqrt(head_dim) anyway or no layer attends."""
    s = cfg.attention.attention_scale
    return None if ATTENTION not in used(cfg) or (cfg.attention.head_dim and s == 1 / math.sqrt(cfg.attention.head_dim)) else s


def scaled(cfg) -> list[str]:
    """The multipliers of `cfg` away from their plain values, as 'name=value'."""
    got = {k: cfg.get(k) for k in MULTIPLIERS} | {"attention_scale": plain_attention_scale(cfg)}
    return [f"{k}={cfg.get(k)}" for k, plain in MULTIPLIERS.items() if got[k] != plain]


def feed_forward_keys(final_norm: str = "model.final_layernorm.weight") -> dict:
    """Key map of a mixer + SwiGLU `feed_forward` decoder layer (bamba, falcon_h1) but for the mixer's own
    tensors: the embeddings, our layer 2j's norm (HF input_layernorm), 2j+1's norm (pre_ff_layernorm) and
    MLP (any bias), the final norm and the lm_head."""
    from remodel.models.layout import BLOCK_NORM
    out = {"embeddings.weight": "model.embed_tokens.weight",
           "layers.{a}." + BLOCK_NORM.leaf: "model.layers.{a}.input_layernorm.weight",
           "layers.{m}." + BLOCK_NORM.leaf: "model.layers.{m}.pre_ff_layernorm.weight"}
    out.update({f"layers.{{m}}.mixer.{p}.{t}": f"model.layers.{{m}}.feed_forward.{p}.{t}"
                for p in ("gate_proj", "up_proj", "down_proj") for t in ("weight", "bias")})
    out.update({"norm_f.weight": final_norm, "lm_head.weight": "lm_head.weight"})
    return out


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")  # transformers' own


def _get(src, key, default):
    return src.get(key, default) if isinstance(src, dict) else getattr(src, key, default)


def cfg_float(src, key: str, default, lo: float | None = None, hi: float | None = None, where: str = "") -> float:
    """src[key] (a dict or a transformers config object) as a float in the open-low interval (lo, hi]:
    a one-line RemodelError naming the field for a string, bool, list, NaN or a value out of range."""
    from remodel.models.errors import RemodelError
    v = _get(src, key, default)
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    if not ok or (lo is not None and v <= lo) or (hi is not None and v > hi):
        rng = f" in ({lo}, {hi}]" if hi is not None else (f" > {lo}" if lo is not None else "")
        raise RemodelError(f"{where}{key!r} must be a finite number{rng}, got {v!r}")
    return float(v)


def cfg_choice(src, key: str, default, choices: tuple, where: str = ""):
    """src[key] when it is one of `choices` (None allowed only when listed), else a one-line RemodelError."""
    from remodel.models.errors import RemodelError
    v = _get(src, key, default)
    if not any(v == c and type(v) is type(c) for c in choices):
        raise RemodelError(f"{where}{key!r} must be one of {', '.join(map(repr, choices))}, got {v!r}")
    return v


def read_rope(h, family: str, types=("default",), partial: bool = False) -> tuple[float, dict, float]:
    """(rope_theta, rope_parameters, partial_rotary_factor) of a HF config, each field checked: the
    rope_type a known one and one the family reads (`types`), theta > 0, the partial rotary factor in
    (0, 1] and 1 where the family rotates whole heads (partial False)."""
    from remodel.models.errors import RemodelError
    rp = getattr(h, "rope_parameters", None) or {}
    if not isinstance(rp, dict):
        raise RemodelError(f"'rope_parameters' must be an object, got {type(rp).__name__}")
    kind = cfg_choice(rp, "rope_type", "default", ROPE_TYPES, "rope_parameters ")
    if kind not in types:
        raise RemodelError(f"{family} with rope_type {kind!r} is not supported (only {', '.join(types)})")
    theta = cfg_float(rp, "rope_theta", _get(h, "rope_theta", 10000.0), lo=0, where="rope_parameters ")
    rotary = cfg_float(rp, "partial_rotary_factor", 1.0, lo=0, hi=1, where="rope_parameters ")
    if not partial and rotary != 1:
        raise RemodelError(f"{family} rotates whole heads: partial_rotary_factor must be 1, got {rotary}")
    return theta, dict(rp), rotary


def gqa_attention(h, family: str, types=ROPE_TYPES, partial: bool = True, **variant) -> dict:
    """The attention section of a Llama-shaped HF config `h`: heads, KV heads, head_dim (else hidden / heads),
    RoPE of one of `types` on part of each head (partial) or all of it (read_rope), and the family's `variant`
    fields."""
    theta, rp, rotary = read_rope(h, family, types=types, partial=partial)
    return dict(num_attention_heads=h.num_attention_heads, num_key_value_heads=h.num_key_value_heads,
                head_dim=getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads, rope_theta=theta,
                rope_scaling=None if rp.get("rope_type", "default") == "default" else rp, partial_rotary_factor=rotary,
                **variant)


def gqa_to_hf(a) -> dict:
    """config.json's attention fields of the attention section `a` (the inverse of gqa_attention)."""
    rope = {"rope_theta": a.rope_theta, "rope_type": "default"} if a.rope_scaling is None else dict(a.rope_scaling)
    return dict(num_attention_heads=a.num_attention_heads, num_key_value_heads=a.num_key_value_heads,
                head_dim=a.head_dim, rope_parameters={**rope, "partial_rotary_factor": a.partial_rotary_factor})


def time_step_limit(h) -> tuple[float, float]:
    """(lower, upper) clamp of Mamba's dt from a HF config; None means no clamp (softplus(.) >= 0 already)."""
    from remodel.models.errors import RemodelError
    lim = h.time_step_limit
    if lim is None:
        return 0.0, float("inf")
    if len(lim) != 2:
        raise RemodelError(f"time_step_limit must be [min, max], got {list(lim)!r}")
    return float(lim[0]), float(lim[1])


@dataclass(frozen=True)
class Family:
    """name: transformers' model_type; arch: its CausalLM class; depth: our layers per HF decoder layer
    (depth pruning removes them together); moe: its layers hold routed experts (an upcycling target);
    mtp: it stores MTP layers; routers: the upcycling routers it can hold; shared_expert_gate: its
    shared expert is scaled by sigmoid(w.x); width_rules: the constraints between widths its
    transformers config imposes (hidden a multiple of the query heads, the Mamba width of hidden); block_types: its config's per-layer type names, as our layer kinds;
    multipliers: it holds embedding_multiplier, residual_multiplier, attention_scale and logits_scaling
    (every other family needs them at their defaults); projections: it holds the PROJECTIONS fields;
    tiny: named tiny config.json field sets (model_type left out) of this family, the conformance suite's
    builders (tests/test_families.py): the first is its one model for every check, the rest variants whose
    parity and round trips it checks too. raw: bounds of its config.json keys that no kind's field holds
    (the fields' own keys are declared by the fields: models.section.raw_bounds). A family brings its tests with it: no suite edit."""
    name: str
    arch: str
    depth: int = 1
    moe: bool = False
    mtp: bool = False
    routers: tuple = ()
    shared_expert_gate: bool = False
    width_rules: tuple = ()  # WidthRules its transformers config imposes (models/families/width_rules.py)
    block_types: dict = field(default_factory=dict)
    multipliers: bool = False  # its config holds ModelConfig's scalar multipliers (embedding, residual, ...)
    # transformers builds its input embedding as nn.Embedding(vocab, hidden, padding_idx=config.pad_token_id): that
    # row gets no gradient from the input lookup, and ours neither (models.hf.config_from_hf sets
    # ModelConfig.padding_idx; tests/test_pad_row.py checks the flag against transformers' module and the gradients)
    padding_idx: bool = False
    projections: bool = False  # it holds the PROJECTIONS fields (Falcon-H1's multipliers, Mamba norm variants)
    # the share of each head's channels its attention rotates whatever config.json says (None: the config's own;
    # upcycle.hybridize widens the heads of a source rotating another share)
    fixed_rotary: float | None = None
    upcycle_help: str = "no upcycling"  # the default upcycling target of a source of this family, in words
    tiny: dict = field(default_factory=dict)  # {case name: tiny config.json fields} (the suite's builders)
    raw: dict = field(default_factory=dict)  # {config.json key: (lo, hi)} of its shape keys no config field holds
    variants: tuple = ()  # the variant groups it holds beyond multipliers / projections (family.GROUPS)
    # {config.json key: (our field paths)}: one key of its config holds several of our fields (Jamba's
    # intermediate_size sizes both its MLPs and each expert), so a model has one value for those of them its layers
    # use: from_hf fills them all, to_hf writes it, models.hf.check_exportable refuses two (check_one_key), the
    # search ties their widths
    one_key: dict = field(default_factory=dict)
    # a checkpoint holding another family's text model: its config.json key of the text model's config
    # ("text_config"; models.hf reads and writes the text model there), and the HF name prefixes of the tensors
    # carried through byte-identical (a vision tower and its merger; models.load.passthrough_tensors)
    nested: str = ""
    passthrough: tuple = ()
    # its transformers class ties lm_head to the embedding when config.json says so; False (nemotron_h, kimi_linear:
    # `_tied_weights_keys = {}`): it always builds its own head, so the writers store a tied model's lm_head as a copy
    # of the embedding (models.load.head_copy), else transformers would load a random head
    ties_head: bool = True

    # ---- HF config ---------------------------------------------------------------------
    def required(self, h) -> list:
        """Shape-defining config.json fields beyond vocab and hidden size (each a tuple of alternatives)."""
        return []

    def from_hf(self, h, extra: dict):
        """ModelConfig of transformers' config object `h` (extra: HF fields carried through)."""
        raise NotImplementedError

    def check(self, cfg, need) -> None:
        """need(ok, why) for everything the family cannot represent exactly."""

    def to_hf(self, cfg) -> dict:
        """The family's own config.json fields of `cfg` (vocab, hidden, ties and passthroughs are added by models.hf)."""
        raise NotImplementedError

    # ---- tensors -------------------------------------------------------------------------
    def key_map(self) -> dict:
        """{our name pattern: HF name pattern, or a Part of one} (models.hf_adapter reads it both ways)."""
        raise NotImplementedError

    def extra_tensors(self, cfg) -> dict:
        """{our name: shape} the family's checkpoint holds but our model lacks (written as zeros)."""
        return {}

    def one_key_fields(self, cfg) -> dict:
        """{config.json key of `one_key`: {its field: value} for the fields `cfg` has (the trunk's, or of a section
        its layers use)}."""
        present = {k.section_name for k in used(cfg)}
        return {key: {p: cfg.value(p) for p in ps if "." not in p or p.split(".")[0] in present}
                for key, ps in self.one_key.items()}

    def tied_fields(self, cfg) -> list[tuple]:
        """The groups of two or more fields `cfg` has that one config.json key holds: they must hold one value."""
        return [tuple(got) for got in self.one_key_fields(cfg).values() if len(got) > 1]

    def one_key_values(self, cfg) -> dict:
        """{config.json key of `one_key`: what to_hf writes}: the first of its fields that `cfg` has, else its first."""
        return {key: next(iter(got.values()), cfg.value(self.one_key[key][0]))
                for key, got in self.one_key_fields(cfg).items()}

    def check_one_key(self, cfg, need) -> None:
        """need(...) that the fields one config.json key holds agree."""
        for key, got in self.one_key_fields(cfg).items():
            need(len(set(got.values())) <= 1, f"{self.name} holds {' and '.join(got)} in one key, {key} "
                 f"({', '.join(f'{p}={v}' for p, v in got.items())})")

    def fixed_fields(self, cfg) -> tuple:
        """Config fields no pruning may change in this family (its check refuses them; the search holds them)."""
        return ()

    def passthrough_params(self, cfg) -> int:
        """Parameters of the tensors it carries through (counted apart from our model's; 0: none)."""
        return 0

    def depth_units(self, cfg) -> list:
        """The family's decoder layers as lists of our layer indices (removed together by depth pruning)."""
        d = self.depth
        return [list(range(j * d, (j + 1) * d)) for j in range(cfg.num_layers // d)]

    def depth_forms(self, types: list, removed: dict) -> list | None:
        """The unit-type sequences (one type per kept depth unit) the family holds after dropping removed[t] units of
        each type t from units of `types`; None: whichever units go (models/families/depth_forms.py asks it)."""
        return None

    def other_spelling(self, hf_name: str) -> str | None:
        """Another name the family's released checkpoints give the HF tensor `hf_name` (read when `hf_name` is
        absent; written names are always `hf_name`, transformers' own); None: no other."""
        return None

    def regrouped(self, ours: str, hf_name: str) -> tuple[list, list] | None:
        """(our tensors, HF tensors) where the HF tensors concatenate (dim 0) what ours do, cut elsewhere (another
        writer's layout, read when `hf_name` is not our tensor's shape); None: no such group."""
        return None

    # ---- what it becomes -------------------------------------------------------------------
    def claims(self, cfg) -> bool:
        """Whether this family is the default export of `cfg` (asked in models.families.DEFAULT_ORDER)."""
        return False

    def holds(self, cfg) -> bool:
        """Whether `check` and `check_one_key` (both asked by models.hf.check_exportable) find nothing of `cfg` that
        this family cannot represent exactly."""
        problems = []
        self.check_one_key(cfg, lambda ok, why: ok or problems.append(why))
        self.check(cfg, lambda ok, why: ok or problems.append(why))
        return not problems

    def upcycle_router(self) -> str:
        """The router upcycling uses by default for a source of this family."""
        return "topk-softmax"

    def upcycle_into(self, cfg, router: str, shared: int) -> str:
        """The MoE family a dense source of this family upcycles into by default; a family that names none
        refuses in one line (not a traceback)."""
        from remodel.models.errors import RemodelError
        raise RemodelError(f"{self.name} has no default upcycling target; --to names one "
                           f"({self.upcycle_help or 'none known'})")

    def upcycled(self, cfg):
        """An upcycled config with this (target) family's own MoE numerics set (default: as upcycling made it)."""
        return cfg

    def upcycle_check(self, cfg, router: str) -> str | None:
        """Why an upcycled `cfg` with `router` cannot be held exactly by this (MoE) family; None: it can."""
        if router not in self.routers:
            return f"{self.name} holds the routers {', '.join(self.routers)}, not {router}"
        return None


@dataclass(frozen=True)
class Part:
    """A key-map value (and what `to_hf_part` returns): our tensor is part `index` of `count` parts, along our
    tensor's dimension `dim`, of the HF tensor `name`, which concatenates them in index order. A plain
    tensor is part 0 of 1. Parts are equal unless `sized` (then to_hf_part fills `sizes`, every part's size
    read from our shapes); `blocks` (an int or a config field, resolved by to_hf_part): the HF tensor is
    that many groups each concatenating one equal block of every part (Qwen3-Next's per-key-head qkvz);
    `transposed`: the HF tensor is that concatenation with its last two dimensions swapped (gpt-oss's experts)."""
    name: str
    dim: int = 0
    index: int = 0
    count: int = 1
    sized: bool = False
    blocks: int | str = 1
    sizes: tuple = ()
    transposed: bool = False

    @property
    def whole(self) -> bool:
        """The HF tensor is our tensor as it is (one part, not transposed)."""
        return self.count == 1 and not self.transposed

    def _sizes(self, ours: int) -> tuple:
        return self.sizes or (ours,) * self.count

    def narrow(self, hf_tensor, expert: int | None = None):
        """Our part of the HF tensor (of one expert's HF tensor when `expert` is given: dim counts ours)."""
        if self.transposed:
            hf_tensor = hf_tensor.transpose(-2, -1)
        if self.count == 1:
            return hf_tensor
        d, b = self.dim - (expert is not None), self.blocks
        sizes = self.sizes or (hf_tensor.shape[d] // self.count,) * self.count
        grouped = hf_tensor.unflatten(d, (b, -1))
        return grouped.narrow(d + 1, sum(sizes[:self.index]) // b, sizes[self.index] // b).flatten(d, d + 1)

    def hf_shape(self, shape: tuple, expert: int | None = None) -> tuple:
        """The HF tensor's shape given our part's `shape` (one expert's, when `expert` is given)."""
        d = self.dim - (expert is not None)
        out = tuple(sum(self._sizes(n)) if k == d else n for k, n in enumerate(shape))
        return (*out[:-2], out[-1], out[-2]) if self.transposed else out

    def hf_index(self, i, ours: int):
        """The HF tensor's indices along dim of our indices `i` (a LongTensor) along our dim of size `ours`."""
        sizes, b = self._sizes(ours), self.blocks
        per = sizes[self.index] // b
        return (i // per) * (sum(sizes) // b) + sum(sizes[:self.index]) // b + i % per

    def join(self, parts: list, dim: int):
        """The HF tensor from all its parts (ours, in index order) along `dim`."""
        b = self.blocks
        t = torch.cat([t.unflatten(dim, (b, -1)) for t in parts], dim + 1).flatten(dim, dim + 1)
        return t.transpose(-2, -1).contiguous() if self.transposed else t
