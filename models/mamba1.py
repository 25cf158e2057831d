"""The Mamba-1 (selective scan) layer kind ('S'): Jamba's `JambaMambaMixer`; its config section, module and spec
(MAMBA1).

in_proj (hidden -> 2 x inner, segments x | z) -> x: causal depthwise conv + silu -> x_proj (inner -> dt_rank + 2 x
d_state: dt | B | C) -> [the variant: RMSNorms on dt, B and C, Jamba's] -> dt_proj (dt_rank -> inner, with bias) ->
softplus -> selective scan s_t = exp(dt_t A) s_{t-1} + dt_t x_t B_t, y_t = s_t C_t + D x_t with A = -exp(A_log)
[inner, d_state] -> y * silu(z) -> out_proj. Padded positions' inputs and conv outputs are zeroed (transformers'
apply_mask_to_padding_states). The inner channel count is expand x hidden_size (Jamba's mamba_expand): hidden
pruning keeps as many channels per kept hidden unit, chosen by this kind's own score (out_proj's input;
LayerKind.hidden_units). The state size is a width of its own (--mamba1-d-state): x_proj's B and C rows, A_log's
columns and the B / C norms are sliced together, state channels ranked by |B| x |C| as the scan reads them.
The scan is pure PyTorch, except on CUDA where mamba-ssm imports: its fused `selective_scan_fn` (same inputs, in
fp32 as the PyTorch scan computes; tests/test_mamba1_kernel.py holds its call to the PyTorch scan).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from dataclasses import dataclass
from torch import nn

from .mamba import optional_import
from .section import MAX_SMALL, Section, ints, plain, reals
from .spec import LayerKind, Param, Site, Width, sq, top


@dataclass(frozen=True)
class Mamba1Config(Section):
    """The Mamba-1 kind's fields: its SSM state size, conv kernel, dt rank, inner channels per hidden unit
    (Jamba's mamba_expand), conv / projection biases, and Jamba's RMSNorms on dt, B and C (a variant) with their
    eps."""
    d_state: int = ints(16, 1, MAX_SMALL, raw={"mamba_d_state": 1})
    d_conv: int = ints(4, 1, 1024, raw={"mamba_d_conv": 1})
    dt_rank: int = ints(1, 1, MAX_SMALL)
    expand: int = ints(2, 1, 64, raw={"mamba_expand": 1})
    conv_bias: bool = plain(True, "the depthwise conv's bias")
    proj_bias: bool = plain(False, "in_proj's and out_proj's biases")
    dt_bc_norm: bool = plain(True, "RMSNorms on dt, B and C after x_proj (Jamba)")
    dt_bc_norm_eps: float = reals(1e-6, gt=0)


def rms(x, weight, eps):
    """RMSNorm in fp32, times weight, back in x's dtype (transformers' JambaRMSNorm)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return rms(x, self.weight, self.eps)


USE_KERNEL = True  # False: the PyTorch scan on CUDA too (benchmarks, parity tests)
SCAN_KERNEL = ("mamba_ssm.ops.selective_scan_interface", "selective_scan_fn")


@functools.lru_cache(maxsize=None)
def scan_kernel():
    """mamba-ssm's fused CUDA selective scan, or None where it does not import (imported on first CUDA use)."""
    return optional_import(*SCAN_KERNEL)


def on_gpu(t) -> bool:
    """Whether the fused kernel may run on t (CUDA; float64 is the PyTorch scan's alone)."""
    return t.is_cuda and t.dtype != torch.float64


def kernel_scan(kernel, x, dt, A, B, C, D):
    """The scan through mamba-ssm's selective_scan_fn, in its layout: u, delta [b, c, l], A [c, n], B, C [b, n, l]
    (one group), D [c], all fp32 (dt already softplus'd: no delta_bias, delta_softplus False) -> y [b, l, c] fp32."""
    f = lambda t: t.float().transpose(1, 2)  # noqa: E731
    return kernel(f(x), f(dt), A.float(), f(B), f(C), D.float(), delta_softplus=False).transpose(1, 2)


