"""Which attention computation a layer runs, and the two that MLA and sink attention share: eager (matmul, masked
softmax, matmul: the CPU path, transformers' own order of operations) and PyTorch's fused SDPA
(torch.nn.functional.scaled_dot_product_attention: FlashAttention / memory-efficient kernels on CUDA).

A module's `attn_impl` picks: "sdpa" or "eager", or None (the default): SDPA when its tensors are on CUDA, eager
otherwise. set_attn_impl(model, impl) sets it on every layer that has the choice.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import RemodelError

IMPLS = ("sdpa", "eager")


def wants_sdpa(module, t: torch.Tensor) -> bool:
    """module.attn_impl if set, else whether `t` is on CUDA."""
    impl = getattr(module, "attn_impl", None)
    return t.is_cuda if impl is None else impl == "sdpa"


def set_attn_impl(model, impl: str | None) -> None:
    """Every layer of `model` with an attn_impl choice runs `impl` ("sdpa", "eager" or None: by device)."""
    if impl is not None and impl not in IMPLS:
        raise RemodelError(f"attention implementation must be one of {', '.join(IMPLS)} or None, got {impl!r}")
    for m in model.modules():
        if hasattr(m, "attn_impl"):
            m.attn_impl = impl


def causal(l: int, device) -> torch.Tensor:
    """[1, 1, l, l] bool: key j visible from query i when j <= i."""
    return torch.ones(l, l, dtype=torch.bool, device=device).tril()[None, None]


def eager_attention(q, k, v, keep, scale: float, extra=None, softmax_dtype=torch.float32):
    """softmax(q k^T * scale where `keep` (None: causal), else -inf) v, the softmax in at least `softmax_dtype` (None:
    the logits' dtype). q, k [b, h, l, d], v [b, h, l, dv]; `extra` [.., h, 1, 1]: one more logit per query (a sink) that takes
    its share of the weight and adds no value."""
    s = (q @ k.transpose(-2, -1)) * scale
    s = s.masked_fill(~(causal(q.shape[2], q.device) if keep is None else keep), float("-inf"))
    if extra is not None:
        s = torch.cat((s, extra.to(s.dtype).expand(*s.shape[:-1], 1)), dim=-1)
    p = s.softmax(dim=-1, dtype=torch.promote_types(s.dtype, softmax_dtype or s.dtype)).to(v.dtype)
    return p[..., :k.shape[2]] @ v


def padded_sdpa(q, k, v, keep, scale: float):
    """SDPA with the q / k and v head sizes made equal (FlashAttention requires it): the smaller side zero-padded
    (zero query / key channels add nothing to q k^T; zero value channels are sliced off the output)."""
    dv, d = v.shape[-1], q.shape[-1]
    if dv < d:
        v = F.pad(v, (0, d - dv))
    elif d < dv:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=keep is None, scale=scale)
    return o[..., :dv]


def sink_sdpa(q, k, v, keep, scale: float, sinks):
    """Sink attention through SDPA: one zero key and zero value appended, the head's sink logit its additive mask
    entry (q . 0 = 0, plus the sink), -inf where `keep` (None: causal) is False. sinks [h]; q, k, v [b, h, l, d]."""
    b, h, l, _ = q.shape
    keep = causal(l, q.device) if keep is None else keep
    bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
    sink = sinks.to(q.dtype).view(1, h, 1, 1).expand(bias.shape[0], h, l, 1)
    bias = torch.cat((bias.expand(bias.shape[0], h, l, l), sink), dim=-1)
    k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
