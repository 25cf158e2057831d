"""The layout registry: every parameter's named axes, assembled from the layer kinds' specs.

`WIDTHS` (models/spec.py) is the one vocabulary of model widths: the `remodel prune` / `plan` flags, the
search axes, the ModelConfig field each sets and the keep-dict unit it prunes. Each layer kind's spec
(models/kinds.py) lists its parameters with one axis name per dimension, the sizes of its axes and its
segmented axes (concatenations of others, such as the Mamba in_proj, pruned and sharded piece by piece).
Shapes, parameter counts, pruning indices, the TP plan and the HF tensor lists all derive from these.
"""
from __future__ import annotations

import functools

from .config import ModelConfig
from .kinds import KINDS, widths
from .spec import LayerKind, Param

FIXED_AXES = ("vocab", "one") + tuple(dict.fromkeys(
    a for k in KINDS.values() for a in k.fixed))  # never pruned: the model's and each kind's own
# Around a block's mixer: its pre-norm; an MTP step's first block also fuses [embedding | hidden]
# (enorm, hnorm, eh_proj) and its last block ends with final_layernorm.
BLOCK_NORM = Param("norm.weight", ("hidden",))
MTP_FIRST = (Param("enorm.weight", ("hidden",)), Param("hnorm.weight", ("hidden",)),
             Param("eh_proj.weight", ("hidden", "mtp_eh_in")))
MTP_LAST = (Param("final_layernorm.weight", ("hidden",)),)
BUFFERS = ("e_score_correction_bias",)  # stored and exported, but buffers, not parameters
_CONDITIONS = {"sigmoid_router": lambda cfg: cfg.moe.router == "sigmoid",
               "mla_q_direct": lambda cfg: cfg.mla.q_lora_rank is None}  # MLA: q_proj, no low-rank query
_SIZE = {  # the axes no kind owns: size under the widths w
    "hidden": lambda cfg, w: w["hidden_size"], "vocab": lambda cfg, w: w["vocab_size"], "one": lambda cfg, w: 1,
    "mtp_eh_in": lambda cfg, w: 2 * w["hidden_size"],
}


def _holds(cfg: ModelConfig, flag: str) -> bool:
    return _CONDITIONS[flag](cfg) if flag in _CONDITIONS else bool(cfg.get(flag))


def layer_params(cfg: ModelConfig, kind: str) -> tuple[Param, ...]:
    """The mixer parameters of one layer of `kind` (a pattern character) that exist under `cfg` (the kind's own
    flags read: `cfg` may be the kind's view)."""
    own = _KIND_FLAGS[kind]
    return _layer_params(kind, tuple(f in own and _holds(cfg, f) for f in _FLAGS))


def layer_table(cfg: ModelConfig) -> dict[str, tuple[Param, ...]]:
    """{kind: layer_params(cfg, kind)} for every layer kind (the flags read once)."""
    holds = tuple(_holds(cfg, f) for f in _FLAGS)
    return {c: _layer_params(c, holds) for c in KINDS}


_FLAGS = tuple(sorted({f for k in KINDS.values() for p in k.params for f in p.when}))
_KIND_FLAGS = {c: {f for p in k.params for f in p.when} for c, k in KINDS.items()}


@functools.lru_cache(maxsize=None)
def _layer_params(kind: str, holds: tuple) -> tuple[Param, ...]:
    on = {f for f, h in zip(_FLAGS, holds) if h}
    return tuple(p for p in KINDS[kind].params if all(f in on for f in p.when))


def owner(axis: str) -> LayerKind | None:
    """The kind whose spec sizes `axis` (None: an axis of the whole model, such as hidden)."""
    return next((k for k in KINDS.values() if axis in k.sizes or axis in k.segments), None)


def segments(axis: str) -> tuple | None:
    """((segment, axis), ...) of a concatenated axis in storage order; None for a plain axis."""
    k = owner(axis)
    return None if k is None else k.segments.get(axis)


def product(axis: str) -> tuple | None:
    """(outer unit, inner axis) of a composite axis indexed as outer x inner ('attn_q': heads x head_dim)."""
    k = owner(axis)
    return None if k is None else k.products.get(axis)


def axis_size(cfg: ModelConfig, axis: str, w: dict | None = None) -> int:
    """Size of one named axis under the widths `w` (default: cfg's own)."""
    w = w or widths(cfg)
    k = owner(axis)
    return _SIZE[axis](cfg, w) if k is None else k.axis_size(cfg.view(k), axis, w)  # a kind sizes from its view


def resolve(cfg: ModelConfig, axes: tuple) -> tuple:
    """The axes with 'moe_io' named as what it is under `cfg` ('latent' or 'hidden')."""
    io = "latent" if cfg.moe.moe_latent_size else "hidden"
    return tuple(io if a == "moe_io" else a for a in axes)


def segment_sizes(cfg: ModelConfig, axis: str) -> dict[str, int]:
    """{segment: size} of a concatenated axis, in storage order, e.g. the Mamba in_proj rows."""
    k = owner(axis)
    return k.segment_sizes(cfg.view(k), axis)


def segment_span(cfg: ModelConfig, axis: str, first: str, last: str | None = None) -> slice:
    """The slice of `axis` holding the segments first..last (inclusive), e.g. in_proj's x..C."""
    k = owner(axis)
    return k.segment_span(cfg.view(k), axis, first, last)


def block_norm(kind: str) -> Param:
    """The norm of a block of `kind`: BLOCK_NORM, or 'post_norm.weight' after a post_norm kind's mixer."""
    return Param(KINDS[kind].norm_name + ".weight", ("hidden",))


def blocks(cfg: ModelConfig) -> list[tuple[str, str, list[Param]]]:
    """(block prefix, layer kind, its parameters incl. norms, axes resolved) for the trunk, then the MTP blocks."""
    mixers = {c: [Param("mixer." + p.leaf, resolve(cfg, p.axes), p.when) for p in layer_params(cfg, c)]
              for c in set(cfg.pattern + cfg.mtp_pattern)}
    out = [(f"layers.{i}.", c, [block_norm(c)] + mixers[c]) for i, c in enumerate(cfg.pattern)]
    P = len(cfg.mtp_pattern)
    for j, c in enumerate(cfg.mtp_full_pattern):
        ps = list(MTP_FIRST) if j % P == 0 else []
        ps += [block_norm(c)] + mixers[c] + (list(MTP_LAST) if j % P == P - 1 else [])
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
TP_AXES = ("vocab",) + tuple(a for k in KINDS.values() for a in k.tp_axes)  # the vocabulary and each kind's


def tp_split(cfg: ModelConfig, axes: tuple) -> tuple[int, list[int]] | None:
    """(dim, piece sizes) of the tensor-parallel split of a parameter with these axes: the first
    TP-split axis, cut piecewise by its segments (each piece split evenly over the ranks); None: replicated."""
    for d, a in enumerate(axes):
        if a in TP_AXES:
            sizes = list(segment_sizes(cfg, a).values()) if segments(a) else [axis_size(cfg, a)]
            return d, sizes
    return None


def layer_of(name: str) -> int | None:
    """The trunk layer a tensor of our model belongs to (`layers.{i}.`), None for the rest (embeddings, final
    norm, head, MTP)."""
    return int(name.split(".", 2)[1]) if name.startswith("layers.") else None
