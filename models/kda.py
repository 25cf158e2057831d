"""The Kimi Delta Attention layer kind ('K'): Kimi Linear's KDA (transformers' `KimiLinearDeltaAttention`); its
config section, module and spec (KDA).

q_proj, k_proj, v_proj (hidden -> heads x head_dim each) -> causal depthwise conv + silu over [q | k | v]
(q_conv1d, k_conv1d, v_conv1d as the checkpoints store them; run as one conv) -> per head the gated delta rule with
a per-channel decay (models.kda_kernels: q, k L2-normalised, beta = sigmoid(b_proj), log decay g = -exp(A_log) *
softplus(f_b_proj(f_a_proj(x)) + dt_bias), one value per channel) -> a sigmoid-gated RMSNorm per head (gate
g_b_proj(g_a_proj(x)), one weight of head_dim shared by every head) -> o_proj. The forget and output gates are
low rank: f_a_proj / g_a_proj (hidden -> head_dim, shared by every head), f_b_proj / g_b_proj (-> heads x
head_dim). Heads prune whole: their q, k, v, f_b, g_b rows, convs, dt_bias, A_log, b_proj row and o_proj columns
(there are no key-head groups: q, k and v have one head count). head_dim prunes too (--kda-head-dim): one kept
channel set shared by every head (q, k, v and their convs, f_b / g_b rows, dt_bias, o_norm, o_proj columns) and,
since transformers ties the gates' rank to linear_head_dim, each gate's rank (f_a / g_a rows, f_b / g_b columns)
cut to the same size by its own score. Pure PyTorch on CPU; fla-core's chunk_kda on CUDA when it imports.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .gated_deltanet import DepthwiseConv, GatedHeadNorm, conv_kernels
from .kda_kernels import chunk_kda, sigmoid_gated_rms_norm
from .mamba import causal_conv_silu
from .mamba_kernels import compute_dtype
from .section import MAX_SMALL, MAX_WIDTH, Section, ints, reals
from .spec import LayerKind, Param, Site, Width, sq, top


@dataclass(frozen=True)
class KdaConfig(Section):
    """KDA's fields: heads of kda_head_dim channels (q, k and v alike; also the gates' low rank), the short
    convs' kernel, the chunk size of the chunked rule (numerics do not depend on it), the output norm's eps."""
    kda_num_heads: int = ints(0, 0, MAX_SMALL, raw={"linear_num_heads": 1})
    kda_head_dim: int = ints(0, 0, MAX_SMALL, raw={"linear_head_dim": 1})
    kda_conv_kernel: int = ints(4, 1, 1024, raw={"linear_conv_kernel_dim": 1})
    kda_chunk_size: int = ints(64, 1, MAX_WIDTH)
    kda_norm_eps: float | None = reals(None, gt=0, doc="the gated output norm's eps (None: norm_eps)")


class SigmoidGatedNorm(GatedHeadNorm):
    """RMSNorm over each head's channels times sigmoid(gate) (one weight shared by every head)."""
    rule = staticmethod(sigmoid_gated_rms_norm)


