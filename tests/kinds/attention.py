"""Grouped-query attention (and its post-norm variant): a dropped query head writes nothing through o_proj;
an all-heads q norm (qk_norm_full) averages over the kept heads' channels only."""
from tests.kinds import dropped, kept_mean_rmsnorm

AXES = {"attn_heads"}


def outputs(m):
    return [m.o_proj]


def _mask_full_q_norm(cfg, m, heads):
    """An all-heads q norm of a pruned model sees only the kept heads: the dropped heads' query rows are
    zeroed and the norm divides by the kept channels."""
    hd = cfg.attention.head_dim
    for h in dropped(heads, cfg.attention.num_attention_heads):
        m.q_proj.weight[h * hd:(h + 1) * hd] = 0
        if m.q_proj.bias is not None:
            m.q_proj.bias[h * hd:(h + 1) * hd] = 0
    kept_mean_rmsnorm(m.q_norm, len(heads) * hd)


def mask(cfg, m, keep, p):
    if p + "attn_heads" not in keep:
        return
    hd = cfg.attention.head_dim
    for h in dropped(keep[p + "attn_heads"], cfg.attention.num_attention_heads):
        m.o_proj.weight[:, h * hd:(h + 1) * hd] = 0
    if cfg.attention.qk_norm_full:
        _mask_full_q_norm(cfg, m, keep[p + "attn_heads"])
