"""The numerics of the Gated DeltaNet mixer: the gated delta rule (chunked and token by token), the q/k L2
norm and the gated RMSNorm, as functions the layer kind composes.

Per value head, with q, k L2-normalised and q scaled by dk**-0.5, the state S [dk, dv] follows
    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t
(g <= 0 the log decay, beta the write strength). Value heads are grouped under key heads as query heads
under KV heads in GQA: value head h reads key head h // (Hv // Hk). Numerics follow transformers'
`qwen3_5` torch path (fp32 inside, output in the input dtype; float64 stays float64).
On CUDA `chunk_gated_delta_rule` runs fla-core's Triton kernel when it imports (USE_KERNEL = False: never).
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from .mamba import optional_import
from .mamba_kernels import compute_dtype

USE_KERNEL = True  # False: the pure-PyTorch chunked rule on CUDA even with fla-core installed
FLA_KERNEL = ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
FLA_MAX_KEY_DIM = 256  # fla's chunk kernels assert K <= 256


@functools.lru_cache(maxsize=None)
def fla_kernel():
    """fla-core's Triton `chunk_gated_delta_rule`, or None where it does not import (imported on first use)."""
    return optional_import(*FLA_KERNEL)


def _on_gpu(t) -> bool:
    """Whether the tensors are where fla's kernel runs (the tests force this on CPU tensors)."""
    return t.is_cuda


@functools.lru_cache(maxsize=None)
def fla_backward_refused() -> str | None:
    """fla-core's own reason to refuse the gated chunk backward on this machine, or None. fla 0.6 raises in
    `chunk_bwd_dqkwg` on Hopper with Triton >= 3.4.0 and < 3.7.1 (wrong results there, fla issue 640) unless
    its TileLang backend is usable; seen on an H200 with torch 2.11's Triton 3.6.0 (2026-11-28)."""
    try:
        import fla.utils as fu
        from fla.backends import TileLangBackend
    except Exception:
        return None
    flags = [getattr(fu, n, False) for n in ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1")]
    if not (flags[0] and flags[1] and not flags[2]) or _tilelang_usable(TileLangBackend):
        return None
    return "fla-core refuses the gated delta rule's backward on Hopper with Triton < 3.7.1 and no TileLang"


def _tilelang_usable(backend) -> bool:
    try:
        return bool(backend.is_available() and backend.is_enabled())
    except Exception:
        return False


def _kernel(q, *tensors):
    """The fla kernel for these inputs, or None: off (USE_KERNEL), not CUDA, not installed, unfit (float64,
    which Triton's dots do not take; a key head dim over FLA_MAX_KEY_DIM), or a backward ahead (a tensor that
    requires grad, grad mode on) that fla refuses here (`fla_backward_refused`: the pure path, warned once)."""
    if not USE_KERNEL or not _on_gpu(q) or q.dtype == torch.float64 or q.shape[-1] > FLA_MAX_KEY_DIM:
        return None
    kernel = fla_kernel()
    if kernel is not None and torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                              for t in (q, *tensors)):
        reason = fla_backward_refused()
        if reason:
            _warn_once(reason + ": the pure-PyTorch gated delta rule is used where gradients are needed "
                       "(upgrade Triton to >= 3.7.1 or install tilelang for fla's kernel)")
            return None
    return kernel


@functools.lru_cache(maxsize=None)
def _warn_once(message: str):
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def l2norm(x, eps: float = 1e-6):
    """x / sqrt(sum(x^2) + eps) over the last dim, as transformers and fla-core compute it."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _queries_keys(q, k, heads: int, cd):
    """q, k [b, l, Hk, dk] -> [b, l, heads, dk] in dtype cd: L2-normalised, q scaled by dk**-0.5, each
    key head repeated for the heads // Hk value heads of its group (value head h reads key head h // group)."""
    group = heads // k.shape[2]
    q = l2norm(q.to(cd)) * q.shape[-1] ** -0.5
    k = l2norm(k.to(cd))
    return q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)


def _state(initial_state, b, h, dk, dv, like):
    """The state entering the sequence: initial_state [b, Hv, dk, dv] in like's dtype, or zeros."""
    if initial_state is None:
        return like.new_zeros(b, h, dk, dv)
    return initial_state.to(like)


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None):
    """The gated delta rule token by token, the readable reference the chunked form is held to.
    q, k [b, l, Hk, dk], v [b, l, Hv, dv], g, beta [b, l, Hv], initial_state [b, Hv, dk, dv] or None
    -> (out [b, l, Hv, dv] in q's dtype, final state [b, Hv, dk, dv] in the compute dtype)."""
    b, l, h, dv = v.shape
    cd, dtype = compute_dtype(v), q.dtype
    q, k = _queries_keys(q, k, h, cd)
    v, g, beta = v.to(cd), g.to(cd), beta.to(cd)
    state = _state(initial_state, b, h, k.shape[-1], dv, v)
    outs = []
    for t in range(l):
        state = state * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state))
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outs, dim=1).to(dtype), state


