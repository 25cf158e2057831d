"""KDA: a dropped head writes nothing through o_proj (its o_proj columns zero). Every other part of a head is its
own (its q, k, v rows and convs, its decay and beta, its gated norm over its own channels), so the kept heads
compute what the sliced model computes. A dropped head channel: its q, k, v zeroed at their projections (the
depthwise conv keeps a zero channel zero; the L2 norms of q and k are then over the kept channels; k's zero channel
leaves its state row zero, v's its state column), so its output is zero; the pruned rule scales q by N**-0.5 for
N kept channels, not d**-0.5 (the output is linear in q: times sqrt(d / N)), and the gated norm averages over the
N kept channels. A dropped rank component of a gate: f_a / g_a's output zeroed there."""
import torch

from tests.kinds import dropped

AXES = {"kda_heads", "kda_dim", "kda_f_rank", "kda_g_rank"}
FP64 = True  # the per-head gated norm rescales the rule's small outputs: compared in float64


def outputs(m):
    return [m.o_proj]


def _zero_out(module, m):
    module.register_forward_hook(lambda mod, a, out: out * m.to(out.dtype))


def _kept_channel_norm(norm, d, n):
    """The gated norm of the rule's output times sqrt(d / n) (the pruned q scale), its mean over the n kept."""
    def forward(x, gate):
        cd = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(cd) * (d / n) ** 0.5
        xf = xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) / n + norm.eps)
        return (norm.weight.to(cd) * xf * torch.sigmoid(gate.to(cd))).to(x.dtype)
    norm.forward = forward


def mask(cfg, m, keep, p):
    h, d = cfg.kda.kda_num_heads, cfg.kda.kda_head_dim
    kept = torch.zeros(h, d)
    kept[keep.get(p + "kda_heads", torch.arange(h))] = 1
    if p + "kda_dim" in keep:
        ch = torch.ones(h, d)
        ch[:, dropped(keep[p + "kda_dim"], d)] = 0
        kept = kept * ch
        for proj in (m.q_proj, m.k_proj, m.v_proj):
            _zero_out(proj, ch.reshape(-1))
        _kept_channel_norm(m.o_norm, d, len(keep[p + "kda_dim"]))
    for x, proj in (("f", m.f_a_proj), ("g", m.g_a_proj)):
        if p + f"kda_{x}_rank" in keep:
            r = torch.ones(d)
            r[dropped(keep[p + f"kda_{x}_rank"], d)] = 0
            _zero_out(proj, r)
    m.o_proj.weight[:, kept.reshape(-1) == 0] = 0
