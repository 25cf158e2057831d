"""Mamba-2: a dropped head (or head channel) writes nothing through out_proj, and the gated group RMSNorm
averages over the kept channels of each group."""
import torch
import torch.nn.functional as F

from remodel.models.mamba import Gate, RMSNormThenGate

AXES = {"mamba_heads", "mamba_head_dim"}


def outputs(m):
    return [m.out_proj]


def _masked_group_norm(gn, mask):
    """Mamba's gated group RMSNorm averages y*silu(z) (or y, norm before gate) over each group's channels.
    Zeroing the dropped heads' out_proj columns hides their output but not their share of that average, so
    the reference zeroes them *before* the norm and averages over the kept channels of each group (every
    group keeps the same number, as group-aware pruning guarantees) -- exactly what the sliced norm computes.
    Without a norm (Falcon-H1's Gate) the zeroed out_proj columns are all there is to it."""
    if isinstance(gn, Gate):
        return
    G, before = gn.groups, isinstance(gn, RMSNormThenGate)
    kept_per_group = mask.view(G, -1).sum(-1)

    def forward(y, z):
        y = (y.float() if before else y.float() * F.silu(z.float())) * mask
        yg = y.view(*y.shape[:-1], G, -1)
        yg = yg * torch.rsqrt(yg.pow(2).sum(-1, keepdim=True) / kept_per_group[:, None] + gn.eps)
        out = gn.weight * yg.view(y.shape)
        return out * F.silu(z.float()) if before else out
    gn.forward = forward


def mask(cfg, m, keep, p):
    if p + "mamba_heads" not in keep and p + "mamba_head_dim" not in keep:
        return
    nh, hd = cfg.mamba.mamba_num_heads, cfg.mamba.mamba_head_dim
    kept = torch.zeros(nh, hd)
    heads = keep.get(p + "mamba_heads", torch.arange(nh))
    chans = keep.get(p + "mamba_head_dim", torch.arange(hd))
    kept[heads[:, None], chans[None, :]] = 1
    kept = kept.reshape(-1)
    m.out_proj.weight[:, kept == 0] = 0
    _masked_group_norm(m.norm, kept)
