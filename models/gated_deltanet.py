"""The Gated DeltaNet layer kind ('D'): linear attention by the gated delta rule (Qwen3-Next, Qwen3.5,
OLMo-hybrid); its config section, module and spec (GATED_DELTANET).

in_proj_q, _k, _v -> causal depthwise conv + silu over [q | k | v] (q_conv1d, k_conv1d, v_conv1d: stored apart, as
OLMo-hybrid's checkpoints do; run as one conv) -> per value head the gated delta rule
(models.gdn_kernels: q, k L2-normalised, beta = sigmoid(in_proj_b) (doubled: OLMo-hybrid), log decay g = -exp(A_log) *
softplus(in_proj_a + dt_bias)) -> a gated RMSNorm per value head (gate in_proj_z) -> out_proj. Value heads
are grouped under key heads as query heads under KV heads: value head h reads key head h // (Hv // Hk).
The module stores every projection apart (as OLMo-hybrid does); Qwen3.5's fused in_proj_qkv and Qwen3-Next's
per-key-head in_proj_qkvz, and their one conv1d, are parts of one HF tensor in their key maps
(models.families.family.Part). Numerics follow
transformers' `qwen3_5` torch path; on CUDA the rule runs fla-core's kernel and the conv causal-conv1d's or
fla-core's when they import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .errors import RemodelError
from . import gdn_kernels
from .gdn_kernels import chunk_gated_delta_rule, gated_rms_norm
from .mamba import GpuKernels, causal_conv_silu, gpu_kernels
from .mamba_kernels import compute_dtype
from .recompute import maybe_checkpoint
from .section import MAX_SMALL, MAX_WIDTH, Section, ints, plain, reals
from .spec import LayerKind, Param, Site, Width, sq, top


@dataclass(frozen=True)
class GatedDeltaNetConfig(Section):
    """The Gated DeltaNet kind's fields (transformers' names): key heads of linear_key_head_dim channels,
    value heads (a multiple of the key heads) of linear_value_head_dim, the conv's kernel; the chunk
    size of the chunked rule (numerics do not depend on it)."""
    linear_num_key_heads: int = ints(0, 0, MAX_SMALL, raw={"linear_num_key_heads": 1})
    linear_num_value_heads: int = ints(0, 0, MAX_SMALL, raw={"linear_num_value_heads": 1})
    linear_key_head_dim: int = ints(0, 0, MAX_SMALL, raw={"linear_key_head_dim": 1})
    linear_value_head_dim: int = ints(0, 0, MAX_SMALL, raw={"linear_value_head_dim": 1})
    linear_conv_kernel_dim: int = ints(4, 1, 1024, raw={"linear_conv_kernel_dim": 1})
    linear_chunk_size: int = ints(64, 1, MAX_WIDTH)
    linear_conv_bias: bool = plain(False)
    linear_allow_neg_eigval: bool = plain(False, "beta = 2 * sigmoid(in_proj_b), in (0, 2) (OLMo-hybrid)",
                                          variant="delta_rule")
    linear_norm_eps: float | None = reals(None, gt=0, variant="delta_rule",
                                          doc="the gated output norm's eps (None: norm_eps; OLMo-hybrid: 1e-5)")


def conv_kernels(x) -> GpuKernels:
    """The Mamba path's GPU convs (causal-conv1d's, else fla-core's Triton conv) for a CUDA x where they
    import and gdn_kernels.USE_KERNEL is on; none elsewhere (one F.conv1d)."""
    return gpu_kernels() if x.is_cuda and gdn_kernels.USE_KERNEL else GpuKernels()


class DepthwiseConv(NamedTuple):
    """The three convs as one depthwise conv over [q | k | v] (what causal_conv_silu reads of an nn.Conv1d)."""
    weight: torch.Tensor
    bias: torch.Tensor | None


class GatedHeadNorm(nn.Module):
    """RMSNorm over each value head's channels, times silu(gate) (one weight shared by every head); `rule` is the
    normalisation (KDA's output norm gates by sigmoid: models.kda)."""
    rule = staticmethod(gated_rms_norm)

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x, gate):
        return self.normed(self.weight, x, gate)

    def normed(self, weight, x, gate):
        """The norm with `weight` in place of its own (tensor parallelism: the replicated weight as this rank's
        heads read it, pipelines.distributed.styles.SharedNorm)."""
        return self.rule(x, gate, weight, self.eps)