def _chunks(x, size: int):
    """[b, l, h, *] -> [b, h, c, size, *], zero padded at the end to c whole chunks. Padded steps leave the
    state alone: their k and beta are 0 and their log decay g is 0."""
    pad = (-x.shape[1]) % size
    x = F.pad(x.transpose(1, 2), (0, 0) * (x.dim() - 3) + (0, pad))
    return x.unflatten(2, (-1, size))


def _wy(k, v, beta, cum, decay):
    """The chunk's writes in WY form: with T = I + strictly_lower((beta k) k^T o decay), the value written at
    step i is u_i = U_i - W_i S0 for the state S0 entering the chunk, U = T^-1 (beta v) and
    W = T^-1 (beta exp(cum) k). -> (U, W)."""
    kb = k * beta[..., None]
    t = (kb @ k.transpose(-1, -2)) * decay  # only its strictly lower part is read (unitriangular solve)
    solve = functools.partial(torch.linalg.solve_triangular, t, upper=False, unitriangular=True)
    return solve(v * beta[..., None]), solve(kb * cum.exp()[..., None])


def chunk_gated_delta_rule_torch(q, k, v, g, beta, chunk_size: int = 64, initial_state=None):
    """The gated delta rule by chunks of chunk_size steps in pure PyTorch (differentiable): within a chunk
    by matmuls in WY form (`_wy`), across chunks by carrying the state. Arguments and result as
    `recurrent_gated_delta_rule`."""
    b, l, h, dv = v.shape
    cd, dtype = compute_dtype(v), q.dtype
    q, k = _queries_keys(q, k, h, cd)
    q, k, v = (_chunks(x, chunk_size) for x in (q, k, v.to(cd)))
    g, beta = (_chunks(x.to(cd)[..., None], chunk_size)[..., 0] for x in (g, beta))
    cum = g.cumsum(-1)  # [b, h, c, C]: log decay from the chunk's start through each step
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    big_u, big_w = _wy(k, v, beta, cum, decay)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_in = q * cum.exp()[..., None]  # reads of the entering state
    k_out = k * (cum[..., -1:] - cum).exp()[..., None]  # writes decayed to the chunk's end
    state = _state(initial_state, b, h, k.shape[-1], dv, v)
    outs = []  # per-chunk views by one unbind each: indexing [:, :, i] in the loop zero-fills the whole tensor's
    # gradient once per chunk in the backward (select_backward), quadratic in length
    chunks = zip(*(x.unbind(2) for x in (big_u, big_w, q_in, attn, k_out, cum[..., -1].exp())))
    for u_in, w, q_i, attn_i, k_i, end_decay in chunks:
        u = u_in - w @ state
        outs.append(q_i @ state + attn_i @ u)
        state = state * end_decay[..., None, None] + k_i.transpose(-1, -2) @ u
    out = torch.cat(outs, dim=2)[:, :, :l].transpose(1, 2)
    return out.to(dtype), state


def chunk_gated_delta_rule(q, k, v, g, beta, chunk_size: int = 64, initial_state=None):
    """The gated delta rule by chunks: fla-core's Triton `chunk_gated_delta_rule` on CUDA where it imports
    and fits (`_kernel`), else `chunk_gated_delta_rule_torch`. fla takes the same [b, l, H, d] layout and
    maps value head h to key head h // (Hv // Hk) itself (native GVA since 0.5; we require >= 0.6), so q, k
    go in unexpanded; it normalises q, k (use_qk_l2norm_in_kernel) and picks its own chunk size.
    -> (out [b, l, Hv, dv] in q's dtype, final state [b, Hv, dk, dv])."""
    fla = _kernel(q, k, v, g, beta, initial_state)
    if fla is None:
        return chunk_gated_delta_rule_torch(q, k, v, g, beta, chunk_size, initial_state)
    return fla(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=initial_state,
               output_final_state=True, use_qk_l2norm_in_kernel=True)


def gated_rms_norm(x, gate, weight, eps: float):
    """Qwen3.5's gated RMSNorm over the last dim (each value head's dv channels): x normalised in the
    compute dtype, rounded to x's dtype, times weight, times silu(gate) in the compute dtype; out in x's dtype."""
    cd = compute_dtype(x)
    xf = x.to(cd)
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.to(cd))).to(x.dtype)
