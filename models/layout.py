"""The layout registry: every parameter's named axes, per layer type, stated once.

`WIDTHS` is the one vocabulary of model widths: the `remodel prune` / `plan` flags, the search axes,
the ModelConfig field each sets and the keep-dict unit it prunes. `PARAMS` lists each layer type's
parameters with one axis name per dimension; `SEGMENTS` gives the axes that are concatenations of
others (the Mamba in_proj and conv channels, whose pieces are pruned and sharded separately).
Shapes, parameter counts, pruning indices, the TP plan and the HF tensor lists all derive from these.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .config import ModelConfig


@dataclass(frozen=True)
class Width:
    """One model width. name: flag / search axis; field: ModelConfig field; layer: the layer char that
    uses it (None: every layer); unit: the keep-dict axis it prunes (None: not prunable); divisor: the
    search-space step (None: a multiple of the groups, or not searched); short: a table column label."""
    name: str
    field: str
    layer: str | None
    unit: str | None
    divisor: int | None
    short: str
    help: str


WIDTHS = {w.name: w for w in (
    Width("vocab_size", "vocab_size", None, None, None, "vocab", "vocabulary size"),
    Width("hidden_size", "hidden_size", None, "hidden", 256, "hidden", "residual width (embedding channels)"),
    Width("ffn_size", "intermediate_size", "-", "ffn", 512, "ffn", "dense MLP intermediate size"),
    Width("mamba_heads", "mamba_num_heads", "M", "mamba_heads", None, "m.heads",
          "Mamba heads per layer (a multiple of n_groups)"),
    Width("mamba_head_dim", "mamba_head_dim", "M", "mamba_head_dim", 8, "m.hd", "channels per Mamba head"),
    Width("ssm_state_size", "ssm_state_size", "M", None, None, "state", "Mamba SSM state size"),
    Width("attn_heads", "num_attention_heads", "*", "attn_heads", None, "a.heads",
          "query heads per attention layer (a multiple of num_key_value_heads)"),
    Width("kv_heads", "num_key_value_heads", "*", None, None, "kv", "key/value heads"),
    Width("head_dim", "head_dim", "*", None, None, "hd", "attention head size"),
    Width("experts", "n_routed_experts", "E", "experts", 8, "experts", "routed experts per MoE layer"),
    Width("expert_ffn_size", "moe_intermediate_size", "E", "expert_ffn", 512, "e.ffn", "routed expert FFN size"),
    Width("shared_expert_size", "moe_shared_expert_intermediate_size", "E", "shared_ffn", 512, "shared",
          "shared expert FFN size"),
    Width("latent_size", "moe_latent_size", "E", "latent", 256, "latent", "LatentMoE latent size"),
)}
PRUNABLE = tuple(n for n, w in WIDTHS.items() if w.unit)
UNITS = tuple(w.unit for w in WIDTHS.values() if w.unit and w.unit != "hidden")  # per-layer keep-dict axes
FIXED_AXES = ("vocab", "attn_kv", "head_dim", "conv_kernel", "one", "mamba_bc")  # never pruned

# Axes that are concatenations of others: (segment name, the axis it runs over), in storage order.
# The Mamba in_proj output is [z | x | B | C | dt] (gate, scan input, SSM B and C, per-head dt); the conv
# runs over its x, B and C.
SEGMENTS = {
    "mamba_in_proj": (("z", "mamba_inner"), ("x", "mamba_inner"), ("B", "mamba_bc"), ("C", "mamba_bc"),
                      ("dt", "mamba_heads")),
    "mamba_conv": (("x", "mamba_inner"), ("B", "mamba_bc"), ("C", "mamba_bc")),
}


@dataclass(frozen=True)
class Param:
    """A parameter of a layer type: its name under the mixer, one axis per dimension, and the
    conditions (ModelConfig flags, or names in `_CONDITIONS`) that must all hold for it to exist."""
    leaf: str
    axes: tuple
    when: tuple = ()


def _mlp(prefix: str, unit: str, bias: tuple, present: tuple = ()) -> tuple:
    """up/gate/down of a (gated) MLP over `unit`; biases when every flag of `bias` holds."""
    out = (Param(prefix + "up_proj.weight", (unit, "hidden"), present),
           Param(prefix + "gate_proj.weight", (unit, "hidden"), present + ("mlp_gated",)),
           Param(prefix + "down_proj.weight", ("hidden", unit), present))
    if bias:
        out += (Param(prefix + "up_proj.bias", (unit,), bias), Param(prefix + "gate_proj.bias", (unit,), bias + ("mlp_gated",)),
                Param(prefix + "down_proj.bias", ("hidden",), bias))
    return out


PARAMS = {
    "M": (Param("in_proj.weight", ("mamba_in_proj", "hidden")),
          Param("in_proj.bias", ("mamba_in_proj",), ("mamba_proj_bias",)),
          Param("conv1d.weight", ("mamba_conv", "one", "conv_kernel")),
          Param("conv1d.bias", ("mamba_conv",), ("use_conv_bias",)),
          Param("dt_bias", ("mamba_heads",)), Param("A_log", ("mamba_heads",)), Param("D", ("mamba_heads",)),
          Param("norm.weight", ("mamba_inner",)),
          Param("out_proj.weight", ("hidden", "mamba_inner")),
          Param("out_proj.bias", ("hidden",), ("mamba_proj_bias",))),
    "*": (Param("q_proj.weight", ("attn_q", "hidden")), Param("q_proj.bias", ("attn_q",), ("attention_bias",)),
          Param("k_proj.weight", ("attn_kv", "hidden")), Param("k_proj.bias", ("attn_kv",), ("attention_bias",)),
          Param("v_proj.weight", ("attn_kv", "hidden")), Param("v_proj.bias", ("attn_kv",), ("attention_bias",)),
          Param("o_proj.weight", ("hidden", "attn_q")), Param("o_proj.bias", ("hidden",), ("attention_out_bias",)),
          Param("q_norm.weight", ("head_dim",), ("qk_norm",)), Param("k_norm.weight", ("head_dim",), ("qk_norm",))),
    "-": _mlp("", "ffn", ("mlp_bias",)),
    "E": (Param("gate.weight", ("experts", "hidden")),
          Param("gate.e_score_correction_bias", ("experts",), ("sigmoid_router",)),
          Param("experts.up_proj", ("experts", "expert_ffn", "moe_io")),
          Param("experts.gate_proj", ("experts", "expert_ffn", "moe_io"), ("mlp_gated",)),
          Param("experts.down_proj", ("experts", "moe_io", "expert_ffn")))
    + _mlp("shared_experts.", "shared_ffn", (), ("moe_shared_expert_intermediate_size",))
    + (Param("shared_expert_gate.weight", ("one", "hidden"), ("shared_expert_gate",)),
       Param("fc1_latent_proj.weight", ("latent", "hidden"), ("moe_latent_size",)),
       Param("fc2_latent_proj.weight", ("hidden", "latent"), ("moe_latent_size",))),
}
# Around a block's mixer: its pre-norm; an MTP step's first block also fuses [embedding | hidden]
# (enorm, hnorm, eh_proj) and its last block ends with final_layernorm.
BLOCK_NORM = Param("norm.weight", ("hidden",))
MTP_FIRST = (Param("enorm.weight", ("hidden",)), Param("hnorm.weight", ("hidden",)),
             Param("eh_proj.weight", ("hidden", "mtp_eh_in")))
MTP_LAST = (Param("final_layernorm.weight", ("hidden",)),)
BUFFERS = ("e_score_correction_bias",)  # stored and exported, but buffers, not parameters
_CONDITIONS = {"sigmoid_router": lambda cfg: cfg.router == "sigmoid"}


def _holds(cfg: ModelConfig, flag: str) -> bool:
    return _CONDITIONS[flag](cfg) if flag in _CONDITIONS else bool(getattr(cfg, flag))


def layer_params(cfg: ModelConfig, kind: str) -> tuple[Param, ...]:
    """The mixer parameters of one layer of `kind` ('M', '*', '-', 'E') that exist under `cfg`."""
    return _layer_params(kind, tuple(_holds(cfg, f) for f in _FLAGS))


def layer_table(cfg: ModelConfig) -> dict[str, tuple[Param, ...]]:
    """{kind: layer_params(cfg, kind)} for every layer kind (the flags read once)."""
    holds = tuple(_holds(cfg, f) for f in _FLAGS)
    return {c: _layer_params(c, holds) for c in PARAMS}


_FLAGS = tuple(sorted({f for ps in PARAMS.values() for p in ps for f in p.when}))


@functools.lru_cache(maxsize=None)
def _layer_params(kind: str, holds: tuple) -> tuple[Param, ...]:
    on = {f for f, h in zip(_FLAGS, holds) if h}
    return tuple(p for p in PARAMS[kind] if all(f in on for f in p.when))


def widths(cfg: ModelConfig, **changes) -> dict:
    """{width name: size} of `cfg`, with `changes` applied (any value, even 0: nothing is validated)."""
    return {**{n: getattr(cfg, w.field) or 0 for n, w in WIDTHS.items()}, **changes}


_SIZE = {  # axis -> size under the widths w (and the fixed structure of cfg)
    "hidden": lambda cfg, w: w["hidden_size"], "vocab": lambda cfg, w: w["vocab_size"],
    "one": lambda cfg, w: 1, "conv_kernel": lambda cfg, w: cfg.conv_kernel, "ffn": lambda cfg, w: w["ffn_size"],
    "attn_q": lambda cfg, w: w["attn_heads"] * w["head_dim"], "attn_kv": lambda cfg, w: w["kv_heads"] * w["head_dim"],
    "head_dim": lambda cfg, w: w["head_dim"], "attn_heads": lambda cfg, w: w["attn_heads"],
    "mamba_heads": lambda cfg, w: w["mamba_heads"], "mamba_head_dim": lambda cfg, w: w["mamba_head_dim"],
    "mamba_inner": lambda cfg, w: w["mamba_heads"] * w["mamba_head_dim"],
    "mamba_bc": lambda cfg, w: cfg.n_groups * w["ssm_state_size"],
    "experts": lambda cfg, w: w["experts"], "expert_ffn": lambda cfg, w: w["expert_ffn_size"],
    "shared_ffn": lambda cfg, w: w["shared_expert_size"], "latent": lambda cfg, w: w["latent_size"],
    "mtp_eh_in": lambda cfg, w: 2 * w["hidden_size"],
    "moe_io": lambda cfg, w: w["latent_size"] if cfg.moe_latent_size else w["hidden_size"],  # what experts read
}


def axis_size(cfg: ModelConfig, axis: str, w: dict | None = None) -> int:
    """Size of one named axis under the widths `w` (default: cfg's own)."""
    w = w or widths(cfg)
    if axis in SEGMENTS:
        return sum(_SIZE[a](cfg, w) for _, a in SEGMENTS[axis])
    return _SIZE[axis](cfg, w)


def resolve(cfg: ModelConfig, axes: tuple) -> tuple:
    """The axes with 'moe_io' named as what it is under `cfg` ('latent' or 'hidden')."""
    io = "latent" if cfg.moe_latent_size else "hidden"
    return tuple(io if a == "moe_io" else a for a in axes)


def segment_sizes(cfg: ModelConfig, axis: str) -> dict[str, int]:
    """{segment: size} of a concatenated axis, in storage order, e.g. the Mamba in_proj rows."""
    return {name: axis_size(cfg, a) for name, a in SEGMENTS[axis]}


def segment_span(cfg: ModelConfig, axis: str, first: str, last: str | None = None) -> slice:
    """The slice of `axis` holding the segments first..last (inclusive), e.g. in_proj's x..C."""
    sizes = segment_sizes(cfg, axis)
    names = list(sizes)
    start = sum(sizes[n] for n in names[:names.index(first)])
    end = sum(sizes[n] for n in names[:names.index(last or first) + 1])
    return slice(start, end)


def blocks(cfg: ModelConfig) -> list[tuple[str, str, list[Param]]]:
    """(block prefix, layer kind, its parameters incl. norms, axes resolved) for the trunk, then the MTP blocks."""
    mixers = {c: [Param("mixer." + p.leaf, resolve(cfg, p.axes), p.when) for p in layer_params(cfg, c)]
              for c in set(cfg.pattern + cfg.mtp_pattern)}
    out = [(f"layers.{i}.", c, [BLOCK_NORM] + mixers[c]) for i, c in enumerate(cfg.pattern)]
    P = len(cfg.mtp_pattern)
    for j, c in enumerate(cfg.mtp_full_pattern):
        ps = list(MTP_FIRST) if j % P == 0 else []
        ps += [BLOCK_NORM] + mixers[c] + (list(MTP_LAST) if j % P == P - 1 else [])
        out.append((f"mtp.layers.{j}.", c, ps))
    return out


def param_axes(cfg: ModelConfig) -> dict[str, tuple]:
    """{our parameter name: axis per dimension} of every parameter of the model, in storage order:
    embeddings, the trunk's blocks, norm_f, lm_head (untied), then the MTP blocks."""
    t = {"embeddings.weight": ("vocab", "hidden")}
    every = blocks(cfg)
    for prefix, _, ps in every[:cfg.num_layers]:
        t.update({prefix + p.leaf: p.axes for p in ps})
    t["norm_f.weight"] = ("hidden",)
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = ("vocab", "hidden")
    for prefix, _, ps in every[cfg.num_layers:]:
        t.update({prefix + p.leaf: p.axes for p in ps})
    return t


def shapes(cfg: ModelConfig, w: dict | None = None) -> dict[str, tuple]:
    """{our parameter name: shape} (no allocation), under the widths `w` (default: cfg's own)."""
    w = w or widths(cfg)
    table = param_axes(cfg)
    size = {a: axis_size(cfg, a, w) for a in set().union(*table.values())}
    return {n: tuple(map(size.__getitem__, axes)) for n, axes in table.items()}


# ---- tensor parallelism: which dimension of a parameter is split, and in which pieces ----------------
TP_AXES = ("vocab", "ffn", "shared_ffn", "attn_q", "attn_kv", "mamba_in_proj", "mamba_conv", "mamba_heads",
           "mamba_inner")


def tp_split(cfg: ModelConfig, axes: tuple) -> tuple[int, list[int]] | None:
    """(dim, piece sizes) of the tensor-parallel split of a parameter with these axes: the first
    TP-split axis, cut piecewise by its segments (each piece split evenly over the ranks); None: replicated."""
    for d, a in enumerate(axes):
        if a in TP_AXES:
            sizes = list(segment_sizes(cfg, a).values()) if a in SEGMENTS else [axis_size(cfg, a)]
            return d, sizes
    return None
