"""The multi-head latent attention layer kind ('L'): DeepSeek-V2 / V3's MLA (transformers' `DeepseekV3Attention`);
its config section, module and spec (MLA).

Queries: q_proj (hidden -> heads x (nope + rope)) or, with q_lora_rank, q_a_proj -> q_a_layernorm -> q_b_proj.
Keys / values: kv_a_proj_with_mqa (hidden -> kv_lora_rank latent | qk_rope_head_dim k_pe), the latent through
kv_a_layernorm and kv_b_proj (-> heads x (k_nope | v)); k_pe is one RoPE'd key part shared by every head. Each head
attends with [q_nope | rope(q_pe)] . [k_nope | rope(k_pe)] at scale (nope + rope)**-0.5, causal and padding-masked
as the attention kind ('*'), and its v_head_dim values go to o_proj. RoPE is the default type on qk_rope_head_dim
channels, interleaved pairs (x0, x1), (x2, x3), ... when rope_interleave (DeepSeek's layout) else rotate-half.
Heads prune together: their q_b_proj / q_proj rows, kv_b_proj rows and o_proj columns. So do, the same channels
in every head, v_head_dim (kv_b_proj's v rows, o_proj's columns) and qk_nope_head_dim (the q and kv_b_proj k rows;
the softmax scale follows the width, as transformers derives it); kv_lora_rank and q_lora_rank cut the latent (its
a-projection rows, its norm, its b-projection columns). qk_rope_head_dim stays: k_pe is one key part shared by every
head and its RoPE frequencies are set by its width. The low-rank a-projections and their norms are shared by all heads (replicated under tensor parallelism; the latent's gradient
is summed by kv_b_proj's / q_b_proj's colwise entry, k_pe's by k_pe_entry). Pure PyTorch: eager on CPU, SDPA on
CUDA (models/sdpa.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .norm import RMSNorm
from .sdpa import eager_attention, padded_sdpa, wants_sdpa
from .section import MAX_SMALL, MAX_WIDTH, Section, ints, plain, reals
from .spec import LayerKind, Param, Site, Width, sq, top


@dataclass(frozen=True)
class MlaConfig(Section):
    """MLA's fields (transformers' deepseek_v3 names; its own head count and RoPE)."""
    mla_num_heads: int = ints(0, 0, MAX_SMALL, raw={"num_attention_heads": 1})
    q_lora_rank: int | None = ints(None, 1, MAX_WIDTH, none_ok=True, raw={"q_lora_rank": 1})
    kv_lora_rank: int = ints(0, 0, MAX_WIDTH, raw={"kv_lora_rank": 1})
    qk_nope_head_dim: int = ints(0, 0, MAX_SMALL, raw={"qk_nope_head_dim": 0})
    qk_rope_head_dim: int = ints(0, 0, MAX_SMALL, raw={"qk_rope_head_dim": 0})
    v_head_dim: int = ints(0, 0, MAX_SMALL, raw={"v_head_dim": 1})
    mla_rope_theta: float = reals(10000.0, gt=0, raw=("rope_theta",))
    mla_rope_scaling: dict | None = plain(None, "HF rope_parameters of a 'yarn' RoPE (None: the default type)")
    rope_interleave: bool = plain(True, "RoPE on interleaved channel pairs (DeepSeek's layout) else rotate-half")
    mla_bias: bool = plain(False, "biases of q_a_proj, kv_a_proj_with_mqa and o_proj (attention_bias)")
    mla_rope: bool = plain(True, "RoPE on the qk_rope_head_dim channels (False: none, as Kimi Linear's MLA)")


LATENT_EPS = 1e-6  # the latent norms' eps: transformers builds them with RMSNorm's default, whatever rms_norm_eps says


def latent_norm(cfg, size: int) -> RMSNorm:
    """q_a_layernorm / kv_a_layernorm: the model's RMSNorm (its offset) with LATENT_EPS."""
    return RMSNorm(size, LATENT_EPS, cfg.norm_offset)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's mscale (transformers' yarn_get_mscale): 0.1 * m * ln(scale) + 1, 1 for scale <= 1."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_ramp(rs: dict, d: int, base: float) -> torch.Tensor:
    """YaRN's per-frequency extrapolation weight (1: the unscaled frequency) over the d // 2 frequencies."""
    old = rs["original_max_position_embeddings"]
    low, high = (d * math.log(old / (r * 2 * math.pi)) / (2 * math.log(base))
                 for r in (rs.get("beta_fast") or 32, rs.get("beta_slow") or 1))
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high
    return 1 - ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)


