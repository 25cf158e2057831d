"""--mixer kda (issue 57): the replaced attention layers become Kimi Delta Attention layers (models.kda), initialised
from their attention, in the `kimi_linear` family.

Shape as --mixer gdn (upcycle.hybrid_gdn): one KDA head per query head, head_dim the attention's (KDA has one head
count for q, k and v): q <- that head's Q rows (times the source's q-norm scale, where it has one), k and v <- its
KV head's K and V rows (repeat_kv's order), o_proj <- O. The short convs are the identity (the newest tap 1), so
before silu and KDA's L2 norm of q and k the layer reads attention's q, k, v. Projection biases of the source
(qwen2) have no place in KDA and are dropped.

No silent start: KDA's output gate is sigmoid(g_b_proj(g_a_proj(x))) on an RMSNorm of each head, never 0; the
norm's weight (head_dim channels shared by every head) could silence the layer, but then it alone gets a gradient
at first and the layer opens slowly. Measured on test_hybridize_quality.py's trained Llama (every layer KDA, 40
distillation steps; its docstring has the numbers): with the norm's weight zero the hybrid started at the source
without attention (6.24) and ended 0.002 - 0.006 below --init random; with transformers' weight (ones) it starts
at 5.67 - 5.77 (the attention-read layers already help) and ends 0.031 - 0.050 below. The gate's low-rank
projections (zero g_b rows, a constant gate of 1/2, ended level: 5.5006 vs 5.5000 on seed 0), the forget gate's
(f_a_proj, f_b_proj), A_log, dt_bias, b_proj and the norm as transformers initialises them
(models.kda.KdaKind.init_param).
"""
from __future__ import annotations

from .hybrid_gdn import identity_conv, qkv_per_query_head


def kda_sizes(a) -> dict:
    """KDA fields from the source's attention section: a head per query head, the attention's head width."""
    return {"kda.kda_num_heads": a.num_attention_heads, "kda.kda_head_dim": a.head_dim}


def kda_from_attention(cfg, att: dict, fresh: dict) -> dict:
    """One KDA layer's tensors from one attention layer's `att` (module docstring); the gates, A_log, dt_bias,
    b_proj and the output norm as `fresh` (transformers' init) holds them."""
    out = dict(fresh)
    out["q_proj.weight"], out["k_proj.weight"], out["v_proj.weight"] = qkv_per_query_head(cfg, att)
    out["o_proj.weight"] = att["o_proj.weight"].clone()
    for x in "qkv":
        out[f"{x}_conv1d.weight"] = identity_conv(fresh[f"{x}_conv1d.weight"])
    return {k: v.to(fresh[k].dtype) for k, v in out.items()}
