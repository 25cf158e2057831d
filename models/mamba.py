"""Mamba-2 mixer: in_proj -> causal depthwise conv -> chunked SSD scan -> gated group RMSNorm -> out_proj.

Numerics follow transformers' `nemotron_h` (dt = clamp(softplus(dt + dt_bias), time_step_min, max),
A = -exp(A_log), gate before the group norm). The scan is the SSD chunked form written for CPU
efficiency: B.C products are computed once per *group* (not per repeated head), chunk states are
batched matmuls, and the inter-chunk recurrence is a short loop, so memory is linear in length.
On CUDA with mamba-ssm installed, its fused kernel replaces the scan.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def ssd_scan(x, dt, A, B, C, chunk_size: int, D=None, initial_state=None, return_state=False):
    """Chunked selective-state-space scan.

    x [b, l, h, p], dt [b, l, h] (already softplus'ed and clamped), A [h] (negative),
    B, C [b, l, g, n], D [h] or None. Returns y [b, l, h, p] (and the final state [b, h, p, n]).
    Computed in float32 (float64 inputs stay float64).
    """
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r = h // g
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    x, dt, A, B, C = (t.to(dtype) for t in (x, dt, A, B, C))
    Q = min(chunk_size, l) if l > 0 else chunk_size
    pad = (-l) % Q
    if pad:
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    c = (l + pad) // Q
    xdt = (x * dt[..., None]).view(b, c, Q, g, r, p)
    dA = (dt * A).view(b, c, Q, h)
    Acum = torch.cumsum(dA, dim=2)  # [b, c, Q, h]
    Bc, Cc = B.view(b, c, Q, g, n), C.view(b, c, Q, g, n)

    # intra-chunk (diagonal blocks): y_i = sum_{j<=i} C_i.B_j exp(Acum_i - Acum_j) xdt_j
    Ah = Acum.permute(0, 1, 3, 2)  # [b, c, h, Q]
    seg = Ah[..., :, None] - Ah[..., None, :]  # [b, c, h, Q, Q]
    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    Lmat = torch.exp(seg.masked_fill(~causal, float("-inf"))).view(b, c, g, r, Q, Q)
    CB = torch.matmul(Cc.permute(0, 1, 3, 2, 4), Bc.permute(0, 1, 3, 4, 2))  # [b, c, g, Q, Q]
    M = CB[:, :, :, None] * Lmat  # [b, c, g, r, Q, Q]
    xg = xdt.permute(0, 1, 3, 4, 2, 5)  # [b, c, g, r, Q, p]
    y = torch.matmul(M, xg)  # [b, c, g, r, Q, p]

    # state contributed by each chunk: sum_j exp(Acum_last - Acum_j) xdt_j (x) B_j
    decay = torch.exp(Acum[:, :, -1:, :] - Acum).view(b, c, Q, g, r)
    xw = (xdt * decay[..., None]).permute(0, 1, 3, 4, 5, 2).reshape(b, c, g, r * p, Q)
    states = torch.matmul(xw, Bc.permute(0, 1, 3, 2, 4))  # [b, c, g, r*p, n]

    # inter-chunk recurrence over c chunks (linear in length)
    chunk_decay = torch.exp(Acum[:, :, -1, :]).view(b, c, g, r, 1, 1)
    s = (initial_state.to(dtype).view(b, g, r, p, n) if initial_state is not None
         else x.new_zeros(b, g, r, p, n))
    prev = []
    for k in range(c):
        prev.append(s)
        s = chunk_decay[:, k] * s + states[:, k].view(b, g, r, p, n)
    prev = torch.stack(prev, dim=1)  # [b, c, g, r, p, n] state entering each chunk

    # off-diagonal: y_i += exp(Acum_i) C_i . state_in
    Cq = Cc.permute(0, 1, 3, 2, 4)  # [b, c, g, Q, n]
    y_off = torch.matmul(Cq, prev.reshape(b, c, g, r * p, n).transpose(-1, -2))  # [b, c, g, Q, r*p]
    y_off = y_off.view(b, c, g, Q, r, p).permute(0, 1, 2, 4, 3, 5)
    y = y + y_off * torch.exp(Ah).view(b, c, g, r, Q, 1)
    y = y.permute(0, 1, 4, 2, 3, 5).reshape(b, c * Q, h, p)[:, :l]
    if D is not None:
        y = y + x[:, :l] * D.to(dtype)[:, None]
    if return_state:
        return y, s.view(b, h, p, n)
    return y


def ssd_reference(x, dt, A, B, C, D=None):
    """Naive sequential recurrence (the definition), for tests: h_t = exp(dt A) h_{t-1} + dt x_t B_t."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    Bh = B.repeat_interleave(h // g, dim=2)
    Ch = C.repeat_interleave(h // g, dim=2)
    s = x.new_zeros(b, h, p, n)
    ys = []
    for t in range(l):
        s = torch.exp(dt[:, t] * A)[..., None, None] * s + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        y = (s * Ch[:, t, :, None, :]).sum(-1)
        if D is not None:
            y = y + D[:, None] * x[:, t]
        ys.append(y)
    return torch.stack(ys, dim=1)


def _mamba_kernel():
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        return mamba_chunk_scan_combined
    except Exception:  # optional GPU extra
        return None


class GatedRMSNorm(nn.Module):
    """y * silu(z), then RMS-normalised within each of `groups` groups, times weight."""

    def __init__(self, size: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups, self.eps = groups, eps

    def forward(self, y, z):
        dtype = y.dtype
        y = y.float() * F.silu(z.float())
        yg = y.view(*y.shape[:-1], self.groups, -1)
        yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * yg.view(y.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.in_proj = nn.Linear(cfg.hidden_size, cfg.mamba_in_proj_size, bias=cfg.mamba_proj_bias)
        self.conv1d = nn.Conv1d(cfg.mamba_conv_dim, cfg.mamba_conv_dim, cfg.conv_kernel,
                                groups=cfg.mamba_conv_dim, bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(cfg.mamba_num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, cfg.mamba_num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(cfg.mamba_num_heads))
        self.norm = GatedRMSNorm(cfg.mamba_inner, cfg.n_groups, cfg.norm_eps)
        self.out_proj = nn.Linear(cfg.mamba_inner, cfg.hidden_size, bias=cfg.mamba_proj_bias)

    def forward(self, u, attention_mask=None):
        cfg = self.cfg
        b, l, _ = u.shape
        Im, GN, nh = cfg.mamba_inner, cfg.n_groups * cfg.ssm_state_size, cfg.mamba_num_heads
        if attention_mask is not None:
            u = u * attention_mask[:, :, None].to(u.dtype)
        zxbcdt = self.in_proj(u)
        z, xBC, dt = zxbcdt.split([Im, Im + 2 * GN, nh], dim=-1)
        K = cfg.conv_kernel
        xBC = F.conv1d(xBC.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, padding=K - 1, groups=xBC.shape[-1])
        xBC = F.silu(xBC[..., :l].transpose(1, 2))
        if attention_mask is not None:
            xBC = xBC * attention_mask[:, :, None].to(xBC.dtype)
        x, B, C = xBC.split([Im, GN, GN], dim=-1)
        A = -torch.exp(self.A_log.float())
        x = x.reshape(b, l, nh, cfg.mamba_head_dim)
        B = B.reshape(b, l, cfg.n_groups, cfg.ssm_state_size)
        C = C.reshape(b, l, cfg.n_groups, cfg.ssm_state_size)
        kernel = _mamba_kernel() if u.is_cuda else None
        if kernel is not None:
            y = kernel(x, dt, A, B, C, cfg.chunk_size, D=self.D.float(), dt_bias=self.dt_bias.float(),
                       dt_softplus=True, dt_limit=(cfg.time_step_min, cfg.time_step_max))
        else:
            dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(cfg.time_step_min, cfg.time_step_max)
            y = ssd_scan(x, dt, A, B, C, cfg.chunk_size, D=self.D)
        y = self.norm(y.reshape(b, l, Im), z)
        return self.out_proj(y.to(u.dtype))
