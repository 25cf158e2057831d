"""The Mamba-2 layer kind ('M'): in_proj -> causal depthwise conv + silu -> SSD scan -> gated group
RMSNorm -> out_proj; its module and its spec (MAMBA).

Numerics follow transformers' `nemotron_h`: dt = clamp(softplus(dt + dt_bias), time_step_min,
time_step_max), A = -exp(A_log), and the gate multiplies before the group norm. The in_proj output
and the conv channels are concatenations of segments whose order the spec at the end of this file
states once; every slice here comes from there, under the mixer's current cfg (tensor parallelism gives it one rank's
heads and groups).

This file is the readable form; models.mamba_kernels computes it fast. On CPU the mixer runs the
fused cache-blocked kernel; on CUDA the same steps as whole-tensor ops, each through the optional GPU
kernel that does it without fp32 round trips when installed (`gpu_kernels`: causal-conv1d's conv + silu, or
fla-core's Triton conv where causal-conv1d (CUDA-compiled) is absent, mamba-ssm's scan with dt + dt_bias,
softplus and the clamp folded in, its Triton gated RMSNorm).
`ssd_reference` is the recurrence itself, which the tests hold the scans to; tests/test_gpu_paths.py
holds the GPU kernels' calls to the CPU path through stand-ins with their signatures.
"""
from __future__ import annotations

import functools
import math
import importlib
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .mamba_kernels import CoreLayout, Spans, compute_dtype, gated_rms_norm, mamba_core, ssd_scan
from .recompute import maybe_checkpoint
from .section import MAX_SMALL, MAX_WIDTH, Section, ints, plain, reals, vector
from .spec import LayerKind, Param, Site, Width, sq, top, top_per_group

PLAIN_SSM = (1.0, 1.0, 1.0, 1.0, 1.0)  # ssm_multipliers of every family but Falcon-H1
USE_KERNEL = True  # False: the pure-PyTorch conv, scan and norm on CUDA even with the GPU extras installed
USE_FLA_CONV = True  # False: no fla-core conv (the benchmarks' baseline for it)


@dataclass(frozen=True)
class MambaConfig(Section):
    """The Mamba-2 kind's fields. dt is clamped to [time_step_min, time_step_max]; variants default to
    off: mamba_rms_norm False (y * silu(z) alone) and mamba_norm_before_gate (normalise, then gate) are
    Falcon-H1's options, ssm_multipliers scale the in_proj segments z|x|B|C|dt (1 elsewhere)."""
    mamba_num_heads: int = ints(0, 0, MAX_SMALL, raw={"mamba_num_heads": 1, "mamba_n_heads": 1})
    mamba_head_dim: int = ints(0, 0, MAX_SMALL, raw={"mamba_head_dim": 1, "mamba_d_head": 1})
    n_groups: int = ints(1, 1, MAX_SMALL, raw={"n_groups": 1, "mamba_n_groups": 1})
    d_state: int = ints(0, 0, MAX_SMALL, raw={"ssm_state_size": 1, "mamba_d_state": 1})
    conv_kernel: int = ints(4, 1, 1024, raw={"conv_kernel": 1, "mamba_d_conv": 1})
    chunk_size: int = ints(128, 1, MAX_WIDTH, raw={"chunk_size": 1, "mamba_chunk_size": 1})
    use_conv_bias: bool = plain(True)
    mamba_proj_bias: bool = plain(False)
    time_step_min: float = reals(0.001, ge0=True, raw=("time_step_min",))
    time_step_max: float = reals(float("inf"), gt=0, inf_ok=True, raw=("time_step_max",))
    mamba_rms_norm: bool = plain(True, "the gated group RMSNorm before out_proj", variant="projections")
    mamba_norm_before_gate: bool = plain(False, "normalise y, then gate; False: gate first", variant="projections")
    ssm_multipliers: tuple = vector(PLAIN_SSM, variant="projections")
    RENAMED: ClassVar[dict] = {"ssm_state_size": "d_state"}  # its name until 2026-12-06 (HF's name for it)


