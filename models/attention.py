"""The attention layer kind ('*'): grouped-query self-attention through SDPA, with RoPE (Llama family;
on the first `partial_rotary_factor` of each head's channels, Bamba: half) or none (Nemotron-H); its
module and its spec (ATTENTION). The gated variant (attn_output_gate) reads [query | gate] per head from q_proj
and multiplies the attention output by sigmoid(gate) before o_proj. Sinks (gpt-oss): one learned logit per head joins
each query's softmax and takes its share of the weight (no value). The full-attention kind ('F', FULL_ATTENTION)
is this kind's module, widths and section in a slot without the section's sliding window (gpt-oss's
layer_types: its sliding layers are '*')."""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .mla import yarn_attention_factor, yarn_ramp
from .norm import trunk_norm
from .recompute import maybe_checkpoint
from .sdpa import eager_attention, sink_sdpa, wants_sdpa
from .section import MAX_SMALL, Section, ints, plain, reals
from .spec import LayerKind, Param, Site, Width, sq, top_per_group


@dataclass(frozen=True)
class AttentionConfig(Section):
    """The attention kind's fields. Variants default to off: rope_theta None (no positional encoding,
    Nemotron-H), biases, per-head q/k norm (Qwen3), a sliding window (Mistral), attention_scale None
    (1/sqrt(head_dim); Granite's attention_multiplier otherwise), keys times key_multiplier (Falcon-H1)."""
    num_attention_heads: int = ints(0, 0, MAX_SMALL, raw={"num_attention_heads": 1})
    num_key_value_heads: int = ints(0, 0, MAX_SMALL, raw={"num_key_value_heads": 1})
    head_dim: int = ints(0, 0, MAX_SMALL, raw={"head_dim": 1})
    rope_theta: float | None = reals(None, gt=0, raw=("rope_theta",))
    rope_scaling: dict | None = plain(None, "HF rope_parameters beyond 'default' ('llama3' or 'yarn')")
    partial_rotary_factor: float = reals(1.0, gt=0, doc="RoPE on the first int(head_dim * this) channels")
    attention_bias: bool = plain(False, "q/k/v bias (Qwen2)")
    attention_out_bias: bool = plain(False)
    qk_norm: bool = plain(False, "per-head RMSNorm on q and k (Qwen3)")
    sliding_window: int | None = ints(None, 1, 2**40, none_ok=True, raw={"sliding_window": 0})
    attention_scale: float | None = reals(None, gt=0, variant="multipliers",
                                         raw=("attention_multiplier",))
    key_multiplier: float = reals(1.0, gt=0, variant="projections", raw=("key_multiplier",))
    attn_output_gate: bool = plain(False, "q_proj also yields a per-head output gate: o * sigmoid(gate) (Qwen3.5)",
                                   variant="attention_gate")
    qk_norm_full: bool = plain(False, "RMSNorm on the whole q and k projections, weights [heads * head_dim] "
                               "(OLMo 2, OLMo-hybrid)", variant="qk_norm_full")
    attention_sinks: bool = plain(False, "one learned sink logit per head in the softmax (gpt-oss)",
                                  variant="attention_sinks")


def rope_dim(cfg) -> int:
    """The channels of each head RoPE rotates (the first ones; transformers' int(head_dim * factor))."""
    return int(cfg.attention.head_dim * cfg.attention.partial_rotary_factor)


