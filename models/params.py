"""Exact parameter counts and memory of a ModelConfig, by arithmetic alone (nothing is allocated).

`count_params(cfg)['total']` is the number of *parameters* of our model's trunk, the same number as
`sum(p.numel() for p in HybridLM(cfg).parameters())` (less the MTP head, counted apart in
`count_params(cfg)['mtp']`: transformers does not build it) and as transformers' own count of the exported
model (`e_score_correction_bias` is a buffer on both sides, reported apart as `buffers`). It is
summed from `models.hf.our_shapes` (exact by construction); `closed_form` derives the same numbers
from per-layer formulas, which also give the pruner its per-axis view (`by_axis`).
"""
from __future__ import annotations

import functools
import math

from .config import ModelConfig
from .hf import FAMILIES, default_family, our_shapes
from .kinds import KINDS, WIDTHS, count, kind as kind_of, used, widths
from .layout import BUFFERS, axis_size, layer_table

TYPES = ("embeddings", *(k.name for k in KINDS.values()), "norms", "lm_head")
AXES = {n: w.path for n, w in WIDTHS.items()}  # width name (the prune / plan flag) -> its ModelConfig path


def _numel(shape) -> int:
    return math.prod(shape)


def _type_of(name: str, cfg: ModelConfig) -> str:
    if name == "embeddings.weight":
        return "embeddings"
    if name == "lm_head.weight":
        return "lm_head"
    if name == "norm_f.weight" or (name.endswith((".norm.weight", ".post_norm.weight")) and name.count(".") == 3):
        return "norms"  # layers.i.norm.weight (the mixer's own gated norm is layers.i.mixer.norm.weight)
    return KINDS[cfg.pattern[int(name.split(".")[1])]].name


def _is_routed_expert(name: str) -> bool:
    return ".experts." in name and not name.endswith(".weight")


# ---- closed form: the same numbers from the layout table over plain sizes ---------------------

def per_layer(cfg: ModelConfig, d: dict | None = None) -> dict:
    """Mixer parameters of one layer of each type (pre-norm excluded), plus 'routed' (the routed
    experts of one MoE layer), for the structure of `cfg` with the widths `d` (default: cfg's own;
    any width may be changed, even to values a ModelConfig would reject, e.g. 0)."""
    d = d or widths(cfg)
    out = {"routed": 0}
    size, table = {}, layer_table(cfg)
    for c, k in KINDS.items():
        n = [(math.prod(size[a] if a in size else size.setdefault(a, axis_size(cfg, a, d)) for a in axes), routed)
             for axes, routed in _counted(table[c])]
        out[k.name] = sum(v for v, _ in n)
        if k.routed:
            out["routed"] = sum(v for v, routed in n if routed)
    return out


@functools.lru_cache(maxsize=None)
def _counted(params: tuple) -> tuple:
    """(axes, is a routed expert) of the parameters among `params` (buffers are not parameters)."""
    return tuple((p.axes, p.leaf.startswith("experts.")) for p in params if not p.leaf.endswith(BUFFERS))


def closed_form(cfg: ModelConfig, d: dict | None = None) -> dict:
    """{type: params} over TYPES plus 'buffers' and 'routed' (inside 'moe'), from the formulas."""
    d = d or widths(cfg)
    V, H = d["vocab_size"], d["hidden_size"]
    one = per_layer(cfg, d)
    n = {k.name: count(cfg, k) for k in KINDS.values()}
    out = {k.name: n[k.name] * one[k.name] for k in KINDS.values()}
    out.update(embeddings=V * H, norms=(cfg.num_layers + 1) * H, lm_head=0 if cfg.tie_word_embeddings else V * H,
               buffers=sum(n[k.name] * k.buffer_elements(cfg.view(k), d) for k in KINDS.values() if n[k.name]),
               routed=sum(n[k.name] for k in KINDS.values() if k.routed) * one["routed"])
    return out


def _axis_table(cfg: ModelConfig) -> dict:
    """For each prunable width: its size, the params that depend on it (per type) and the params
    freed by removing one unit of it (the marginal cost, at the current other widths)."""
    base = widths(cfg)
    now = closed_form(cfg, base)
    out = {}
    for axis, size in base.items():
        if not size:
            continue
        zero, less = closed_form(cfg, {**base, axis: 0}), closed_form(cfg, {**base, axis: size - 1})
        by_type = {t: now[t] - zero[t] for t in TYPES if now[t] != zero[t]}
        if not by_type:
            continue  # a width no layer of this pattern uses
        out[axis] = {"size": size, "params": sum(by_type.values()),
                     "per_unit": sum(now[t] - less[t] for t in TYPES), "by_type": by_type}
    return out