class GatedDeltaNet(nn.Module):
    """u [b, l, hidden] -> [b, l, hidden]; attention_mask [b, l] (0: padding) zeroes padded inputs."""
    recompute_core = False  # models.recompute "selective": conv + rule + norm recomputed in backward

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        H, hv = cfg.hidden_size, cfg.gated_deltanet.linear_num_value_heads
        qk, v = GATED_DELTANET.axis_size(cfg, "lin_qk"), GATED_DELTANET.axis_size(cfg, "lin_v")
        self.in_proj_q, self.in_proj_k = nn.Linear(H, qk, bias=False), nn.Linear(H, qk, bias=False)
        self.in_proj_v = nn.Linear(H, v, bias=False)
        self.in_proj_z = nn.Linear(H, v, bias=False)
        self.in_proj_b = nn.Linear(H, hv, bias=False)
        self.in_proj_a = nn.Linear(H, hv, bias=False)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(n, n, cfg.gated_deltanet.linear_conv_kernel_dim, groups=n, bias=cfg.gated_deltanet.linear_conv_bias) for n in (qk, qk, v))
        self.conv_out = nn.Identity()  # the activation scores read q and k channels here
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.empty(hv))
        if not self.A_log.is_meta:
            with torch.no_grad():
                self.A_log.copy_(torch.empty(hv).uniform_(0.01, 16).log())
        self.norm = GatedHeadNorm(cfg.gated_deltanet.linear_value_head_dim,
                                  cfg.norm_eps if cfg.gated_deltanet.linear_norm_eps is None else cfg.gated_deltanet.linear_norm_eps)
        self.out_proj = nn.Linear(v, H, bias=False)

    def forward(self, u, attention_mask=None):
        if attention_mask is not None:
            u = u * attention_mask[:, :, None].to(u.dtype)
        b, l, _ = u.shape
        a, beta = self.in_proj_a(u), self.in_proj_b(u).sigmoid()
        if self.cfg.gated_deltanet.linear_allow_neg_eigval:  # this kind's delta_rule variant (off: beta in (0, 1))
            beta = beta * 2.0
        cd = compute_dtype(a)  # fp32 (transformers' float()), float64 stays float64
        g = -self.A_log.to(cd).exp() * F.softplus(a.to(cd) + self.dt_bias.to(cd))
        z = self.in_proj_z(u).unflatten(-1, (-1, self.cfg.gated_deltanet.linear_value_head_dim))
        mixed = torch.cat([self.in_proj_q(u), self.in_proj_k(u), self.in_proj_v(u)], dim=-1)
        out = maybe_checkpoint(self, self._core, mixed, g, beta, z)
        return self.out_proj(out.flatten(2))

    def conv(self) -> DepthwiseConv:
        """q_conv1d, k_conv1d, v_conv1d concatenated: one depthwise conv over [q | k | v]."""
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        bias = None if convs[0].bias is None else torch.cat([c.bias for c in convs])
        return DepthwiseConv(torch.cat([c.weight for c in convs]), bias)

    def _core(self, mixed, g, beta, z):
        """[q | k | v] projections, log decay, beta, gate -> the normed, gated output [b, l, Hv, dv]."""
        cfg, hv = self.cfg, self.A_log.shape[0]  # head counts from the shapes (a TP rank holds fewer)
        k = conv_kernels(mixed)
        x = self.conv_out(causal_conv_silu(mixed, self.conv(), k.conv, k.conv_fla))
        kd = (x.shape[-1] - hv * cfg.gated_deltanet.linear_value_head_dim) // 2
        q, k, v = x.split([kd, kd, x.shape[-1] - 2 * kd], dim=-1)
        q, k = (t.unflatten(-1, (-1, cfg.gated_deltanet.linear_key_head_dim)) for t in (q, k))
        o, _ = chunk_gated_delta_rule(q, k, v.unflatten(-1, (hv, -1)), g, beta, cfg.gated_deltanet.linear_chunk_size)
        return self.norm(o, z)