def rope_inv_freq(cfg) -> torch.Tensor:
    """Inverse frequencies; the "llama3" type rescales long wavelengths as transformers does."""
    d = rope_dim(cfg)
    inv = 1.0 / (cfg.attention.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.attention.rope_scaling
    if rs is None:
        return inv
    if rs.get("rope_type") == "yarn":  # transformers' _compute_yarn_parameters
        extra = yarn_ramp(rs, d, cfg.attention.rope_theta)
        return inv / rs["factor"] * (1 - extra) + inv * extra
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    mid = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return torch.where(mid, smoothed, scaled)


def rope_factor(cfg) -> float:
    """YaRN's attention_factor on cos / sin (transformers' _compute_yarn_parameters); 1 for other types."""
    rs = cfg.attention.rope_scaling
    return yarn_attention_factor(rs) if rs is not None and rs.get("rope_type") == "yarn" else 1.0


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x, cos, sin):
    """RoPE on the first cos.shape[-1] channels of x [..., head_dim]; the rest pass through."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


# ---- the variant parts: each section field that changes the forward selects one of these at build time ----

def _same_qk(attn, q, k):
    return q, k


def _norm_qk(attn, q, k):
    """q_norm / k_norm: over all heads' projections (qk_norm_full: OLMo 2, OLMo-hybrid; TP splits the weight with
    the heads) or per head (qk_norm: Qwen3), by where the forward applies it."""
    return attn.q_norm(q), attn.k_norm(k)


def _query_heads(q, hd: int):
    """q [b, l, heads * hd] -> (q [b, l, heads, hd], no gate)."""
    return q.view(*q.shape[:2], q.shape[-1] // hd, hd), None


def _query_and_gate_heads(q, hd: int):
    """attn_output_gate (Qwen3.5): each head's rows are [query | gate] -> (q, gate), [b, l, heads, hd] each."""
    q, gate = q.view(*q.shape[:2], q.shape[-1] // (2 * hd), 2 * hd).chunk(2, dim=-1)
    return q, gate


def _scaled_keys(attn, k):
    """key_multiplier (Falcon-H1): the keys times it."""
    return k * attn.cfg.attention.key_multiplier


def _same_keys(attn, k):
    return k


def _plain_out(o, gate):
    return o


def _gated_out(o, gate):
    """attn_output_gate: the heads' output times sigmoid(gate)."""
    return o * torch.sigmoid(gate.reshape(o.shape))


def _rotated(attn, q, k, position_ids):
    """RoPE (rope_theta set) on q, k [b, heads, l, hd]."""
    pos = torch.arange(q.shape[2], device=q.device) if position_ids is None else position_ids
    freqs = pos[..., None].float() * attn.inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * attn.rope_factor).to(q.dtype), (emb.sin() * attn.rope_factor).to(q.dtype)
    if cos.dim() == 3:  # per-batch positions
        cos, sin = cos[:, None], sin[:, None]
    return rotate(q, cos, sin), rotate(k, cos, sin)


def _unrotated(attn, q, k, position_ids):
    """No positional encoding (Nemotron-H's attention)."""
    return q, k


def _sdpa(attn, q, k, v, keep):
    """Softmax attention through SDPA; keep None: plain causal."""
    gqa = q.shape[1] != k.shape[1]  # head counts from the shapes (a tensor-parallel rank holds fewer)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=keep is None, enable_gqa=gqa,
                                          scale=attn.cfg.attention.attention_scale)


def _with_sinks(attn, q, k, v, keep):
    """attention_sinks (gpt-oss): each head's sink logit joins the softmax over the keys and is then dropped; eager
    on CPU, SDPA (the sink an extra zero key whose mask entry is the logit) on CUDA or as attn_impl says."""
    h = q.shape[1]
    k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    scale = attn.cfg.attention.attention_scale or q.shape[-1] ** -0.5
    if wants_sdpa(attn, q):
        return sink_sdpa(q, k, v, keep, scale, attn.sinks)
    return eager_attention(q, k, v, keep, scale, attn.sinks.view(1, h, 1, 1), softmax_dtype=None)


