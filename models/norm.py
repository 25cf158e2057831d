"""RMSNorm computed in float32, as transformers does (forward bit-identical; hand-written backward)."""
import torch
from torch import nn


class _RMSNorm(torch.autograd.Function):
    """w * (x * rsqrt(mean(x^2) + eps)) in fp32; backward from x and 1/rms (fewer passes than autograd)."""

    @staticmethod
    def forward(ctx, x, w, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, w, rstd)
        return (w.float() * (xf * rstd)).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        dy = dy.float()
        dw = (dy * xhat).sum(tuple(range(dy.dim() - 1))) if ctx.needs_input_grad[1] else None
        dxh = dy * w.float()
        dx = (dxh - xhat * (dxh * xhat).mean(-1, keepdim=True)).mul_(rstd)
        return dx.to(x.dtype), (dw.to(w.dtype) if dw is not None else None), None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return _RMSNorm.apply(x, self.weight, self.eps)