class GatedDeltaNetKind(LayerKind):
    def build(self, cfg):
        return GatedDeltaNet(cfg)

    def head_units(self, cfg):
        """Value heads, and key-head groups (a key head with the value heads it feeds), as out_proj input channels."""
        dv, hk, hv = cfg.gated_deltanet.linear_value_head_dim, cfg.gated_deltanet.linear_num_key_heads, cfg.gated_deltanet.linear_num_value_heads
        r = hv // hk
        return [("lin_v_heads_loo", [torch.arange(j * dv, (j + 1) * dv) for j in range(hv)]),
                ("lin_k_heads_loo", [torch.arange(g * r * dv, (g + 1) * r * dv) for g in range(hk)])]

    def measured_units(self, cfg):
        """Key-head groups (Hk per layer: 16 in the released Qwen3-Next / Qwen3.5): activation ranked layer 2's
        groups no better than chance on the bench's trained Qwen3.5-shaped model, their measured cost picks a set
        below magnitude and every random seed (bench/results/head_criteria_gdn.md)."""
        return [u for u in self.head_units(cfg) if u[0] == "lin_k_heads_loo"]

    def remove_channels(self, mixer, keep, fired):
        """The removed heads' outputs zeroed at out_proj's input (their RMS norm is per head: nothing else moves)."""
        return self.zero_inputs(mixer.out_proj, keep, fired)

    def init_param(self, cfg, local, p, g, std):
        """As transformers' qwen3_next / qwen3_5: A = -U(0.01, 16) (A_log its log), dt_bias one; the convs are
        Conv1d, which its generic init draws normal(std)."""
        if local == "A_log":
            p.copy_(torch.empty(p.shape).uniform_(0.01, 16, generator=g).log_())
        elif local == "dt_bias":
            p.fill_(1.0)
        elif local.endswith("conv1d.weight"):
            p.normal_(0.0, std, generator=g)
        else:
            return False
        return True

    def validate(self, cfg, need):
        hk, hv = cfg.gated_deltanet.linear_num_key_heads, cfg.gated_deltanet.linear_num_value_heads
        need(hk > 0 and hv > 0 and cfg.gated_deltanet.linear_key_head_dim > 0 and cfg.gated_deltanet.linear_value_head_dim > 0,
             "Gated DeltaNet layers need linear_num_key_heads, linear_num_value_heads and both head dims > 0")
        need(hv % hk == 0, f"linear_num_value_heads={hv} is not a multiple of linear_num_key_heads={hk}")

    def summary(self, cfg):
        return {k: cfg.get(k) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                             "linear_value_head_dim", "linear_conv_kernel_dim")}

    state_row = "GDN state (conv + fp32 recurrent)"

    def cache_bytes(self, cfg, w, batch, seq_len, kv_bytes=2, state_bytes=4, conv_bytes=2):
        """The conv state keeps its kernel's columns of q, k, v; the recurrent state is dk x dv per value head."""
        conv = 2 * self.axis_size(cfg, "lin_qk", w) + self.axis_size(cfg, "lin_v", w)
        return {"gdn_conv_state": batch * conv * cfg.gated_deltanet.linear_conv_kernel_dim * conv_bytes,
                "gdn_recurrent_state": batch * w["linear_value_heads"] * w["linear_key_head_dim"]
                * w["linear_value_head_dim"] * state_bytes}

    def mixing_flops(self, cfg, seq_len):
        """Per token: the state's read, correction and write (3 dk x dv products per value head) and the
        chunk's intra-block attention (64 steps of q.k and of the values)."""
        hv, dk, dv = cfg.gated_deltanet.linear_num_value_heads, cfg.gated_deltanet.linear_key_head_dim, cfg.gated_deltanet.linear_value_head_dim
        return 2 * hv * (3 * dk * dv + min(seq_len, cfg.gated_deltanet.linear_chunk_size) * (dk + dv))

    def sites(self, cfg):
        qk = self.axis_size(cfg, "lin_qk")
        return (Site("lin_q", "conv_out", "output", slice(0, qk)), Site("lin_k", "conv_out", "output", slice(qk, 2 * qk)),
                Site("lin_v", "out_proj", "input", None, "out_proj.weight"))

    def keep(self, cfg, score, t, p):
        if not any(n in t for n in self.widths):
            return {}
        hk, hv, dk, dv = (cfg.gated_deltanet.linear_num_key_heads, cfg.gated_deltanet.linear_num_value_heads, cfg.gated_deltanet.linear_key_head_dim,
                          cfg.gated_deltanet.linear_value_head_dim)
        flags = "--linear-key-heads/--linear-value-heads/--linear-key-head-dim/--linear-value-head-dim"
        qk = torch.stack([score(p + s, (hk, dk), flags) for s in ("lin_q", "lin_k")]).norm(dim=0)  # [hk, dk]
        sv = score(p + "lin_v", (hv, dv), flags)
        keep = {}
        vch = top(sv.norm(dim=0), t["linear_value_head_dim"]) if "linear_value_head_dim" in t else torch.arange(dv)
        if "linear_key_head_dim" in t:
            keep[p + "lin_dk"] = top(qk.norm(dim=0), t["linear_key_head_dim"])
        if "linear_value_head_dim" in t:
            keep[p + "lin_dv"] = vch
        if "linear_key_heads" in t or "linear_value_heads" in t:
            keep.update(self._keep_heads(cfg, sv[:, vch].norm(dim=1), t, p))
        return keep

    def _keep_heads(self, cfg, heads, t, p):
        """Key-head groups by the norm of their value heads' scores, then the same number of value heads in
        every kept group (value heads of a dropped group go with it)."""
        hk, hv = cfg.gated_deltanet.linear_num_key_heads, cfg.gated_deltanet.linear_num_value_heads
        r, nk = hv // hk, t.get("linear_key_heads", hk)
        nv = t.get("linear_value_heads", nk * r)
        if nv % nk or nv // nk > r:
            raise RemodelError(f"--linear-value-heads {nv} must be a multiple of the {nk} kept key heads and at most "
                               f"{nk * r} (each key head has {r} value heads); nearest valid: {nk * min(r, max(1, nv // nk))}")
        groups = top(heads.view(hk, r).norm(dim=1), nk) if nk != hk else torch.arange(hk)
        per = nv // nk
        kept = torch.cat([g * r + top(heads[g * r:(g + 1) * r], per) for g in groups.tolist()])
        out = {p + "lin_v_heads": kept}
        if nk != hk:
            out[p + "lin_k_heads"] = groups
        return out

    def magnitude(self, cfg, local, t):
        """q and k rows per key channel; v and z rows, out_proj columns per value channel."""
        site = {"in_proj_q.weight": "lin_q", "in_proj_k.weight": "lin_k", "in_proj_v.weight": "lin_v",
                "in_proj_z.weight": "lin_v"}.get(local)
        if site:
            return [(site, sq(t, 0))]
        if local == "out_proj.weight":
            return [("lin_v", sq(t, 1))]
        return []

    def check_tp(self, cfg, tp, need):
        need(cfg.gated_deltanet.linear_num_key_heads % tp == 0, f"tensor parallelism: linear_num_key_heads="
             f"{cfg.gated_deltanet.linear_num_key_heads} is not divisible by tp={tp} (heads are split by key-head group)")