class Attention(nn.Module):
    """Grouped-query attention; its variants (AttentionConfig's fields) are parts chosen once, at build time."""
    recompute_core = False  # models.recompute "selective": q/k norm, RoPE and SDPA recomputed in backward
    attn_impl: str | None = None  # sink attention's path (models/sdpa.py); without sinks it is SDPA everywhere

    def __init__(self, cfg, window: int | None = None):
        super().__init__()
        self.cfg, self.window = cfg, window  # window: the slot's sliding window (None: full attention)
        H, hd = cfg.hidden_size, cfg.attention.head_dim
        self.q_proj = nn.Linear(H, ATTENTION.axis_size(cfg, "attn_qg"), bias=cfg.attention.attention_bias)
        self.k_proj = nn.Linear(H, cfg.attention.num_key_value_heads * hd, bias=cfg.attention.attention_bias)
        self.v_proj = nn.Linear(H, cfg.attention.num_key_value_heads * hd, bias=cfg.attention.attention_bias)
        self.o_proj = nn.Linear(cfg.attention.num_attention_heads * hd, H, bias=cfg.attention.attention_out_bias)
        if cfg.attention.qk_norm or cfg.attention.qk_norm_full:
            self.q_norm = trunk_norm(cfg, hd * (cfg.attention.num_attention_heads if cfg.attention.qk_norm_full else 1))
            self.k_norm = trunk_norm(cfg, hd * (cfg.attention.num_key_value_heads if cfg.attention.qk_norm_full else 1))
        if cfg.attention.rope_theta is not None:
            self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.norm_projections = _norm_qk if cfg.attention.qk_norm_full else _same_qk
        self.norm_heads = _norm_qk if cfg.attention.qk_norm else _same_qk
        self.split_query = _query_and_gate_heads if cfg.attention.attn_output_gate else _query_heads
        self.gate_output = _gated_out if cfg.attention.attn_output_gate else _plain_out
        self.position = _rotated if cfg.attention.rope_theta is not None else _unrotated
        self.scale_keys = _scaled_keys if cfg.attention.key_multiplier != 1 else _same_keys
        if cfg.attention.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(cfg.attention.num_attention_heads))
        self.attend = _with_sinks if cfg.attention.attention_sinks else _sdpa
        self.rope_factor = rope_factor(cfg)

    def build_buffers(self, device):
        """RoPE frequencies (non-persistent: never in a checkpoint, rebuilt after a meta-device build)."""
        if self.cfg.attention.rope_theta is not None:
            self.inv_freq = rope_inv_freq(self.cfg).to(device)

    def forward(self, x, attention_mask=None, position_ids=None):
        b, l, _ = x.shape
        hd = self.cfg.attention.head_dim  # head counts from the projections' widths: a tensor-parallel shard has fewer
        q, k = self.norm_projections(self, self.q_proj(x), self.k_proj(x))
        k, v = (t.view(b, l, t.shape[-1] // hd, hd) for t in (k, self.v_proj(x)))
        q, gate = self.split_query(q, hd)
        k = self.scale_keys(self, k)
        o = maybe_checkpoint(self, self._core, q, k, v, attention_mask, position_ids)
        return self.o_proj(self.gate_output(o, gate))

    def _core(self, q, k, v, attention_mask, position_ids):
        """q, k, v [b, l, heads, hd] (projection outputs) -> the o_proj input [b, l, heads * hd]."""
        b, l = q.shape[:2]
        q, k = self.norm_heads(self, q, k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = self.position(self, q, k, position_ids)
        windowed = self.window is not None and l > self.window
        keep = None if attention_mask is None and not windowed else _keep(self.window, l, attention_mask, q.device)
        o = self.attend(self, q, k, v, keep)  # causal AND inside the window AND key not padded
        return o.transpose(1, 2).reshape(b, l, o.shape[1] * o.shape[3])


def _keep(window: int | None, l: int, attention_mask, device):
    """[1 or b, 1, l, l]: causal, inside the sliding window, key not padded (a row never fully masked)."""
    keep = torch.ones(l, l, dtype=torch.bool, device=device).tril()
    if window is not None and l > window:
        keep = keep & ~torch.ones_like(keep).tril(-window)
    keep = keep[None, None]
    if attention_mask is not None:
        keep = keep & attention_mask[:, None, None, :].bool()
        keep = keep | torch.eye(l, dtype=torch.bool, device=device)  # no fully-masked rows
    return keep


@dataclass(frozen=True)
class AttentionKind(LayerKind):
    windowed: bool = True  # its slots use the section's sliding_window (False: the full-attention kind 'F')

    def slot_section(self, section):
        return section if self.windowed or section is None else section.replace(sliding_window=None)

    def build(self, cfg):
        return Attention(cfg, self.slot_section(cfg.attention).sliding_window)

    def validate(self, cfg, need):
        need(cfg.attention.num_attention_heads > 0 and cfg.attention.num_key_value_heads > 0 and cfg.attention.head_dim > 0,
             "attention layers need num_attention_heads, num_key_value_heads and head_dim > 0")
        need(not cfg.attention.qk_norm_full or not (cfg.attention.qk_norm or cfg.attention.attn_output_gate),
             "qk_norm_full (q/k norms over all heads) excludes per-head qk_norm and attn_output_gate")
        need(cfg.attention.num_attention_heads % cfg.attention.num_key_value_heads == 0,
             f"num_attention_heads={cfg.attention.num_attention_heads} is not a multiple of "
             f"num_key_value_heads={cfg.attention.num_key_value_heads}")
        if cfg.attention.rope_theta is not None:
            need(0 < cfg.attention.partial_rotary_factor <= 1, f"partial_rotary_factor must be in (0, 1], got "
                 f"{cfg.attention.partial_rotary_factor}")
            need(rope_dim(cfg) > 0 and rope_dim(cfg) % 2 == 0, f"RoPE needs an even number of rotated channels, got "
                 f"{rope_dim(cfg)} (head_dim={cfg.attention.head_dim}, partial_rotary_factor={cfg.attention.partial_rotary_factor})")
        if cfg.attention.rope_scaling is not None:
            need(cfg.attention.rope_scaling.get("rope_type") in ("llama3", "yarn"),
                 f"unsupported RoPE type {cfg.attention.rope_scaling.get('rope_type')!r} (supported: default, llama3, yarn)")

    def summary(self, cfg):
        return {"num_attention_heads": cfg.attention.num_attention_heads, "num_key_value_heads": cfg.attention.num_key_value_heads,
                "head_dim": cfg.attention.head_dim, "rope_theta": cfg.attention.rope_theta,
                **({"partial_rotary_factor": cfg.attention.partial_rotary_factor} if cfg.attention.partial_rotary_factor != 1 else {})}

    state_row = "KV cache"

    def cache_bytes(self, cfg, w, batch, seq_len, kv_bytes=2, state_bytes=4, conv_bytes=2):
        return {"kv_cache": 2 * batch * seq_len * w["kv_heads"] * w["head_dim"] * kv_bytes}

    def mixing_flops(self, cfg, seq_len):
        return 4 * seq_len * cfg.attention.num_attention_heads * cfg.attention.head_dim  # scores and values, no causal discount

    def sites(self, cfg):
        return (Site("attn", "o_proj", "input"),)

    def keep(self, cfg, score, t, p):
        if "attn_heads" not in t:
            return {}
        s = score(p + "attn", (cfg.attention.num_attention_heads, cfg.attention.head_dim), "--attn-heads")
        return {p + "attn_heads": top_per_group(s.norm(dim=1), cfg.attention.num_key_value_heads, t["attn_heads"])}

    def magnitude(self, cfg, local, t):
        if local == "o_proj.weight":
            return [("attn", sq(t, 1))]
        if local in ("q_proj.weight", "q_proj.bias"):  # a gated head's query and gate rows add up
            s = sq(t, 0)
            return [("attn", s.view(cfg.attention.num_attention_heads, -1, cfg.attention.head_dim).sum(1).flatten())]
        return []

    def check_tp(self, cfg, tp, need):
        need(cfg.attention.num_key_value_heads % tp == 0, f"tensor parallelism: num_key_value_heads="
             f"{cfg.attention.num_key_value_heads} is not divisible by tp={tp}")


ATTENTION = AttentionKind(
    "*", "attention",
    (Param("q_proj.weight", ("attn_qg", "hidden")), Param("q_proj.bias", ("attn_qg",), ("attention_bias",)),
     Param("k_proj.weight", ("attn_kv", "hidden")), Param("k_proj.bias", ("attn_kv",), ("attention_bias",)),
     Param("v_proj.weight", ("attn_kv", "hidden")), Param("v_proj.bias", ("attn_kv",), ("attention_bias",)),
     Param("o_proj.weight", ("hidden", "attn_q")), Param("o_proj.bias", ("hidden",), ("attention_out_bias",)),
     Param("q_norm.weight", ("head_dim",), ("qk_norm",)), Param("k_norm.weight", ("head_dim",), ("qk_norm",)),
     Param("q_norm.weight", ("attn_q",), ("qk_norm_full",)), Param("k_norm.weight", ("attn_kv",), ("qk_norm_full",)),
     Param("sinks", ("attn_heads",), ("attention_sinks",))),
    # q_proj rows: per head its query (and, gated, then its gate): heads x attn_qg_head
    sizes={"attn_q": lambda cfg, w: w["attn_heads"] * w["head_dim"], "attn_kv": lambda cfg, w: w["kv_heads"] * w["head_dim"],
           "attn_qg": lambda cfg, w: w["attn_heads"] * w["head_dim"] * (2 if cfg.attention.attn_output_gate else 1),
           "attn_qg_head": lambda cfg, w: w["head_dim"] * (2 if cfg.attention.attn_output_gate else 1),
           "head_dim": lambda cfg, w: w["head_dim"], "attn_heads": lambda cfg, w: w["attn_heads"]},
    units={"attn_heads": "num_attention_heads"},
    products={"attn_q": ("attn_heads", "head_dim"), "attn_qg": ("attn_heads", "attn_qg_head")},
    scored={"attn": ("attn_heads", "head_dim")}, widths=("attn_heads", "kv_heads", "head_dim"),
    declares=(Width("attn_heads", "num_attention_heads", None, "attn_heads", None, "a.heads",
                    "query heads per attention layer (a multiple of num_key_value_heads)",
                    multiple_of="num_key_value_heads", why=" (every KV group keeps the same number of query heads)"),
              Width("kv_heads", "num_key_value_heads", None, None, None, "kv", "key/value heads"),
              Width("head_dim", "head_dim", None, None, None, "hd", "attention head size")),
    fixed=("attn_kv", "head_dim"),
    tp_axes=("attn_q", "attn_qg", "attn_kv", "attn_heads"), inputs=("attention_mask", "position_ids"), color="tab:orange",
    tp_plan={"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
             "q_norm": "shared_norm", "k_norm": "shared_norm", "": "shard"}, config=AttentionConfig)  # '': sinks
FULL_ATTENTION = dataclasses.replace(ATTENTION, char="F", name="attention_full", windowed=False, declares=(), config=None,
                                     section="attention")  # gpt-oss's full_attention layers beside its sliding ones
