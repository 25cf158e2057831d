"""--mixer gdn (issue 57): the replaced attention layers become Gated DeltaNet layers (models.gated_deltanet),
initialised from their attention.

Shape: one key head AND one value head per query head (linear_num_key_heads = linear_num_value_heads = query heads,
both head dims the attention's). Gated DeltaNet shares a query across the value heads of a key head, so key heads =
KV heads (value heads = query heads) would merge each group's queries into one and make its value heads identical;
one key head per query head keeps every query: q <- that head's Q rows (times the source's q-norm scale, where it
has one), k and v <- its KV head's K and V rows (repeat_kv's order), out_proj <- O. Measured against the smaller
shape (key heads = KV heads, q <- the mean of the group's Q, v repeated per query head), same 40 steps as
tests/test_hybridize_quality.py: 5.514 / 5.512 here vs 5.514 / 5.518 (seeds 0 / 1): level or better, for q / k
projections H / KV times wider (the recurrent state, dk x dv per value head, is the same). The convs are the identity (the
newest tap 1, the others 0), so before silu and GDN's L2 norm of q and k the layer reads attention's q, k, v; with
no decay and small beta the delta rule is then their linear form sum_s (q_t . k_s) v_s (each head's output RMS-normed).
Projection biases of the source (qwen2) have no place in Gated DeltaNet and are dropped.

Gates: the output gate's rows (in_proj_z) zero, so the layer starts silent (silu(0) = 0: the hybrid starts as the
source without those layers) and the gradient opens it, as the Mamba init does; A_log, dt_bias and the a / b rows as
transformers initialises them. Measured on a small trained Llama (tests/test_hybridize_quality.py, its docstring
has the numbers): silent z ended lower than transformers' random z on both seeds; decays set near the linear form
(a / b rows zero, A = 1e-3: decay ~ 1, beta 1/2) ended level with transformers' (+0.0006 / -0.0012), so the
issue's choice, transformers' own, is kept.
"""
from __future__ import annotations

import torch

from remodel.models.norm import scale_of


def gdn_sizes(a) -> dict:
    """Gated DeltaNet fields from the source's attention section: a key and a value head per query head."""
    return {"gated_deltanet.linear_num_key_heads": a.num_attention_heads,
            "gated_deltanet.linear_num_value_heads": a.num_attention_heads,
            "gated_deltanet.linear_key_head_dim": a.head_dim, "gated_deltanet.linear_value_head_dim": a.head_dim}


def repeat_heads(t: torch.Tensor, kv_heads: int, heads: int) -> torch.Tensor:
    """Rows of KV heads [kv * d, ...] -> the rows each query head reads [heads * d, ...] (repeat_kv's order)."""
    return t.unflatten(0, (kv_heads, -1)).repeat_interleave(heads // kv_heads, dim=0).flatten(0, 1)


def identity_conv(w: torch.Tensor) -> torch.Tensor:
    """A causal depthwise conv weight [channels, 1, kernel] that passes its input: the newest tap (last) 1."""
    out = torch.zeros_like(w)
    out[..., -1] = 1
    return out


def _q_scale(cfg, att: dict, name: str, rows: torch.Tensor) -> torch.Tensor:
    """Rows times the source's per-channel q/k norm scale (its direction survives GDN's L2 norm), if it has one."""
    if f"{name}.weight" not in att:
        return rows
    s = scale_of(att[f"{name}.weight"], cfg.norm_offset).to(rows.dtype)
    return (rows.unflatten(0, (-1, s.numel())) * s[:, None]).flatten(0, 1)


def qkv_per_query_head(cfg, att: dict) -> tuple:
    """(q, k, v) rows [heads * d, hidden] per query head from one attention layer: Q (its query half where the
    source is gated), K and V repeated per query head (repeat_kv's order), q and k times the source's q/k norm
    scale where it has one (a linear mixer that L2-normalises q and k keeps its direction)."""
    a = cfg.attention
    H, KV = a.num_attention_heads, a.num_key_value_heads
    q = att["q_proj.weight"]
    if q.shape[0] == 2 * H * a.head_dim:  # a gated source (Qwen3.5): each head's rows are [query | gate]
        q = q.unflatten(0, (H, 2 * a.head_dim))[:, :a.head_dim].flatten(0, 1)
    return (_q_scale(cfg, att, "q_norm", q), repeat_heads(_q_scale(cfg, att, "k_norm", att["k_proj.weight"]), KV, H),
            repeat_heads(att["v_proj.weight"], KV, H))


def gdn_from_attention(cfg, att: dict, fresh: dict) -> dict:
    """One Gated DeltaNet layer's tensors from one attention layer's `att` (module docstring); the rest (a / b rows,
    A_log, dt_bias, the gated norm) as `fresh` (transformers' init) holds them. `cfg`: the hybrid's config (its
    attention section's head counts are the source's; `att`'s norms already in its norm offset)."""
    out = dict(fresh)
    out["in_proj_q.weight"], out["in_proj_k.weight"], out["in_proj_v.weight"] = qkv_per_query_head(cfg, att)
    out["out_proj.weight"] = att["o_proj.weight"].clone()
    for x in "qkv":
        out[f"{x}_conv1d.weight"] = identity_conv(fresh[f"{x}_conv1d.weight"])
        if f"{x}_conv1d.bias" in fresh:
            out[f"{x}_conv1d.bias"] = torch.zeros_like(fresh[f"{x}_conv1d.bias"])
    out["in_proj_z.weight"] = torch.zeros_like(fresh["in_proj_z.weight"])  # silent start
    return {k: v.to(fresh[k].dtype) for k, v in out.items()}
