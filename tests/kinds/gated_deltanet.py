"""Gated DeltaNet: dropped value heads (a dropped key head's group among them) and value channels write
nothing through out_proj; dropped value channels and key channels are zero inputs of the rule (zero rows of
q / k / v projections: the state never holds them, the L2 norms do not see them). The per-head gated norm then
averages over the kept value channels, and q's scale dk**-0.5 becomes dk'**-0.5: the rule's output is
linear in q, so the norm's input is scaled by sqrt(dk / dk') -- what the sliced model computes."""
import torch
import torch.nn.functional as F

from tests.kinds import dropped

AXES = {"lin_k_heads", "lin_v_heads", "lin_dk", "lin_dv"}
FP64 = True  # its per-head gated norm rescales the rule's small outputs: compared in float64


def outputs(m):
    return [m.out_proj]


def _kept_value_heads(cfg, keep, p):
    """The kept value heads: those `keep` names, less every value head of a dropped key head's group."""
    hk, hv = cfg.gated_deltanet.linear_num_key_heads, cfg.gated_deltanet.linear_num_value_heads
    heads = keep.get(p + "lin_v_heads", torch.arange(hv))
    groups = keep.get(p + "lin_k_heads", torch.arange(hk))
    return heads[torch.isin(heads // (hv // hk), groups)]


def mask(cfg, m, keep, p):
    if not any(p + a in keep for a in AXES):
        return
    g = cfg.gated_deltanet
    hk, hv, dk, dv = g.linear_num_key_heads, g.linear_num_value_heads, g.linear_key_head_dim, g.linear_value_head_dim
    heads = _kept_value_heads(cfg, keep, p)
    vch, kch = keep.get(p + "lin_dv", torch.arange(dv)), keep.get(p + "lin_dk", torch.arange(dk))
    kept = torch.zeros(hv, dv)
    kept[heads[:, None], vch[None, :]] = 1
    m.out_proj.weight[:, kept.reshape(-1) == 0] = 0
    for h in range(hv):
        m.in_proj_v.weight[h * dv + dropped(vch, dv)] = 0
    for h in range(hk):
        m.in_proj_q.weight[h * dk + dropped(kch, dk)] = 0
        m.in_proj_k.weight[h * dk + dropped(kch, dk)] = 0
    norm, n, c = m.norm, len(vch), (dk / len(kch)) ** 0.5

    def forward(x, gate):
        cd = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(cd) * c
        xf = xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) / n + norm.eps)
        return (norm.weight * xf.to(x.dtype) * F.silu(gate.to(cd))).to(x.dtype)
    norm.forward = forward