# ---- public API -------------------------------------------------------------------------------

def layer_params(cfg: ModelConfig, kind: str, active: bool = False) -> int:
    """Parameters of one layer of `kind` (a pattern character or a kind name such as 'mamba'), its pre-norm
    included (what removing one such layer frees); active=True counts routed experts at k / n_routed_experts."""
    return _layer(cfg, kind_of(kind), per_layer(cfg), active)


def _layer(cfg: ModelConfig, k, one: dict, active: bool = False) -> int:
    """layer_params from `per_layer(cfg)` computed once."""
    p = one[k.name]
    if active and k.routed:
        p -= one["routed"] - one["routed"] * cfg.moe.num_experts_per_tok // cfg.moe.n_routed_experts
    return p + cfg.hidden_size


def count_params(cfg: ModelConfig, family: str | None = None, by_axis: bool = False) -> dict:
    """Exact parameter counts of `cfg` (ours; no tensors allocated).

    total: every parameter of our model (== HybridLM(cfg).parameters() == transformers' count);
    active: per token, routed experts counted at num_experts_per_tok of n_routed_experts (an exact
      integer: every routed tensor has a leading E), all else in full, embeddings and lm_head included;
    by_type: {embeddings, mamba, attention, mlp, moe, norms, lm_head} (layer pre-norms and norm_f
      are 'norms'; a Mamba mixer's gated norm is 'mamba'); routed: routed-expert params;
    buffers: e_score_correction_bias elements (fp32 buffers, saved in checkpoints, not parameters);
    hf_total: parameters of the model transformers builds from the `family` export (default
      `default_family(cfg)`): a family that always builds a shared expert adds a size-1 zero one per MoE
      layer of a model without (its extra_tensors, models.load.extra_hf_tensors), a family that never ties
      builds a tied model's lm_head (models.load.head_copy), and a family that carries tensors through (a vision
      tower) adds them;
    passthrough: the parameters of those carried-through tensors (Family.passthrough_params);
    by_axis (only when asked: two closed forms per width, two thirds of a call's time, which plan's exact
      checks and search's brute force do not read): see `_axis_table`;
    per_layer: params of one layer of each kind present (norm included).
    """
    from .load import extra_hf_tensors, head_copy

    shapes = our_shapes(cfg)
    trunk = {n: v for n, v in shapes.items() if not n.startswith("mtp.")}
    by_type, buffers, routed = _tally(trunk, lambda n: _type_of(n, cfg), TYPES)
    total = sum(by_type.values())
    active = _active(cfg, total, routed)
    family = family or default_family(cfg)
    extra = sum(_numel(s) for s in extra_hf_tensors(cfg, family).values())
    extra += cfg.vocab_size * cfg.hidden_size if head_copy(cfg, family) else 0  # lm_head stored as a copy
    passed = FAMILIES[family].passthrough_params(cfg)
    one = per_layer(cfg)
    out = {
        "total": total, "active": active, "routed": routed, "buffers": buffers,
        "hf_total": total + extra + passed, "passthrough": passed, "family": family,
        "by_type": by_type,
        "per_layer": {k.name: _layer(cfg, k, one) for k in used(cfg, mtp=False)},
        "mtp": mtp_params(cfg),
    }
    return {**out, "by_axis": _axis_table(cfg)} if by_axis else out


def _tally(shapes: dict, type_of, types=()) -> tuple[dict, int, int]:
    """-> ({type: params} (every one of `types` present), buffer elements, routed-expert params)."""
    by_type, buffers, routed = dict.fromkeys(types, 0), 0, 0
    for name, shape in shapes.items():
        if name.endswith(BUFFERS):
            buffers += _numel(shape)
            continue
        t = type_of(name)
        by_type[t] = by_type.get(t, 0) + _numel(shape)
        if _is_routed_expert(name):
            routed += _numel(shape)
    return by_type, buffers, routed


def active_params(cfg: ModelConfig, with_mtp: bool = False) -> int:
    """Parameters used per token: routed experts at num_experts_per_tok of n_routed_experts, all else in
    full (embeddings and lm_head included; buffers not). The one active count: count_params, the
    training FLOPs (pipelines.training.metrics) and the upcycling report read it; with_mtp adds the MTP head's."""
    shapes = {n: s for n, s in our_shapes(cfg).items() if with_mtp or not n.startswith("mtp.")}
    by_type, _, routed = _tally(shapes, lambda n: "all")
    return _active(cfg, sum(by_type.values()), routed)


