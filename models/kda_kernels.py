"""The numerics of Kimi Delta Attention (KDA): the gated delta rule with a per-channel decay, by chunks in pure
PyTorch, and fla-core's `chunk_kda` on CUDA where it imports.

Per head, with q, k L2-normalised and q scaled by d**-0.5, the state S [d, d] follows
    S_t = diag(exp(g_t)) S_{t-1} + k_t beta_t (v_t - (diag(exp(g_t)) S_{t-1})^T k_t)^T,    o_t = S_t^T q_t
where g_t [d] <= 0 is the log decay of each key channel (the Gated DeltaNet's g is one number per head).
Numerics follow transformers' `kimi_linear` torch path (fp32 inside, output in the input dtype; float64 stays
float64). USE_KERNEL = False keeps the pure path on CUDA.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .gdn_kernels import FLA_MAX_KEY_DIM, l2norm
from .mamba import optional_import
from .mamba_kernels import compute_dtype

USE_KERNEL = True  # False: the pure-PyTorch chunked rule on CUDA even with fla-core installed
FLA_KERNEL = ("fla.ops.kda", "chunk_kda")


@functools.lru_cache(maxsize=None)
def fla_kernel():
    """fla-core's Triton `chunk_kda`, or None where it does not import (imported on first use)."""
    return optional_import(*FLA_KERNEL)


def on_gpu(t) -> bool:
    """Whether the tensors are where fla's kernel runs (the tests force this on CPU tensors)."""
    return t.is_cuda


def _kernel(q):
    """fla's kernel for q, or None: off, not on the GPU, not installed, float64 or a head dim over fla's bound."""
    if not USE_KERNEL or not on_gpu(q) or q.dtype == torch.float64 or q.shape[-1] > FLA_MAX_KEY_DIM:
        return None
    return fla_kernel()


def _chunks(x, size: int):
    """[b, l, h, d] -> [b, h, c, size, d], zero padded at the end to whole chunks (padded steps: k, beta and
    g zero, so they leave the state alone)."""
    pad = (-x.shape[1]) % size
    return F.pad(x.transpose(1, 2), (0, 0, 0, pad)).unflatten(2, (-1, size))


def _pairwise(a, b, decay):
    """sum_d a_id b_jd decay_ijd over a chunk: [.., C, d] x [.., C, d] x [.., C, C, d] -> [.., C, C]."""
    return torch.einsum("...id,...jd,...ijd->...ij", a, b, decay)


def chunk_kda_torch(q, k, v, g, beta, chunk_size: int = 64, initial_state=None):
    """The KDA rule by chunks in pure PyTorch (differentiable). Within a chunk in WY form: T = I +
    strictly_lower((beta k) k^T o decay) per channel, U = T^-1 (beta v), W = T^-1 (beta k exp(cum)); the value
    written at step i is U_i - W_i S0 for the entering state S0. q, k, v, g [b, l, h, d], beta [b, l, h],
    initial_state [b, h, d, d] or None -> (out [b, l, h, d] in q's dtype, final state in the compute dtype)."""
    b, l, h, dv = v.shape
    cd, dtype, c = compute_dtype(v), q.dtype, chunk_size
    q = l2norm(q.to(cd)) * q.shape[-1] ** -0.5
    q, k, v, g = (_chunks(x, c) for x in (q, l2norm(k.to(cd)), v.to(cd), g.to(cd)))
    beta = _chunks(beta.to(cd)[..., None], c)[..., 0]
    cum = g.cumsum(-2)  # [b, h, n, C, d]: each channel's log decay from the chunk's start through each step
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None, :] - cum[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    kb = k * beta[..., None]
    t = _pairwise(kb, k, decay)  # only its strictly lower part is read (unitriangular solve)
    solve = functools.partial(torch.linalg.solve_triangular, t, upper=False, unitriangular=True)
    big_u, big_w = solve(v * beta[..., None]), solve(kb * cum.exp())
    attn = _pairwise(q, k, decay)
    q_in, k_out = q * cum.exp(), k * (cum[..., -1:, :] - cum).exp()
    state = v.new_zeros(b, h, k.shape[-1], dv) if initial_state is None else initial_state.to(v)
    outs = []
    for u_in, w, q_i, attn_i, k_i, end in zip(*(x.unbind(2) for x in (big_u, big_w, q_in, attn, k_out,
                                                                       cum[..., -1, :].exp()))):
        u = u_in - w @ state
        outs.append(q_i @ state + attn_i @ u)
        state = state * end[..., None] + k_i.transpose(-1, -2) @ u
    out = torch.cat(outs, dim=2)[:, :, :l].transpose(1, 2)
    return out.to(dtype), state


def chunk_kda(q, k, v, g, beta, chunk_size: int = 64, initial_state=None):
    """The KDA rule: fla-core's Triton `chunk_kda` on CUDA where it imports and fits (it normalises q, k itself:
    use_qk_l2norm_in_kernel; same [b, l, h, d] layout), else `chunk_kda_torch`. -> (out, final state)."""
    fla = _kernel(q)
    if fla is None:
        return chunk_kda_torch(q, k, v, g, beta, chunk_size, initial_state)
    return fla(q, k, v, g.float(), beta, scale=q.shape[-1] ** -0.5, initial_state=initial_state,
               output_final_state=True, use_qk_l2norm_in_kernel=True)


def sigmoid_gated_rms_norm(x, gate, weight, eps: float):
    """Kimi Linear's gated RMSNorm over each head's channels: x normalised in the compute dtype, times weight and
    sigmoid(gate) there too (no rounding in between), out in x's dtype."""
    cd = compute_dtype(x)
    xf = x.to(cd)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(cd) * xf * torch.sigmoid(gate.to(cd))).to(x.dtype)