def mla_inv_freq(cfg) -> torch.Tensor:
    """RoPE's inverse frequencies over qk_rope_head_dim: the default type, or YaRN's blend of the unscaled and the
    factor-scaled ones (transformers' _compute_yarn_parameters, head_dim = qk_rope_head_dim as deepseek_v3 sets)."""
    d, base, rs = cfg.mla.qk_rope_head_dim, cfg.mla.mla_rope_theta, cfg.mla.mla_rope_scaling
    pos = base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    if rs is None:
        return 1.0 / pos
    extra = yarn_ramp(rs, d, base)
    return 1.0 / (rs["factor"] * pos) * (1 - extra) + 1.0 / pos * extra


def mla_rope_factor(cfg) -> float:
    """YaRN's attention_factor on cos / sin (1 for the default type)."""
    rs = cfg.mla.mla_rope_scaling
    return 1.0 if rs is None else yarn_attention_factor(rs)


def yarn_attention_factor(rs: dict) -> float:
    """YaRN's attention_factor on cos / sin (transformers' _compute_yarn_parameters): given, or from the mscales."""
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return yarn_mscale(rs["factor"], rs["mscale"]) / yarn_mscale(rs["factor"], rs["mscale_all_dim"])
    return yarn_mscale(rs["factor"])


def mla_scale(cfg) -> float:
    """The softmax scale: (nope + rope)**-0.5, times YaRN's mscale(factor, mscale_all_dim)**2 where set
    (transformers' yarn_apply_mscale)."""
    c = cfg.mla
    s = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    if c.mla_rope_scaling is not None and c.mla_rope_scaling.get("mscale_all_dim"):
        s = s * yarn_mscale(c.mla_rope_scaling["factor"], c.mla_rope_scaling["mscale_all_dim"]) ** 2
    return s


def rope_interleaved(x, cos, sin):
    """transformers' apply_rotary_pos_emb_interleave on one tensor: pair (x[2i], x[2i+1]) rotated by angle i,
    the outputs laid out [rotated evens | rotated odds]; cos / sin hold the per-pair angle (half width)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_half(x, cos, sin):
    """Rotate-half RoPE (transformers' apply_rotary_pos_emb) with per-pair angles cos / sin."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return x * c + torch.cat((-x2, x1), dim=-1) * s


def causal_padding_mask(l: int, attention_mask, device):
    """[b, 1, l, l]: causal and key not padded; a row never fully masked (a padded query sees itself)."""
    keep = torch.ones(l, l, dtype=torch.bool, device=device).tril()[None, None]
    keep = keep & attention_mask[:, None, None, :].bool()
    return keep | torch.eye(l, dtype=torch.bool, device=device)


class Mla(nn.Module):
    """x [b, l, hidden] -> [b, l, hidden]. Head counts come from the projections (a TP rank holds fewer).
    attn_impl (models/sdpa.py): None runs SDPA on CUDA, with the v head padded to the q / k one, and eager on CPU."""
    attn_impl: str | None = None

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        c, H = cfg.mla, cfg.hidden_size
        n, qk = c.mla_num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(H, n * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, c.q_lora_rank, bias=c.mla_bias)
            self.q_a_layernorm = latent_norm(cfg, c.q_lora_rank)
            self.q_b_proj = nn.Linear(c.q_lora_rank, n * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.mla_bias)
        self.kv_a_layernorm = latent_norm(cfg, c.kv_lora_rank)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, n * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * c.v_head_dim, H, bias=c.mla_bias)
        self.k_pe_entry = nn.Identity()  # under TP, k_pe enters the heads' region here: its gradient is summed
        self.register_buffer("inv_freq", mla_inv_freq(cfg), persistent=False)
        self.rope = rope_interleaved if c.rope_interleave else rope_half
        self.rope_factor, self.scale = mla_rope_factor(cfg), mla_scale(cfg)

    def build_buffers(self, device):
        """RoPE frequencies (non-persistent: rebuilt after a meta-device build)."""
        self.inv_freq = mla_inv_freq(self.cfg).to(device)

    def queries(self, x):
        if self.cfg.mla.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x, attention_mask=None, position_ids=None):
        c = self.cfg.mla
        b, l, _ = x.shape
        nope, rd, vd = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = self.queries(x).view(b, l, -1, nope + rd).transpose(1, 2)
        q_pass, q_rot = q.split([nope, rd], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, rd], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, l, -1, nope + vd).transpose(1, 2)
        k_pass, v = kv.split([nope, vd], dim=-1)
        pos = torch.arange(l, device=x.device) if position_ids is None else position_ids
        freqs = pos[..., None].float() * self.inv_freq.float()
        cos, sin = (freqs.cos() * self.rope_factor).to(q.dtype), (freqs.sin() * self.rope_factor).to(q.dtype)
        if cos.dim() == 3:  # per-batch positions
            cos, sin = cos[:, None], sin[:, None]
        k_rot = self.k_pe_entry(k_rot)[:, None]
        if c.mla_rope:
            q_rot, k_rot = self.rope(q_rot, cos, sin), self.rope(k_rot, cos, sin)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(-1, k_pass.shape[1], -1, -1)), dim=-1)
        mask = None if attention_mask is None else causal_padding_mask(l, attention_mask, x.device)
        o = (padded_sdpa if wants_sdpa(self, q) else eager_attention)(q, k, v, mask, self.scale)
        return self.o_proj(o.transpose(1, 2).reshape(b, l, -1))


