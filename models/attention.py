"""Grouped-query self-attention through SDPA, with RoPE (Llama family) or none (Nemotron-H)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .norm import RMSNorm
from .recompute import maybe_checkpoint


def rope_inv_freq(cfg) -> torch.Tensor:
    """Inverse frequencies; the "llama3" type rescales long wavelengths as transformers does."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    mid = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return torch.where(mid, smoothed, scaled)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    recompute_core = False  # models.recompute "selective": q/k norm, RoPE and SDPA recomputed in backward

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        H, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(H, cfg.num_attention_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(H, cfg.num_key_value_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(H, cfg.num_key_value_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, H, bias=cfg.attention_out_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps)
            self.k_norm = RMSNorm(hd, cfg.norm_eps)
        if cfg.rope_theta is not None:
            self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def build_buffers(self, device):
        """RoPE frequencies (non-persistent: never in a checkpoint, rebuilt after a meta-device build)."""
        if self.cfg.rope_theta is not None:
            self.inv_freq = rope_inv_freq(self.cfg).to(device)

    def forward(self, x, attention_mask=None, position_ids=None):
        cfg = self.cfg
        b, l, _ = x.shape
        hd = cfg.head_dim  # head counts from the projections' widths: a tensor-parallel shard has fewer
        q, k, v = (t.view(b, l, t.shape[-1] // hd, hd) for t in (self.q_proj(x), self.k_proj(x), self.v_proj(x)))
        return self.o_proj(maybe_checkpoint(self, self._core, q, k, v, attention_mask, position_ids))

    def _core(self, q, k, v, attention_mask, position_ids):
        """q, k, v [b, l, heads, hd] (projection outputs) -> the o_proj input [b, l, heads * hd]."""
        cfg = self.cfg
        b, l = q.shape[:2]
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cfg.rope_theta is not None:
            pos = torch.arange(l, device=q.device) if position_ids is None else position_ids
            freqs = pos[..., None].float() * self.inv_freq.float()
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
            if cos.dim() == 3:  # per-batch positions
                cos, sin = cos[:, None], sin[:, None]
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        gqa = cfg.num_attention_heads != cfg.num_key_value_heads
        window = cfg.sliding_window is not None and l > cfg.sliding_window
        if attention_mask is None and not window:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:  # causal AND inside the window AND key not padded
            keep = torch.ones(l, l, dtype=torch.bool, device=q.device).tril()
            if window:
                keep = keep & ~torch.ones_like(keep).tril(-cfg.sliding_window)
            keep = keep[None, None]
            if attention_mask is not None:
                keep = keep & attention_mask[:, None, None, :].bool()
                keep = keep | torch.eye(l, dtype=torch.bool, device=q.device)  # no fully-masked rows
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=gqa)
        return o.transpose(1, 2).reshape(b, l, o.shape[1] * o.shape[3])
