"""Mamba-2 mixer: in_proj -> causal depthwise conv + silu -> SSD scan -> gated group RMSNorm -> out_proj.

Numerics follow transformers' `nemotron_h`: dt = clamp(softplus(dt + dt_bias), time_step_min,
time_step_max), A = -exp(A_log), and the gate multiplies before the group norm. The in_proj output
and the conv channels are concatenations of segments whose order models.layout states once; every
slice here comes from there, under the mixer's current cfg (tensor parallelism gives it one rank's
heads and groups).

This file is the readable form; models.mamba_kernels computes it fast. On CPU the mixer runs the
fused cache-blocked kernel; on CUDA the same steps as whole-tensor ops, with mamba-ssm's fused scan
when installed. `ssd_reference` is the recurrence itself, which the tests hold the scans to.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layout import axis_size
from .mamba_kernels import compute_dtype, gated_rms_norm, layout_spans, mamba_core, mamba_ssm_scan, ssd_scan
from .recompute import maybe_checkpoint

USE_KERNEL = True  # False: the pure-PyTorch scan on CUDA even with mamba-ssm installed (benchmarks, parity)


def _on_gpu(t) -> bool:
    """Which path runs: whole-tensor ops (+ mamba-ssm's scan) on CUDA, the fused blocked kernel elsewhere."""
    return t.is_cuda


def _mamba_kernel():
    """mamba-ssm's fused SSD scan when USE_KERNEL is set and the extra is installed, else None."""
    return mamba_ssm_scan() if USE_KERNEL else None


def ssd_reference(x, dt, A, B, C, D=None):
    """The SSD scan by its definition, step by step: s_t = exp(dt_t A) s_{t-1} + dt_t x_t B_t^T,
    y_t = s_t C_t (+ D x_t). x [b, l, h, p], dt [b, l, h], A [h], B, C [b, l, g, n] (each group
    shared by h/g heads), D [h] or None -> y [b, l, h, p]."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    Bh = B.repeat_interleave(h // g, dim=2)
    Ch = C.repeat_interleave(h // g, dim=2)
    s = x.new_zeros(b, h, p, n)
    ys = []
    for t in range(l):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        s = decay * s + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        y = (s * Ch[:, t, :, None, :]).sum(-1)
        if D is not None:
            y = y + D[:, None] * x[:, t]
        ys.append(y)
    return torch.stack(ys, dim=1)


def causal_conv_silu(x, conv: nn.Conv1d):
    """silu(causal depthwise conv(x)) on x [b, l, C], as one F.conv1d call (cuDNN on a GPU)."""
    w = conv.weight
    y = F.conv1d(x.transpose(1, 2), w, conv.bias, padding=w.shape[-1] - 1, groups=w.shape[0])
    return F.silu(y[..., :x.shape[1]].transpose(1, 2))


def init_a_log(p: torch.Tensor) -> torch.Tensor:
    """A_log's initial value in place: log(1..h), i.e. A = -1..-h (transformers' nemotron_h init)."""
    return p.copy_(torch.log(torch.arange(1, p.numel() + 1, dtype=torch.float32, device=p.device)))


class GatedRMSNorm(nn.Module):
    """y * silu(z), then RMS-normalised within each of `groups` groups, times weight."""

    def __init__(self, size: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups, self.eps = groups, eps

    def forward(self, y, z):
        return gated_rms_norm(y, z, self.weight, self.groups, self.eps)


class Mamba2Mixer(nn.Module):
    """The Mamba-2 mixer of a hybrid layer: u [b, l, hidden] -> [b, l, hidden]. attention_mask [b, l]
    (0: padding) zeroes the input and the conv output of padded steps."""
    recompute_core = False  # models.recompute "selective": conv + scan + gated norm recomputed in backward

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        conv = axis_size(cfg, "mamba_conv")
        self.in_proj = nn.Linear(cfg.hidden_size, axis_size(cfg, "mamba_in_proj"), bias=cfg.mamba_proj_bias)
        self.conv1d = nn.Conv1d(conv, conv, cfg.conv_kernel, groups=conv, bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(cfg.mamba_num_heads))
        self.A_log = nn.Parameter(torch.empty(cfg.mamba_num_heads))
        if not self.A_log.is_meta:  # arange on the meta device imports torch._dynamo (slow)
            with torch.no_grad():
                init_a_log(self.A_log)
        self.D = nn.Parameter(torch.ones(cfg.mamba_num_heads))
        self.norm = GatedRMSNorm(cfg.mamba_inner, cfg.n_groups, cfg.norm_eps)
        self.out_proj = nn.Linear(cfg.mamba_inner, cfg.hidden_size, bias=cfg.mamba_proj_bias)

    def forward(self, u, attention_mask=None):
        b, l, _ = u.shape
        if attention_mask is not None:
            u = u * attention_mask[:, :, None].to(u.dtype)
        proj = self.in_proj(u)
        if b == 0 or l == 0:  # nothing to scan (the blocked kernels cannot view an empty tensor)
            return self.out_proj(proj.new_zeros(b, l, self.cfg.mamba_inner))
        A = -torch.exp(self.A_log.float())
        core = self._core if _on_gpu(u) else self._fused_core
        return self.out_proj(maybe_checkpoint(self, core, proj, A, attention_mask).to(u.dtype))

    def _spans(self):
        """models.layout's column slices under the current cfg (`layout_spans`), recomputed when the cfg
        object changes (tensor parallelism swaps in one rank's)."""
        if self.__dict__.get("_spans_cfg") is not self.cfg:
            self._spans_cfg, self._spans_val = self.cfg, layout_spans(self.cfg)
        return self._spans_val

    def _fused_core(self, proj, A, attention_mask):
        """CPU: conv + dt + scan as one cache-blocked kernel, then the gated norm (in_proj output ->
        out_proj input)."""
        mask = attention_mask.to(compute_dtype(proj)) if attention_mask is not None else None
        y, z = mamba_core(proj, self.conv1d.weight, self.conv1d.bias, self.dt_bias, A, self.D, mask, self.cfg,
                          self._spans())
        return self.norm(y, z)

    def _core(self, proj, A, attention_mask):
        """CUDA: conv, dt, scan and gated norm as whole-tensor ops (in_proj output -> out_proj input)."""
        cfg, sp = self.cfg, self._spans()
        conv_out = causal_conv_silu(proj[..., sp.conv], self.conv1d)
        if attention_mask is not None:
            conv_out = conv_out * attention_mask[:, :, None].to(conv_out.dtype)
        x = conv_out[..., sp.x].unflatten(-1, (cfg.mamba_num_heads, cfg.mamba_head_dim))
        B, C = (conv_out[..., s].unflatten(-1, (cfg.n_groups, cfg.ssm_state_size)) for s in (sp.B, sp.C))
        dt, kernel = proj[..., sp.dt], _mamba_kernel()
        if kernel is not None:
            y = kernel(x, dt, A, B, C, cfg.chunk_size, D=self.D.float(), dt_bias=self.dt_bias.float(),
                       dt_softplus=True, dt_limit=(cfg.time_step_min, cfg.time_step_max))
        else:
            cd = compute_dtype(dt)
            dt = F.softplus(dt.to(cd) + self.dt_bias.to(cd)).clamp(cfg.time_step_min, cfg.time_step_max)
            y = ssd_scan(x, dt, A, B, C, cfg.chunk_size, D=self.D)
        return self.norm(y.flatten(2), proj[..., sp.z])