class MlaKind(LayerKind):
    def build(self, cfg):
        return Mla(cfg)

    def validate(self, cfg, need):
        c = cfg.mla
        need(c.mla_num_heads > 0 and c.kv_lora_rank > 0 and c.v_head_dim > 0,
             "MLA layers need mla_num_heads, kv_lora_rank and v_head_dim > 0")
        need(not c.mla_rope or (c.qk_rope_head_dim > 0 and c.qk_rope_head_dim % 2 == 0),
             f"MLA needs an even qk_rope_head_dim > 0, got {c.qk_rope_head_dim}")
        rs = c.mla_rope_scaling
        if rs is not None:
            need(rs.get("rope_type") == "yarn" and all(isinstance(rs.get(k), (int, float)) and rs[k] > 0
                                                       for k in ("factor", "original_max_position_embeddings")),
                 f"MLA RoPE scaling must be 'yarn' with factor and original_max_position_embeddings > 0, got {rs}")

    def summary(self, cfg):
        c = cfg.mla
        return {"mla_num_heads": c.mla_num_heads, "q_lora_rank": c.q_lora_rank, "kv_lora_rank": c.kv_lora_rank,
                "qk_nope_head_dim": c.qk_nope_head_dim, "qk_rope_head_dim": c.qk_rope_head_dim,
                "v_head_dim": c.v_head_dim, "rope_theta": c.mla_rope_theta}

    state_row = "KV cache"

    def cache_bytes(self, cfg, w, batch, seq_len, kv_bytes=2, state_bytes=4, conv_bytes=2):
        """transformers' cache holds, per token, the normed latent (kv_lora_rank) and the RoPE'd k_pe
        (qk_rope_head_dim), each as one head: the heads' keys and values are expanded from them on every step."""
        return {"kv_cache": batch * seq_len * (w["kv_lora_rank"] + cfg.mla.qk_rope_head_dim) * kv_bytes}

    def mixing_flops(self, cfg, seq_len):
        c = cfg.mla
        return 2 * seq_len * c.mla_num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)

    def sites(self, cfg):
        """Per (head, value channel) at o_proj's input; per (head, channel) of the queries and of kv_b_proj's
        keys / values; per latent channel at kv_b_proj's (q_b_proj's) input times its weight column's norm."""
        q = "q_proj" if cfg.mla.q_lora_rank is None else "q_b_proj"
        out = (Site("mla", "o_proj", "input"), Site("mla_query", q, "output"),
               Site("mla_keyval", "kv_b_proj", "output"),
               Site("mla_kv_latent", "kv_b_proj", "input", None, "kv_b_proj.weight"))
        return out + ((Site("mla_q_latent", "q_b_proj", "input", None, "q_b_proj.weight"),) if q == "q_b_proj" else ())

    def keep(self, cfg, score, t, p):
        """Value channels by their o_proj-input norm over heads, then heads by their kept channels'; no-RoPE
        query / key channels by |q| x |k| (what a channel adds to the logits) over heads; latent channels by their
        Wanda scores. Every head keeps the same channels."""
        c, n, flags = cfg.mla, cfg.mla.mla_num_heads, "--" + "/--".join(x.replace("_", "-") for x in self.widths)
        nope, keep = c.qk_nope_head_dim, {}
        if "mla_heads" in t or "v_head_dim" in t:
            s = score(p + "mla", (n, c.v_head_dim), flags)
            vch = top(s.norm(dim=0), t["v_head_dim"]) if "v_head_dim" in t else torch.arange(c.v_head_dim)
            keep.update({p + "mla_v_dim": vch} if "v_head_dim" in t else {})
            keep.update({p + "mla_heads": top(s[:, vch].norm(dim=1), t["mla_heads"])} if "mla_heads" in t else {})
        if "qk_nope_head_dim" in t:
            q = score(p + "mla_query", (n, nope + c.qk_rope_head_dim), flags)[:, :nope]
            k = score(p + "mla_keyval", (n, nope + c.v_head_dim), flags)[:, :nope]
            keep[p + "mla_nope"] = top((q * k).norm(dim=0), t["qk_nope_head_dim"])
        for width, site, unit in (("kv_lora_rank", "mla_kv_latent", "mla_kv_rank"),
                                  ("q_lora_rank", "mla_q_latent", "mla_q_rank")):
            if width in t:
                keep[p + unit] = top(score(p + site, (getattr(c, width),), flags), t[width])
        return keep

    def magnitude(self, cfg, local, t):
        """o_proj columns per (head, value channel); the query and kv_b_proj rows per (head, channel) and, spread
        over its value channels, per head; the latents' a-projection rows and b-projection columns."""
        n, R = cfg.mla.mla_num_heads, cfg.mla.kv_lora_rank
        if local == "o_proj.weight":
            return [("mla", sq(t, 1))]
        out = []
        if local in ("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight"):  # a head's rows add to its v channels
            s = sq(t, 0).view(n, -1).sum(1, keepdim=True) / cfg.mla.v_head_dim
            out = [("mla", s.expand(n, cfg.mla.v_head_dim).flatten()),
                   ("mla_keyval" if local == "kv_b_proj.weight" else "mla_query", sq(t, 0))]
        if local in ("kv_b_proj.weight", "q_b_proj.weight"):
            out.append(("mla_kv_latent" if local == "kv_b_proj.weight" else "mla_q_latent", sq(t, 1)))
        if local.startswith("kv_a_proj_with_mqa."):
            out.append(("mla_kv_latent", sq(t, 0)[:R]))
        if local.startswith("q_a_proj."):
            out.append(("mla_q_latent", sq(t, 0)))
        return out

    def check_tp(self, cfg, tp, need):
        need(cfg.mla.mla_num_heads % tp == 0, f"tensor parallelism: the MLA's mla_num_heads={cfg.mla.mla_num_heads} "
             f"is not divisible by tp={tp}")