class GpuKernels(NamedTuple):
    """The optional GPU extras' kernels, each None where it does not import: mamba-ssm's fused SSD scan
    `mamba_chunk_scan_combined` and Triton gated RMSNorm `rmsnorm_fn`, causal-conv1d's `causal_conv1d_fn`,
    and fla-core's Triton `causal_conv1d` (x [b, l, C]; the conv where causal-conv1d is absent)."""
    scan: object = None
    norm: object = None
    conv: object = None
    conv_fla: object = None


GPU_KERNELS = (("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
               ("mamba_ssm.ops.triton.layernorm_gated", "rmsnorm_fn"), ("causal_conv1d", "causal_conv1d_fn"),
               ("fla.modules.causal_conv1d", "causal_conv1d"))


def optional_import(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # an optional GPU extra: missing, or built for another torch / CUDA
        return None


@functools.lru_cache(maxsize=None)
def gpu_kernels() -> GpuKernels:
    """The `GpuKernels` installed here, imported on first use (only the CUDA path asks); fla-core is only
    imported where causal-conv1d is missing."""
    *first, fla = GPU_KERNELS
    found = [optional_import(*m) for m in first]
    return GpuKernels(*found, conv_fla=None if found[-1] is not None else optional_import(*fla))


def _on_gpu(t) -> bool:
    """Which path runs: whole-tensor ops (+ the GPU extras' kernels) on CUDA, the fused blocked kernel elsewhere."""
    return t.is_cuda


def _kernels() -> GpuKernels:
    """The GPU kernels the CUDA path uses: `gpu_kernels()` (without fla-core's conv when USE_FLA_CONV is
    off), or none when USE_KERNEL is off."""
    k = gpu_kernels() if USE_KERNEL else GpuKernels()
    return k if USE_FLA_CONV else k._replace(conv_fla=None)


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


def causal_conv_silu(x, conv: nn.Conv1d, kernel=None, fla=None):
    """silu(causal depthwise conv(x)) on x [b, l, C]: causal-conv1d's `causal_conv1d_fn` when given and it
    takes x's channel-last layout and the width (transformers' call), else fla-core's Triton conv when given
    (any strides, width <= 4), else one F.conv1d call (cuDNN on a GPU)."""
    w, xt = conv.weight, x.transpose(1, 2)
    if kernel is not None and _conv_kernel_fits(xt, w.shape[-1]):
        return kernel(xt, w.squeeze(1), conv.bias, activation="silu").transpose(1, 2)
    if fla is not None and 2 <= w.shape[-1] <= 4:
        return fla(x, w.squeeze(1).to(x.dtype), None if conv.bias is None else conv.bias.to(x.dtype),
                   activation="silu")[0]
    y = F.conv1d(xt, w, conv.bias, padding=w.shape[-1] - 1, groups=w.shape[0])
    return F.silu(y[..., :x.shape[1]].transpose(1, 2))


def _conv_kernel_fits(xt, width: int) -> bool:
    """causal-conv1d's conditions: width 2..4 and, on a channel-last input [b, C, l] (stride 1 over C), C
    and the batch and time strides multiples of 8."""
    return (2 <= width <= 4 and xt.stride(1) == 1 and xt.shape[1] % 8 == 0 and xt.stride(0) % 8 == 0
            and xt.stride(2) % 8 == 0)


def init_a_log(p: torch.Tensor) -> torch.Tensor:
    """A_log's initial value in place: log(1..h), i.e. A = -1..-h (transformers' nemotron_h init)."""
    return p.copy_(torch.log(torch.arange(1, p.numel() + 1, dtype=torch.float32, device=p.device)))


class GatedRMSNorm(nn.Module):
    """y * silu(z), then RMS-normalised within each of `groups` groups, times weight. It keeps the group
    width, so a tensor-parallel shard of the weight (whole groups) reads its own group count from its shape."""

    def __init__(self, size: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size, self.eps = size // groups, eps

    @property
    def groups(self) -> int:
        return self.weight.shape[0] // self.group_size

    def forward(self, y, z):
        return gated_rms_norm(y, z, self.weight, self.groups, self.eps)


class RMSNormThenGate(GatedRMSNorm):
    """Falcon-H1's mamba_norm_before_gate: y RMS-normalised within each group, times weight, then times
    silu(z); in fp32 (float64 stays float64), rounded to y's dtype (transformers' FalconH1RMSNormGated)."""

    def forward(self, y, z):
        cd = compute_dtype(y)
        h = y.to(cd).unflatten(-1, (self.groups, self.group_size))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight.view(self.groups, self.group_size) * h
        return (h.flatten(-2) * F.silu(z.to(cd))).to(y.dtype)


class Gate(nn.Module):
    """No norm (Falcon-H1 without mamba_rms_norm): y * silu(z)."""

    def forward(self, y, z):
        return y * F.silu(z)


def mamba_norm(cfg) -> nn.Module:
    """The module between the scan and out_proj, as cfg's Mamba variant says."""
    if not cfg.mamba.mamba_rms_norm:
        return Gate()
    return (RMSNormThenGate if cfg.mamba.mamba_norm_before_gate else GatedRMSNorm)(cfg.mamba_inner, cfg.mamba.n_groups, cfg.norm_eps)


class Mamba2Mixer(nn.Module):
    """The Mamba-2 mixer of a hybrid layer: u [b, l, hidden] -> [b, l, hidden]. attention_mask [b, l]
    (0: padding) zeroes the input and the conv output of padded steps."""
    recompute_core = False  # models.recompute "selective": conv + scan + gated norm recomputed in backward

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        conv = MAMBA.axis_size(cfg, "mamba_conv")
        self.in_proj = nn.Linear(cfg.hidden_size, MAMBA.axis_size(cfg, "mamba_in_proj"), bias=cfg.mamba.mamba_proj_bias)
        self.conv1d = nn.Conv1d(conv, conv, cfg.mamba.conv_kernel, groups=conv, bias=cfg.mamba.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(cfg.mamba.mamba_num_heads))
        self.A_log = nn.Parameter(torch.empty(cfg.mamba.mamba_num_heads))
        if not self.A_log.is_meta:  # arange on the meta device imports torch._dynamo (slow)
            with torch.no_grad():
                init_a_log(self.A_log)
        self.D = nn.Parameter(torch.ones(cfg.mamba.mamba_num_heads))
        self.norm = mamba_norm(cfg)
        self.out_proj = nn.Linear(cfg.mamba_inner, cfg.hidden_size, bias=cfg.mamba.mamba_proj_bias)

    def forward(self, u, attention_mask=None):
        b, l, _ = u.shape
        if attention_mask is not None:
            u = u * attention_mask[:, :, None].to(u.dtype)
        proj = self.in_proj(u)
        if self.cfg.mamba.ssm_multipliers != PLAIN_SSM:  # the variant: each in_proj segment z|x|B|C|dt times its own
            proj = proj * self._mup(proj)
        if b == 0 or l == 0:  # nothing to scan (the blocked kernels cannot view an empty tensor)
            return self.out_proj(proj.new_zeros(b, l, self.dt_bias.shape[0] * self.cfg.mamba.mamba_head_dim))
        A = -torch.exp(self.A_log.float())
        core = self._core if _on_gpu(u) else self._fused_core
        return self.out_proj(maybe_checkpoint(self, core, proj, A, attention_mask).to(u.dtype))

    def _mup(self, proj):
        """The in_proj output's per-segment multipliers (cfg.mamba.ssm_multipliers, in the spec's segment order) as one
        vector over its columns (transformers' mup_vector), under this mixer's local widths."""
        sizes = MAMBA.segment_sizes(self._local()[0], "mamba_in_proj").values()
        return torch.cat([torch.full((n,), m, dtype=torch.float32, device=proj.device)
                          for n, m in zip(sizes, self.cfg.mamba.ssm_multipliers)]).to(proj.dtype)

    def _local(self):
        """(cfg with the head and group counts this mixer's parameters hold, the spec's column slices of its
        in_proj output): read from the shapes, so a tensor-parallel rank's shards give that rank's counts."""
        nh, rows = self.dt_bias.shape[0], self.in_proj.weight.shape[0]
        if self.__dict__.get("_local_key") != (nh, rows):
            cfg = self.cfg
            groups = (rows - nh * (2 * cfg.mamba.mamba_head_dim + 1)) // (2 * cfg.mamba.d_state)
            local = cfg.replace(mamba_num_heads=nh, n_groups=groups)
            self._local_key, self._local_val = (nh, rows), CoreLayout(local, layout_spans(local))
        return self._local_val

    def _fused_core(self, proj, A, attention_mask):
        """CPU: conv + dt + scan as one cache-blocked kernel, then the gated norm (in_proj output ->
        out_proj input)."""
        mask = attention_mask.to(compute_dtype(proj)) if attention_mask is not None else None
        y, z = mamba_core(proj, self.conv1d.weight, self.conv1d.bias, self.dt_bias, A, self.D, mask, self._local())
        return self.norm(y, z)

    def _core(self, proj, A, attention_mask):
        """CUDA: conv, dt, scan and gated norm as whole-tensor ops, each through its GPU kernel when one is
        installed (in_proj output -> out_proj input)."""
        (cfg, sp), k = self._local(), _kernels()
        conv_out = causal_conv_silu(proj[..., sp.conv], self.conv1d, k.conv, k.conv_fla)
        if attention_mask is not None:
            conv_out = conv_out * attention_mask[:, :, None].to(conv_out.dtype)
        x = conv_out[..., sp.x].unflatten(-1, (cfg.mamba.mamba_num_heads, cfg.mamba.mamba_head_dim))
        B, C = (conv_out[..., s].unflatten(-1, (cfg.mamba.n_groups, cfg.mamba.d_state)) for s in (sp.B, sp.C))
        dt, z = proj[..., sp.dt], proj[..., sp.z]
        if k.scan is not None:  # dt + dt_bias, softplus and the clamp inside the kernel, as transformers calls it
            y = k.scan(x, dt, A, B, C, cfg.mamba.chunk_size, D=self.D, dt_bias=self.dt_bias, dt_softplus=True,
                       dt_limit=(cfg.mamba.time_step_min, cfg.mamba.time_step_max))
        else:
            cd = compute_dtype(dt)
            dt = F.softplus(dt.to(cd) + self.dt_bias.to(cd)).clamp(cfg.mamba.time_step_min, cfg.mamba.time_step_max)
            y = ssd_scan(x, dt, A, B, C, cfg.mamba.chunk_size, D=self.D)
        y = y.flatten(2)
        if k.norm is None or not cfg.mamba.mamba_rms_norm:
            return self.norm(y, z)
        n = self.norm  # one norm per group of channels, the gate before it unless the config says after
        return k.norm(y, n.weight, None, z=z, eps=n.eps, group_size=y.shape[-1] // n.groups,
                      norm_before_gate=cfg.mamba.mamba_norm_before_gate)


def masked_gated_norm(norm, y, z, keep: torch.Tensor):
    """The Mamba mixer's norm of (y, z) with only the channels `keep` (bool [inner]) present: removed channels
    give 0 and every group's RMS runs over its kept channels (what the pruned model computes)."""
    cd = torch.float64 if y.dtype == torch.float64 else torch.float32
    m = keep.to(device=y.device, dtype=cd)
    if isinstance(norm, Gate):
        return (y.to(cd) * F.silu(z.to(cd)) * m).to(y.dtype)
    before = isinstance(norm, RMSNormThenGate)
    h = y.to(cd) * m if before else y.to(cd) * F.silu(z.to(cd)) * m
    G = norm.groups
    hg, n = h.unflatten(-1, (G, -1)), m.view(G, -1).sum(-1, keepdim=True).clamp(min=1)
    normed = (hg * torch.rsqrt(hg.pow(2).sum(-1, keepdim=True) / n + norm.eps)).flatten(-2)
    out = norm.weight.to(cd) * normed
    return (out * F.silu(z.to(cd)) if before else out).to(y.dtype)


class MambaKind(LayerKind):
    def build(self, cfg):
        return Mamba2Mixer(cfg)

    def head_units(self, cfg):
        hd = cfg.mamba.mamba_head_dim
        return [("mamba_heads_loo", [torch.arange(h * hd, (h + 1) * hd) for h in range(cfg.mamba.mamba_num_heads)])]

    def remove_channels(self, mixer, keep, fired):
        """The gated norm over the kept channels only (each group's RMS over those it keeps), as the pruned model's."""
        def hook(module, args, out):
            fired()
            return masked_gated_norm(module, args[0], args[1], keep)
        return mixer.norm.register_forward_hook(hook)

    def init_param(self, cfg, local, p, g, std):
        """A = -1..-h, D one, dt_bias the inverse softplus of dt drawn log-uniform in [0.001, 0.1] (transformers'
        nemotron_h); the conv uniform within 1/sqrt(conv_kernel)."""
        if local == "D":
            p.fill_(1.0)
        elif local == "A_log":
            init_a_log(p)
        elif local == "dt_bias":
            dt = torch.exp(torch.rand(p.shape, generator=g) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
            dt = dt.clamp(min=1e-4)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif local == "conv1d.weight":
            p.uniform_(-1.0 / math.sqrt(cfg.mamba.conv_kernel), 1.0 / math.sqrt(cfg.mamba.conv_kernel), generator=g)
        else:
            return False
        return True

    def validate(self, cfg, need):
        need(cfg.mamba.mamba_num_heads > 0 and cfg.mamba.mamba_head_dim > 0 and cfg.mamba.d_state > 0,
             "Mamba layers need mamba_num_heads, mamba_head_dim and d_state > 0")
        need(cfg.mamba.n_groups > 0 and cfg.mamba.mamba_num_heads % cfg.mamba.n_groups == 0,
             f"mamba_num_heads={cfg.mamba.mamba_num_heads} is not a multiple of n_groups={cfg.mamba.n_groups}")
        need(cfg.mamba.chunk_size > 0 and cfg.mamba.conv_kernel > 0, "chunk_size and conv_kernel must be > 0")

    def summary(self, cfg):
        return {"mamba_num_heads": cfg.mamba.mamba_num_heads, "mamba_head_dim": cfg.mamba.mamba_head_dim, "n_groups": cfg.mamba.n_groups,
                "d_state": cfg.mamba.d_state, "conv_kernel": cfg.mamba.conv_kernel, "mamba_inner": cfg.mamba_inner,
                "mamba_conv_dim": self.axis_size(cfg, "mamba_conv"),
                "mamba_in_proj_size": self.axis_size(cfg, "mamba_in_proj")}

    state_row = "Mamba state (conv + fp32 SSM)"

    def cache_bytes(self, cfg, w, batch, seq_len, kv_bytes=2, state_bytes=4, conv_bytes=2):
        """The conv state keeps conv_kernel columns of the conv channels; the SSM state does not grow with seq_len."""
        inner, N = w["mamba_heads"] * w["mamba_head_dim"], w["ssm_state_size"]
        return {"mamba_conv_state": batch * (inner + 2 * cfg.mamba.n_groups * N) * cfg.mamba.conv_kernel * conv_bytes,
                "mamba_ssm_state": batch * inner * N * state_bytes}

    def sites(self, cfg):
        """Heads read at out_proj's input (the gated norm's output, [nh * hd] as the x segment), times out_proj's
        column norm: it met the issue-55 rule on both bench models where in_proj's x segment did not
        (bench/RESULTS.md "Mamba head criteria")."""
        return (Site("mamba_x", "out_proj", "input", None, "out_proj.weight"),)

    def in_sites(self, cfg):
        """The former default (score --method activation_in): the x segment of in_proj's output (before conv)."""
        return (Site("mamba_x", "in_proj", "output", self.segment_span(cfg, "mamba_in_proj", "x"), "out_proj.weight"),)

    def keep(self, cfg, score, t, p):
        if "mamba_heads" not in t and "mamba_head_dim" not in t:
            return {}
        keep, nh, hd = {}, cfg.mamba.mamba_num_heads, cfg.mamba.mamba_head_dim
        s = score(p + "mamba_x", (nh, hd), "--mamba-heads/--mamba-head-dim")
        chans = top(s.norm(dim=0), t["mamba_head_dim"]) if "mamba_head_dim" in t else torch.arange(hd)
        if "mamba_head_dim" in t:
            keep[p + "mamba_head_dim"] = chans
        if "mamba_heads" in t:  # ranked over the kept channels, the same count in every group
            keep[p + "mamba_heads"] = top_per_group(s[:, chans].norm(dim=1), cfg.mamba.n_groups, t["mamba_heads"])
        return keep

    def magnitude(self, cfg, local, t):
        """in_proj z and x rows, out_proj columns, and each head's dt row spread over its channels."""
        if local in ("in_proj.weight", "in_proj.bias"):
            sizes, hd = self.segment_sizes(cfg, "mamba_in_proj"), cfg.mamba.mamba_head_dim
            seg = dict(zip(sizes, sq(t, 0).split(list(sizes.values()))))
            return [("mamba_x", seg["z"] + seg["x"] + (seg["dt"] / hd).repeat_interleave(hd))]
        if local == "out_proj.weight":
            return [("mamba_x", sq(t, 1))]
        return []

    def check_tp(self, cfg, tp, need):
        need(cfg.mamba.n_groups % tp == 0, f"tensor parallelism: Mamba n_groups={cfg.mamba.n_groups} is not divisible "
             f"by tp={tp} (heads are split by whole groups)")


MAMBA = MambaKind(
    "M", "mamba",
    (Param("in_proj.weight", ("mamba_in_proj", "hidden")),
     Param("in_proj.bias", ("mamba_in_proj",), ("mamba_proj_bias",)),
     Param("conv1d.weight", ("mamba_conv", "one", "conv_kernel")),
     Param("conv1d.bias", ("mamba_conv",), ("use_conv_bias",)),
     Param("dt_bias", ("mamba_heads",)), Param("A_log", ("mamba_heads",)), Param("D", ("mamba_heads",)),
     Param("norm.weight", ("mamba_inner",), ("mamba_rms_norm",)),
     Param("out_proj.weight", ("hidden", "mamba_inner")),
     Param("out_proj.bias", ("hidden",), ("mamba_proj_bias",))),
    # the in_proj output is [z | x | B | C | dt] (gate, scan input, SSM B and C, per-head dt); the conv runs over x, B, C
    segments={"mamba_in_proj": (("z", "mamba_inner"), ("x", "mamba_inner"), ("B", "mamba_bc"), ("C", "mamba_bc"),
                                ("dt", "mamba_heads")),
              "mamba_conv": (("x", "mamba_inner"), ("B", "mamba_bc"), ("C", "mamba_bc"))},
    sizes={"mamba_heads": lambda cfg, w: w["mamba_heads"], "mamba_head_dim": lambda cfg, w: w["mamba_head_dim"],
           "mamba_inner": lambda cfg, w: w["mamba_heads"] * w["mamba_head_dim"],
           "mamba_bc": lambda cfg, w: cfg.mamba.n_groups * w["ssm_state_size"], "conv_kernel": lambda cfg, w: cfg.mamba.conv_kernel},
    units={"mamba_heads": "mamba_num_heads", "mamba_head_dim": "mamba_head_dim"},
    products={"mamba_inner": ("mamba_heads", "mamba_head_dim")}, scored={"mamba_x": ("mamba_heads", "mamba_head_dim")},
    widths=("mamba_heads", "mamba_head_dim", "ssm_state_size"),
    declares=(Width("mamba_heads", "mamba_num_heads", None, "mamba_heads", None, "m.heads",
                    "Mamba heads per layer (a multiple of n_groups)", multiple_of="n_groups"),
              Width("mamba_head_dim", "mamba_head_dim", None, "mamba_head_dim", 8, "m.hd", "channels per Mamba head"),
              Width("ssm_state_size", "d_state", None, None, None, "state", "Mamba SSM state size")),
    fixed=("conv_kernel", "mamba_bc"),
    tp_axes=("mamba_in_proj", "mamba_conv", "mamba_heads", "mamba_inner"), inputs=("attention_mask",), color="tab:blue",
    tp_plan={"in_proj": "shard_entry", "conv1d": "shard", "": "shard", "norm": "shard", "out_proj": "rowwise"},
    config=MambaConfig)


def layout_spans(cfg) -> Spans:
    """The slices of the spec's 'mamba_in_proj' and 'mamba_conv' axes under `cfg` (whose head and group
    counts may be one tensor-parallel rank's). The conv input is the in_proj span of the conv's segments."""
    conv = list(MAMBA.segment_sizes(cfg, "mamba_conv"))
    return Spans(z=MAMBA.segment_span(cfg, "mamba_in_proj", "z"), dt=MAMBA.segment_span(cfg, "mamba_in_proj", "dt"),
                 conv=MAMBA.segment_span(cfg, "mamba_in_proj", conv[0], conv[-1]),
                 **{name: MAMBA.segment_span(cfg, "mamba_conv", name) for name in conv})
