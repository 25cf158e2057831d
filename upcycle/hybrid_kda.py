"""--mixer kda (issue 57): the replaced attention layers become Kimi Delta Attention layers (models.kda), initialised
from their attention, in the `kimi_linear` family.

Shape as --mixer gdn (upcycle.hybrid_gdn): one KDA head per query head, head_dim the attention's (KDA has one head
count for q, k and v): q <- that head's Q rows (times the source's q-norm scale, where it has one), k and v <- its
KV head's K and V rows (repeat_kv's order), o_proj <- O. The short convs are the identity (the newest tap 1), so
before silu and KDA's L2 norm of q and k the layer reads attention's q, k, v. Projection biases of the source
(qwen2) have no place in KDA and are dropped.

Silent start: KDA's output gate is sigmoid(g_b_proj(g_a_proj(x))) on an RMSNorm of each head (no bias), which is
never 0: the gate alone cannot silence the layer (zero g_b rows give 1/2). The norm's weight (head_dim channels
shared by every head) can: it is set to zero, so the layer's output is exactly 0 (the hybrid starts as the source
without those layers, as the Mamba-2 and GDN inits do) and its gradient, RMSNorm(o) * sigmoid(gate), opens it.
The gate's low-rank projections, the forget gate's (f_a_proj, f_b_proj), A_log, dt_bias and b_proj as transformers
initialises them (models.kda.KdaKind.init_param).
"""
from __future__ import annotations

import torch

from .hybrid_gdn import identity_conv, qkv_per_query_head


def kda_sizes(a) -> dict:
    """KDA fields from the source's attention section: a head per query head, the attention's head width."""
    return {"kda.kda_num_heads": a.num_attention_heads, "kda.kda_head_dim": a.head_dim}


def kda_from_attention(cfg, att: dict, fresh: dict) -> dict:
    """One KDA layer's tensors from one attention layer's `att` (module docstring); the gates, A_log, dt_bias and
    b_proj as `fresh` (transformers' init) holds them, the output norm's weight zero (silent start)."""
    out = dict(fresh)
    out["q_proj.weight"], out["k_proj.weight"], out["v_proj.weight"] = qkv_per_query_head(cfg, att)
    out["o_proj.weight"] = att["o_proj.weight"].clone()
    for x in "qkv":
        out[f"{x}_conv1d.weight"] = identity_conv(fresh[f"{x}_conv1d.weight"])
    out["o_norm.weight"] = torch.zeros_like(fresh["o_norm.weight"])  # silent start: sigmoid never reaches 0
    return {k: v.to(fresh[k].dtype) for k, v in out.items()}