_QK = lambda cfg, w: w["qk_nope_head_dim"] + cfg.mla.qk_rope_head_dim  # noqa: E731
_DECLARES = (Width("mla_heads", "mla_num_heads", None, "mla_heads", None, "mla.heads", "heads per MLA layer"),
             Width("v_head_dim", "v_head_dim", None, "mla_v_dim", 16, "mla.vd", "MLA value head size"),
             Width("qk_nope_head_dim", "qk_nope_head_dim", None, "mla_nope", 16, "mla.nope",
                   "MLA query / key head size without RoPE (qk_rope_head_dim stays: k_pe is one key part every "
                   "head shares)"),
             Width("kv_lora_rank", "kv_lora_rank", None, "mla_kv_rank", 64, "mla.kvr", "MLA key / value latent rank"),
             Width("q_lora_rank", "q_lora_rank", None, "mla_q_rank", 64, "mla.qr", "MLA query latent rank",
                   absent="query latent (q_lora_rank: its queries are one q_proj)"))
MLA = MlaKind(
    "L", "mla",
    (Param("q_proj.weight", ("mla_q", "hidden"), ("mla_q_direct",)),
     Param("q_a_proj.weight", ("mla_q_rank", "hidden"), ("q_lora_rank",)),
     Param("q_a_proj.bias", ("mla_q_rank",), ("q_lora_rank", "mla_bias")),
     Param("q_a_layernorm.weight", ("mla_q_rank",), ("q_lora_rank",)),
     Param("q_b_proj.weight", ("mla_q", "mla_q_rank"), ("q_lora_rank",)),
     Param("kv_a_proj_with_mqa.weight", ("mla_kv_a", "hidden")),
     Param("kv_a_proj_with_mqa.bias", ("mla_kv_a",), ("mla_bias",)),
     Param("kv_a_layernorm.weight", ("mla_kv_rank",)),
     Param("kv_b_proj.weight", ("mla_kv", "mla_kv_rank")),
     Param("o_proj.weight", ("hidden", "mla_o")), Param("o_proj.bias", ("hidden",), ("mla_bias",))),
    sizes={"mla_heads": lambda cfg, w: w["mla_heads"], "mla_nope": lambda cfg, w: w["qk_nope_head_dim"],
           "mla_v_dim": lambda cfg, w: w["v_head_dim"],
           "mla_q": lambda cfg, w: w["mla_heads"] * _QK(cfg, w),
           "mla_kv": lambda cfg, w: w["mla_heads"] * (w["qk_nope_head_dim"] + w["v_head_dim"]),
           "mla_o": lambda cfg, w: w["mla_heads"] * w["v_head_dim"],
           "mla_q_rank": lambda cfg, w: w["q_lora_rank"] or 0, "mla_kv_rank": lambda cfg, w: w["kv_lora_rank"],
           "mla_rope": lambda cfg, w: cfg.mla.qk_rope_head_dim},
    # per head, q rows are [no-RoPE | RoPE] channels and kv_b_proj rows [k no-RoPE | v]; kv_a_proj's [latent | k_pe]
    segments={"mla_kv_a": (("latent", "mla_kv_rank"), ("k_pe", "mla_rope")),
              "mla_qk_head": (("nope", "mla_nope"), ("rope", "mla_rope")),
              "mla_kv_head": (("k_nope", "mla_nope"), ("v", "mla_v_dim"))},
    units={"mla_heads": "mla_num_heads", "mla_v_dim": "v_head_dim", "mla_nope": "qk_nope_head_dim",
           "mla_kv_rank": "kv_lora_rank", "mla_q_rank": "q_lora_rank"},
    products={"mla_q": ("mla_heads", "mla_qk_head"), "mla_kv": ("mla_heads", "mla_kv_head"),
              "mla_o": ("mla_heads", "mla_v_dim")},
    scored={"mla": ("mla_heads", "mla_v_dim"), "mla_query": ("mla_heads", "mla_qk_head"),
            "mla_keyval": ("mla_heads", "mla_kv_head"), "mla_kv_latent": ("mla_kv_rank",),
            "mla_q_latent": ("mla_q_rank",)},
    widths=tuple(w.name for w in _DECLARES), declares=_DECLARES,
    fixed=("mla_rope",),  # k_pe: one RoPE'd key part shared by every head, its frequencies set by its width
    tp_axes=("mla_q", "mla_kv", "mla_o"), inputs=("attention_mask", "position_ids"), color="tab:red",
    tp_plan={"q_proj": "colwise", "q_b_proj": "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise",
             "k_pe_entry": "shard_entry"},  # k_pe serves every head: a parameter-free entry of the parallel region
    config=MlaConfig)