def selective_scan(x, dt, A, B, C, D):
    """x, dt [b, l, c], A [c, n], B, C [b, l, n], D [c] -> y [b, l, c], step by step in fp32 (float64 stays); on
    CUDA through mamba-ssm's kernel when it imports (USE_KERNEL)."""
    kernel = scan_kernel() if USE_KERNEL and on_gpu(x) else None
    if kernel is not None:
        return kernel_scan(kernel, x, dt, A, B, C, D)
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    x, dt, B, C = x.to(cd), dt.to(cd), B.to(cd), C.to(cd)
    s = x.new_zeros(x.shape[0], x.shape[2], A.shape[1])
    ys = []
    for t in range(x.shape[1]):
        s = torch.exp(dt[:, t, :, None] * A) * s + (dt[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        ys.append((s * C[:, t, None, :]).sum(-1))
    y = torch.stack(ys, dim=1) if ys else x
    return y + x * D.to(cd)


class SelectiveScan(nn.Module):
    """The scan as a submodule whose first input is B | C (the dt / B / C projection is replicated over
    tensor-parallel ranks, each rank's channels read all of it): its tp_plan entry makes that input enter the
    parallel region (identity forward, gradient summed over ranks in backward)."""

    def forward(self, bc, x, dt, A, D):
        B, C = bc.chunk(2, dim=-1)
        return selective_scan(x, dt, A, B, C, D)


class Mamba1Mixer(nn.Module):
    """u [b, l, hidden] -> [b, l, hidden]; attention_mask [b, l] (0: padding). The inner channel count comes from
    the weights (a tensor-parallel rank holds a slice)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        s, H, n = cfg.mamba1, cfg.hidden_size, MAMBA1.axis_size(cfg, "m1_inner")
        self.in_proj = nn.Linear(H, 2 * n, bias=s.proj_bias)
        self.conv1d = nn.Conv1d(n, n, s.d_conv, groups=n, bias=s.conv_bias)
        self.x_proj = nn.Linear(n, s.dt_rank + 2 * s.d_state, bias=False)
        self.dt_proj = nn.Linear(s.dt_rank, n, bias=True)
        self.A_log = nn.Parameter(torch.empty(n, s.d_state))
        if not self.A_log.is_meta:
            with torch.no_grad():
                init_a_log(self.A_log)
        self.D = nn.Parameter(torch.ones(n))
        self.out_proj = nn.Linear(n, H, bias=s.proj_bias)
        self.ssm = SelectiveScan()
        if s.dt_bc_norm:
            self.dt_layernorm = RMSNorm(s.dt_rank, s.dt_bc_norm_eps)
            self.b_layernorm = RMSNorm(s.d_state, s.dt_bc_norm_eps)
            self.c_layernorm = RMSNorm(s.d_state, s.dt_bc_norm_eps)

    def forward(self, u, attention_mask=None):
        s = self.cfg.mamba1
        mask = attention_mask[:, :, None].to(u.dtype) if attention_mask is not None else None
        if mask is not None:
            u = u * mask
        x, z = self.in_proj(u).chunk(2, dim=-1)
        k = self.conv1d.weight.shape[-1]
        x = F.conv1d(F.pad(x.transpose(1, 2), (k - 1, 0)), self.conv1d.weight, self.conv1d.bias,
                     groups=self.conv1d.weight.shape[0])
        x = F.silu(x).transpose(1, 2)
        if mask is not None:
            x = x * mask
        dt, B, C = self.x_proj(x).split([s.dt_rank, s.d_state, s.d_state], dim=-1)
        if s.dt_bc_norm:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        dt = F.softplus(self.dt_proj(dt).float())
        y = self.ssm(torch.cat([B, C], dim=-1), x, dt, -torch.exp(self.A_log.float()), self.D) * F.silu(z.float())
        return self.out_proj(y.to(u.dtype))


def init_a_log(p: torch.Tensor) -> torch.Tensor:
    """A_log's initial value in place: log(1..d_state) on every channel (transformers' Jamba init)."""
    a = torch.arange(1, p.shape[1] + 1, dtype=torch.float32, device=p.device)
    return p.copy_(torch.log(a)[None, :].expand_as(p))


class Mamba1Kind(LayerKind):
    def build(self, cfg):
        return Mamba1Mixer(cfg)

    def init_param(self, cfg, local, p, g, std):
        """As transformers' Jamba _init_weights: A = -1..-d_state per channel, D one, the conv normal(std)."""
        if local == "A_log":
            init_a_log(p)
        elif local == "D":
            p.fill_(1.0)
        elif local == "conv1d.weight":
            p.normal_(0.0, std, generator=g)
        else:
            return False
        return True

    def summary(self, cfg):
        s = cfg.mamba1
        return {"d_state": s.d_state, "d_conv": s.d_conv, "dt_rank": s.dt_rank, "expand": s.expand,
                "mamba1_inner": self.axis_size(cfg, "m1_inner")}

    state_row = "Mamba-1 state (conv + fp32 SSM)"

    def cache_bytes(self, cfg, w, batch, seq_len, kv_bytes=2, state_bytes=4, conv_bytes=2):
        """The conv state (d_conv columns per inner channel) and the SSM state (d_state per channel), at widths w."""
        n, s = self.axis_size(cfg, "m1_inner", w), cfg.mamba1
        return {"mamba1_conv_state": batch * n * s.d_conv * conv_bytes,
                "mamba1_ssm_state": batch * n * w["mamba1_d_state"] * state_bytes}

    def mixing_flops(self, cfg, seq_len):
        """Per token: the depthwise conv, and the scan's decay, update and read-out per channel and state."""
        n, s = self.axis_size(cfg, "m1_inner"), cfg.mamba1
        return 2 * n * s.d_conv + 6 * n * s.d_state + 4 * n

    def sites(self, cfg):
        """out_proj's input per inner channel; B and C per state channel as the scan reads them (after Jamba's
        RMSNorms when it has them, else x_proj's B and C rows)."""
        if cfg.mamba1.dt_bc_norm:
            bc = (Site("m1_B", "b_layernorm", "output"), Site("m1_C", "c_layernorm", "output"))
        else:
            bc = tuple(Site("m1_" + n, "x_proj", "output", self.segment_span(cfg, "m1_x_proj", n)) for n in "BC")
        return (Site("m1_inner", "out_proj", "input", None, "out_proj.weight"),) + bc

    def keep(self, cfg, score, t, p):
        """Hidden pruning keeps expand channels per kept hidden unit, by out_proj's input; --mamba1-d-state keeps
        the state channels with the largest |B| x |C| (channel j adds s_j C_j to y, s_j driven by B_j)."""
        keep = {}
        if "hidden_size" in t:
            n = self.axis_size(cfg, "m1_inner")
            keep[p + "m1_inner"] = top(score(p + "m1_inner", (n,), "--hidden-size"), cfg.mamba1.expand * t["hidden_size"])
        if "mamba1_d_state" in t:
            n, why = cfg.mamba1.d_state, "--mamba1-d-state"
            keep[p + "m1_state"] = top(score(p + "m1_B", (n,), why) * score(p + "m1_C", (n,), why), t["mamba1_d_state"])
        return keep

    def magnitude(self, cfg, local, t):
        """in_proj x and z rows, the conv's channels, x_proj columns, dt_proj rows, A_log / D rows, out_proj columns;
        per state channel, the B (C) norm's weight where Jamba's norms set B's (C's) scale, else x_proj's B (C) row."""
        if local in ("in_proj.weight", "in_proj.bias"):
            return [("m1_inner", sum(sq(t, 0).chunk(2)))]
        if local in ("conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias", "A_log", "D"):
            return [("m1_inner", sq(t, 0))]
        if local == "x_proj.weight":
            rows = [] if cfg.mamba1.dt_bc_norm else [("m1_" + n, sq(t, 0)[self.segment_span(cfg, "m1_x_proj", n)])
                                                     for n in "BC"]
            return [("m1_inner", sq(t, 1))] + rows
        if local == "out_proj.weight":
            return [("m1_inner", sq(t, 1))]
        if local in ("b_layernorm.weight", "c_layernorm.weight"):
            return [("m1_" + local[0].upper(), t.square())]
        return []

    def check_tp(self, cfg, tp, need):
        n = self.axis_size(cfg, "m1_inner")
        need(n % tp == 0, f"tensor parallelism: the Mamba-1 {n} inner channels are not divisible by tp={tp}")


MAMBA1 = Mamba1Kind(
    "S", "mamba1",
    (Param("in_proj.weight", ("m1_in_proj", "hidden")), Param("in_proj.bias", ("m1_in_proj",), ("proj_bias",)),
     Param("conv1d.weight", ("m1_inner", "one", "m1_kernel")), Param("conv1d.bias", ("m1_inner",), ("conv_bias",)),
     Param("x_proj.weight", ("m1_x_proj", "m1_inner")),
     Param("dt_proj.weight", ("m1_inner", "m1_dt_rank")), Param("dt_proj.bias", ("m1_inner",)),
     Param("A_log", ("m1_inner", "m1_state")), Param("D", ("m1_inner",)),
     Param("out_proj.weight", ("hidden", "m1_inner")), Param("out_proj.bias", ("hidden",), ("proj_bias",)),
     Param("dt_layernorm.weight", ("m1_dt_rank",), ("dt_bc_norm",)),
     Param("b_layernorm.weight", ("m1_state",), ("dt_bc_norm",)),
     Param("c_layernorm.weight", ("m1_state",), ("dt_bc_norm",))),
    sizes={"m1_inner": lambda cfg, w: cfg.mamba1.expand * w["hidden_size"],
           "m1_kernel": lambda cfg, w: cfg.mamba1.d_conv, "m1_dt_rank": lambda cfg, w: cfg.mamba1.dt_rank,
           "m1_state": lambda cfg, w: w["mamba1_d_state"]},
    segments={"m1_in_proj": (("x", "m1_inner"), ("z", "m1_inner")),
              "m1_x_proj": (("dt", "m1_dt_rank"), ("B", "m1_state"), ("C", "m1_state"))},
    units={"m1_state": "d_state"},
    scored={"m1_inner": ("m1_inner",), "m1_B": ("m1_state",), "m1_C": ("m1_state",)},
    widths=("mamba1_d_state",),
    declares=(Width("mamba1_d_state", "d_state", None, "m1_state", None, "m1.state",
                    "Mamba-1 SSM state size (x_proj's B and C rows, A_log columns, the B / C norms)"),),
    hidden_units=("m1_inner",),
    fixed=("m1_kernel", "m1_dt_rank"),
    tp_axes=("m1_in_proj", "m1_inner"), inputs=("attention_mask",), color="tab:cyan",
    tp_plan={"in_proj": "shard_entry", "conv1d": "shard", "x_proj": "rowwise", "dt_proj": "colwise",
             "ssm": "shard_entry", "": "shard", "out_proj": "rowwise"},
    config=Mamba1Config)
