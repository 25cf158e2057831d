"""RMSNorm computed in float32, as transformers does (forward bit-identical; hand-written backward).
`offset` 1: the zero-centred variant (Qwen3-Next / Qwen3.5), which stores w and scales by (1 + w) in fp32."""
import torch
from torch import nn


def _compute(x: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 / bf16 / fp16 (transformers' float()); float64 stays float64."""
    return torch.promote_types(x.dtype, torch.float32)


class _RMSNorm(torch.autograd.Function):
    """w * (x * rsqrt(mean(x^2) + eps)) in fp32; backward from x and 1/rms (fewer passes than autograd)."""

    @staticmethod
    def forward(ctx, x, w, eps):
        cd = _compute(x)
        xf = x.to(cd)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, w, rstd)
        return (w.to(cd) * (xf * rstd)).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        cd = _compute(x)
        xhat = x.to(cd) * rstd
        dy = dy.to(cd)
        dw = (dy * xhat).sum(tuple(range(dy.dim() - 1))) if ctx.needs_input_grad[1] else None
        dxh = dy * w.to(cd)
        dx = (dxh - xhat * (dxh * xhat).mean(-1, keepdim=True)).mul_(rstd)
        return dx.to(x.dtype), (dw.to(w.dtype) if dw is not None else None), None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full((size,), 1.0 - offset))
        self.eps, self.offset = eps, offset

    def forward(self, x):
        return _RMSNorm.apply(x, scale_of(self.weight, self.offset), self.eps)


def scale_of(w: torch.Tensor, offset: float) -> torch.Tensor:
    """What a norm multiplies by: its weight, or (offset + w) in fp32 for the zero-centred variant."""
    return w if offset == 0 else w.to(_compute(w)) + offset


def trunk_norm(cfg, size: int | None = None) -> RMSNorm:
    """The model's RMSNorm over `size` channels (default hidden): every block, final and q/k norm, with
    cfg.norm_offset (the zero-centred variant) and cfg.norm_eps."""
    return RMSNorm(cfg.hidden_size if size is None else size, cfg.norm_eps, cfg.norm_offset)