class KimiDeltaAttention(nn.Module):
    """u [b, l, hidden] -> [b, l, hidden]; attention_mask [b, l] (0: padding) zeroes padded inputs. The head
    count comes from the weights (a pruned or tensor-parallel layer holds fewer)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        c, H = cfg.kda, cfg.hidden_size
        n, d = KDA.axis_size(cfg, "kda_inner"), c.kda_head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(H, n, bias=False) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(n, n, c.kda_conv_kernel, groups=n, bias=False) for _ in range(3))
        self.f_a_proj, self.f_b_proj = nn.Linear(H, d, bias=False), nn.Linear(d, n, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(n))
        self.A_log = nn.Parameter(torch.zeros(1, 1, c.kda_num_heads, 1))
        self.b_proj = nn.Linear(H, c.kda_num_heads, bias=False)
        self.g_a_proj, self.g_b_proj = nn.Linear(H, d, bias=False), nn.Linear(d, n, bias=False)
        self.o_norm = SigmoidGatedNorm(d, cfg.norm_eps if c.kda_norm_eps is None else c.kda_norm_eps)
        self.o_proj = nn.Linear(n, H, bias=False)

    def conv(self) -> DepthwiseConv:
        """q_conv1d, k_conv1d, v_conv1d concatenated: one depthwise conv over [q | k | v]."""
        return DepthwiseConv(torch.cat([c.weight for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]), None)

    def decay(self, u):
        """The log decay g [b, l, heads, d] <= 0 per channel, in the compute dtype (fp32; float64 stays)."""
        d, cd = self.cfg.kda.kda_head_dim, compute_dtype(u)
        f = self.f_b_proj(self.f_a_proj(u)).to(cd) + self.dt_bias.to(cd)
        return -self.A_log.to(cd).exp() * F.softplus(f.unflatten(-1, (-1, d)))

    def forward(self, u, attention_mask=None):
        if attention_mask is not None:
            u = u * attention_mask[:, :, None].to(u.dtype)
        d = self.cfg.kda.kda_head_dim
        mixed = torch.cat([self.q_proj(u), self.k_proj(u), self.v_proj(u)], dim=-1)
        kern = conv_kernels(mixed)
        x = causal_conv_silu(mixed, self.conv(), kern.conv, kern.conv_fla)
        q, k, v = (t.unflatten(-1, (-1, d)) for t in x.chunk(3, dim=-1))
        o, _ = chunk_kda(q, k, v, self.decay(u), self.b_proj(u).sigmoid(), self.cfg.kda.kda_chunk_size)
        gate = self.g_b_proj(self.g_a_proj(u)).unflatten(-1, (-1, d))
        return self.o_proj(self.o_norm(o, gate).flatten(2))


class KdaKind(LayerKind):
    def build(self, cfg):
        return KimiDeltaAttention(cfg)

    def head_units(self, cfg):
        """Each head, as its o_proj input channels."""
        d = cfg.kda.kda_head_dim
        return [("kda_heads_loo", [torch.arange(j * d, (j + 1) * d) for j in range(cfg.kda.kda_num_heads)])]

    def remove_channels(self, mixer, keep, fired):
        """The removed heads' outputs zeroed at o_proj's input (the gated norm is per head: nothing else moves)."""
        return self.zero_inputs(mixer.o_proj, keep, fired)

    def init_param(self, cfg, local, p, g, std):
        """As transformers' kimi_linear (fla's init): A = U(1, 16) (A_log its log), dt_bias the inverse softplus
        of exp(U(ln 1e-3, ln 1e-1)); the convs are Conv1d, which its generic init draws normal(std)."""
        if local == "A_log":
            p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g).log_())
        elif local == "dt_bias":
            dt = torch.empty(p.shape).uniform_(-6.907755278982137, -2.302585092994046, generator=g).exp()
            dt = dt.clamp_min(1e-4)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif local.endswith("conv1d.weight"):
            p.normal_(0.0, std, generator=g)
        else:
            return False
        return True

    def validate(self, cfg, need):
        c = cfg.kda
        need(c.kda_num_heads > 0 and c.kda_head_dim > 0, "KDA layers need kda_num_heads and kda_head_dim > 0")

    def summary(self, cfg):
        return {k: cfg.get(k) for k in ("kda_num_heads", "kda_head_dim", "kda_conv_kernel")}

    state_row = "KDA state (conv + fp32 recurrent)"

    def cache_bytes(self, cfg, w, batch, seq_len, kv_bytes=2, state_bytes=4, conv_bytes=2):
        """The conv state keeps its kernel's columns of q, k, v; the recurrent state is d x d per head."""
        n, d = self.axis_size(cfg, "kda_inner", w), cfg.kda.kda_head_dim
        return {"kda_conv_state": batch * 3 * n * cfg.kda.kda_conv_kernel * conv_bytes,
                "kda_recurrent_state": batch * w["kda_heads"] * d * d * state_bytes}

    def mixing_flops(self, cfg, seq_len):
        """Per token: the state's decay, read, correction and write (about 4 d x d products per head) and the
        chunk's intra-block terms (chunk steps of q.k and of the values, per channel)."""
        h, d = cfg.kda.kda_num_heads, cfg.kda.kda_head_dim
        return 2 * h * (4 * d * d + min(seq_len, cfg.kda.kda_chunk_size) * 3 * d)

    def sites(self, cfg):
        return (Site("kda_o", "o_proj", "input", None, "o_proj.weight"),
                Site("kda_f_rank", "f_b_proj", "input", None, "f_b_proj.weight"),
                Site("kda_g_rank", "g_b_proj", "input", None, "g_b_proj.weight"))

    def keep(self, cfg, score, t, p):
        """Head channels by their o_proj-input score summed over heads (one set every head keeps), then heads by
        their kept channels' norm. A head-dim cut also cuts each gate's rank to the same size (transformers ties
        it to linear_head_dim): the rank components whose contribution through f_b / g_b scores highest (Wanda:
        the component's activation norm times its f_b / g_b column norm)."""
        if "kda_heads" not in t and "kda_head_dim" not in t:
            return {}
        h, d, keep = cfg.kda.kda_num_heads, cfg.kda.kda_head_dim, {}
        s = score(p + "kda_o", (h, d), "--kda-heads/--kda-head-dim")
        ch = torch.arange(d)
        if "kda_head_dim" in t:
            n = t["kda_head_dim"]
            ch = top(s.square().sum(dim=0), n)
            keep.update({p + "kda_dim": ch,
                         **{p + f"kda_{x}_rank": top(score(p + f"kda_{x}_rank", (d,), "--kda-head-dim"), n)
                            for x in "fg"}})
        if "kda_heads" in t:
            keep[p + "kda_heads"] = top(s[:, ch].norm(dim=1), t["kda_heads"])
        return keep

    def magnitude(self, cfg, local, t):
        """q, k, v and the gates' rows, o_proj's columns, per channel; each gate's rank components by their a-rows
        and b-columns."""
        if local in ("f_b_proj.weight", "g_b_proj.weight"):
            return [("kda_o", sq(t, 0)), (f"kda_{local[0]}_rank", sq(t, 1))]
        if local in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
            return [("kda_o", sq(t, 0))]
        if local == "o_proj.weight":
            return [("kda_o", sq(t, 1))]
        if local in ("f_a_proj.weight", "g_a_proj.weight"):
            return [(f"kda_{local[0]}_rank", sq(t, 0))]
        return []

    def check_tp(self, cfg, tp, need):
        need(cfg.kda.kda_num_heads % tp == 0,
             f"tensor parallelism: kda_num_heads={cfg.kda.kda_num_heads} is not divisible by tp={tp}")