def _active(cfg: ModelConfig, total: int, routed: int) -> int:
    return total - routed + (routed * cfg.moe.num_experts_per_tok // cfg.moe.n_routed_experts if routed else 0)


def _mtp_type(name: str, cfg: ModelConfig) -> str:
    leaf = name.split(".", 3)[3]  # mtp.layers.j.<leaf>
    if leaf == "eh_proj.weight":
        return "eh_proj"
    if not leaf.startswith("mixer."):
        return "norms"  # norm, enorm, hnorm, final_layernorm
    return KINDS[cfg.mtp_full_pattern[int(name.split(".")[2])]].name


def mtp_params(cfg: ModelConfig) -> dict:
    """The MTP head's own parameters, apart from `total` (transformers does not build it; it shares
    the trunk's embeddings and lm_head): total, active per token, routed, buffers, by_type
    ({eh_proj, norms, attention, moe, ...}) and with_trunk (total + the trunk's total)."""
    shapes = {n: v for n, v in our_shapes(cfg).items() if n.startswith("mtp.")}
    by_type, buffers, routed = _tally(shapes, lambda n: _mtp_type(n, cfg))
    total = sum(by_type.values())
    trunk = sum(_numel(v) for n, v in our_shapes(cfg).items() if not n.startswith("mtp.") and not n.endswith(BUFFERS))
    return {"layers": cfg.mtp_layers, "pattern": cfg.mtp_pattern, "total": total,
            "active": _active(cfg, total, routed), "routed": routed, "buffers": buffers,
            "by_type": by_type, "with_trunk": trunk + total}


def memory_bytes(cfg: ModelConfig, dtype_bytes: int = 2, batch: int = 1, seq_len: int = 4096,
                 kv_dtype_bytes: int = 2, state_dtype_bytes: int = 4, conv_dtype_bytes: int | None = None) -> dict:
    """Bytes of weights and of the inference cache for `batch` sequences of `seq_len` tokens.

    weights: parameters * dtype_bytes + router correction-bias buffers at 4 bytes (kept fp32);
    kv_cache: per attention layer 2 (K and V) * batch * seq_len * num_kv_heads * head_dim * kv_dtype_bytes;
    mamba_conv_state: per Mamba layer batch * conv_dim * conv_kernel * conv_dtype_bytes (default
      kv_dtype_bytes; transformers 5.23 and mamba-ssm keep conv_kernel columns, in the model dtype);
    mamba_ssm_state: per Mamba layer batch * nh * hd * N * state_dtype_bytes (transformers keeps it
      fp32: mamba_ssm_cache_dtype 'float32'). Mamba state does not grow with seq_len.
    state_rows: {row: bytes}, every kind's state under the row it names (GDN's conv and recurrent state too).
    """
    conv_dtype_bytes = kv_dtype_bytes if conv_dtype_bytes is None else conv_dtype_bytes
    c, w, cache = count_params(cfg), widths(cfg), {"kv_cache": 0, "mamba_conv_state": 0, "mamba_ssm_state": 0}
    rows, bytes_ = {}, (kv_dtype_bytes, state_dtype_bytes, conv_dtype_bytes)
    for k in used(cfg, mtp=False):  # each kind counts its state from its own sections (its view)
        for name, b in k.cache_bytes(cfg.view(k), w, batch, seq_len, *bytes_).items():
            cache[name] = cache.get(name, 0) + count(cfg, k) * b
        for row, b in k.state_rows(cfg.view(k), w, batch, seq_len, bytes_).items():
            rows[row] = rows.get(row, 0) + count(cfg, k) * b
    out = {"weights": c["total"] * dtype_bytes + c["buffers"] * 4, **cache}
    mtp = c["mtp"]  # the MTP head's weights, apart (not in weights / total; needed to serve it)
    out["mtp_weights"] = mtp["total"] * dtype_bytes + mtp["buffers"] * 4
    out["mamba_state"] = out["mamba_conv_state"] + out["mamba_ssm_state"]
    out["state_rows"] = rows  # {inspect row: bytes}, each kind's own; they add up to cache
    out["cache"] = sum(cache.values())
    out["total"] = out["weights"] + out["cache"]
    out.update(batch=batch, seq_len=seq_len, dtype_bytes=dtype_bytes)
    return out
