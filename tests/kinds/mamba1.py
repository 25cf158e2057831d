"""Mamba-1: a dropped inner channel adds nothing to dt / B / C (x_proj's column) and writes nothing
through out_proj; a dropped state channel (`--mamba1-d-state`, axis m1_state) reads B = C = 0, so the scan's state
there stays zero and adds nothing to y (A_log's column no longer matters); Jamba's B / C RMSNorms take their RMS over
the kept channels, as the pruned model's do."""
import torch

from tests.kinds import dropped

AXES = {"m1_inner", "m1_state"}


def outputs(m):
    return [m.out_proj]


def mask(cfg, m, keep, p):
    if p + "m1_inner" in keep:
        gone = dropped(keep[p + "m1_inner"], m.out_proj.weight.shape[1])
        m.x_proj.weight[:, gone], m.out_proj.weight[:, gone] = 0, 0
    if p + "m1_state" in keep:
        mask_state_channels(cfg, m, keep[p + "m1_state"])


def _kept_rmsnorm(norm, kept):
    """The B (C) RMSNorm as the pruned model's: RMS over the kept state channels, the dropped ones zero."""
    mask = torch.zeros_like(norm.weight)
    mask[kept] = 1

    def forward(x):
        h = x.float() * mask
        h = h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) / len(kept) + norm.eps)
        return norm.weight * h.to(x.dtype)
    norm.forward = forward


@torch.no_grad()
def mask_state_channels(cfg, mixer, kept) -> None:
    """In place on one Mamba-1 mixer: the state channels not in `kept` read zero B and C."""
    s = cfg.mamba1
    if s.dt_bc_norm:
        _kept_rmsnorm(mixer.b_layernorm, kept)
        _kept_rmsnorm(mixer.c_layernorm, kept)
    else:
        gone = dropped(kept, s.d_state)
        mixer.x_proj.weight[s.dt_rank + gone] = 0
        mixer.x_proj.weight[s.dt_rank + s.d_state + gone] = 0