_DECLARES = (Width("kda_heads", "kda_num_heads", None, "kda_heads", None, "k.h", "KDA heads (q, k, v together)"),
             Width("kda_head_dim", "kda_head_dim", None, "kda_dim", 16, "k.hd",
                   "KDA head size (every head's same channels; also the gates' low rank, cut alike)"))
_RANK = lambda cfg, w: w["kda_head_dim"]  # noqa: E731  transformers: the gates' rank is linear_head_dim
KDA = KdaKind(
    "K", "kda",
    (*(Param(f"{x}_proj.weight", ("kda_inner", "hidden")) for x in "qkv"),
     *(Param(f"{x}_conv1d.weight", ("kda_inner", "one", "kda_conv_kernel")) for x in "qkv"),
     Param("f_a_proj.weight", ("kda_f_rank", "hidden")), Param("f_b_proj.weight", ("kda_inner", "kda_f_rank")),
     Param("dt_bias", ("kda_inner",)), Param("A_log", ("one", "one", "kda_heads", "one")),
     Param("b_proj.weight", ("kda_heads", "hidden")),
     Param("g_a_proj.weight", ("kda_g_rank", "hidden")), Param("g_b_proj.weight", ("kda_inner", "kda_g_rank")),
     Param("o_norm.weight", ("kda_dim",)), Param("o_proj.weight", ("hidden", "kda_inner"))),
    sizes={"kda_heads": lambda cfg, w: w["kda_heads"], "kda_dim": _RANK, "kda_f_rank": _RANK, "kda_g_rank": _RANK,
           "kda_inner": lambda cfg, w: w["kda_heads"] * w["kda_head_dim"],
           "kda_conv_kernel": lambda cfg, w: cfg.kda.kda_conv_kernel},
    units={"kda_heads": "kda_num_heads", "kda_dim": "kda_head_dim", "kda_f_rank": "kda_head_dim",
           "kda_g_rank": "kda_head_dim"},
    products={"kda_inner": ("kda_heads", "kda_dim")},
    scored={"kda_o": ("kda_heads", "kda_dim"), "kda_f_rank": ("kda_f_rank",), "kda_g_rank": ("kda_g_rank",)},
    widths=tuple(w.name for w in _DECLARES),
    declares=_DECLARES,
    fixed=("kda_conv_kernel",),
    tp_axes=("kda_inner", "kda_heads"), inputs=("attention_mask",), color="tab:olive",
    tp_plan={**{f"{x}_proj": "colwise" for x in ("q", "k", "v", "f_b", "g_b", "b")},
             **{f"{x}_conv1d": "shard" for x in "qkv"}, "": "shard", "o_norm": "shared_norm", "o_proj": "rowwise"},
    config=KdaConfig)