_CONVS = (("q", "lin_qk"), ("k", "lin_qk"), ("v", "lin_v"))  # each conv's channels follow its projection's rows
_DECLARES = (Width("linear_key_heads", "linear_num_key_heads", None, "lin_k_heads", None, "l.kh",
                   "Gated DeltaNet key heads (whole groups: each takes its value heads with it)"),
             Width("linear_value_heads", "linear_num_value_heads", None, "lin_v_heads", None, "l.vh",
                   "Gated DeltaNet value heads (a multiple of the key heads)", multiple_of="linear_num_key_heads",
                   why=" (every key-head group keeps the same number of value heads)"),
             Width("linear_key_head_dim", "linear_key_head_dim", None, "lin_dk", 8, "l.dk",
                   "Gated DeltaNet key/query head size"),
             Width("linear_value_head_dim", "linear_value_head_dim", None, "lin_dv", 8, "l.dv",
                   "Gated DeltaNet value head size"))  # its widths, each declared once
GATED_DELTANET = GatedDeltaNetKind(
    "D", "gated_deltanet",
    (Param("in_proj_q.weight", ("lin_qk", "hidden")), Param("in_proj_k.weight", ("lin_qk", "hidden")),
     Param("in_proj_v.weight", ("lin_v", "hidden")), Param("in_proj_z.weight", ("lin_v", "hidden")),
     Param("in_proj_b.weight", ("lin_v_heads", "hidden")), Param("in_proj_a.weight", ("lin_v_heads", "hidden")),
     *(p for x, a in _CONVS for p in (Param(f"{x}_conv1d.weight", (a, "one", "lin_conv_kernel")),
                                      Param(f"{x}_conv1d.bias", (a,), ("linear_conv_bias",)))),
     Param("dt_bias", ("lin_v_heads",)), Param("A_log", ("lin_v_heads",)), Param("norm.weight", ("lin_dv",)),
     Param("out_proj.weight", ("hidden", "lin_v"))),
    sizes={"lin_k_heads": lambda cfg, w: w["linear_key_heads"], "lin_v_heads": lambda cfg, w: w["linear_value_heads"],
           "lin_dk": lambda cfg, w: w["linear_key_head_dim"], "lin_dv": lambda cfg, w: w["linear_value_head_dim"],
           "lin_qk": lambda cfg, w: w["linear_key_heads"] * w["linear_key_head_dim"],
           "lin_v": lambda cfg, w: w["linear_value_heads"] * w["linear_value_head_dim"],
           "lin_conv_kernel": lambda cfg, w: cfg.gated_deltanet.linear_conv_kernel_dim},
    units={"lin_k_heads": "linear_num_key_heads", "lin_v_heads": "linear_num_value_heads",
           "lin_dk": "linear_key_head_dim", "lin_dv": "linear_value_head_dim"},
    products={"lin_qk": ("lin_k_heads", "lin_dk"), "lin_v": ("lin_v_heads", "lin_dv")},
    scored={"lin_q": ("lin_k_heads", "lin_dk"), "lin_k": ("lin_k_heads", "lin_dk"), "lin_v": ("lin_v_heads", "lin_dv")},
    widths=tuple(w.name for w in _DECLARES),
    declares=_DECLARES,
    fixed=("lin_conv_kernel",),
    tp_axes=("lin_qk", "lin_v", "lin_v_heads"), inputs=("attention_mask",), color="tab:purple",
    tp_plan={**{f"in_proj_{x}": "colwise" for x in "qkvzba"}, **{f"{x}_conv1d": "shard" for x in "qkv"},
             "": "shard", "norm": "shared_norm", "out_proj": "rowwise"},
    config=GatedDeltaNetConfig)
