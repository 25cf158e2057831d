"""Mamba-2 mixer: in_proj -> causal depthwise conv -> chunked SSD scan -> gated group RMSNorm -> out_proj.

Numerics follow transformers' `nemotron_h` (dt = clamp(softplus(dt + dt_bias), time_step_min, max),
A = -exp(A_log), gate before the group norm). The scan is the SSD chunked form written for CPU
efficiency: B.C products are computed once per *group* (not per repeated head), chunk states are
batched matmuls, the inter-chunk recurrence is a short loop, and forward and a hand-written backward
run over blocks of chunks that stay in cache (per-chunk states and the state->output term are
kept, the rest is recomputed), so memory is linear in length. The causal conv is K shifted
multiply-adds (the CPU conv1d backward is slow). The chunk size only changes the order of
summation: CPU runs use CPU_CHUNK. On CUDA with mamba-ssm installed, its fused kernel replaces the scan.

On CPU the mixer runs conv + dt + scan as one autograd function (`_MambaCore`) over the same blocks:
it reads the in_proj output in place, computes the conv per cache-sized sub-block (never over the full
length, recomputed in backward) and writes the whole in_proj-output gradient into one tensor (no
split / concatenate of full-length tensors, whose fresh pages glibc maps and faults on every step). The gated
norm, the RMSNorm and relu2 have hand-written backwards (fewer passes than autograd); the gated norm
runs both directions over cache-sized blocks of rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .recompute import maybe_checkpoint

CPU_CHUNK = 64  # scan chunk on CPU (any chunk gives the same result up to summation order)
BLOCK_ELEMS = 1 << 18  # elements of one per-block tensor (1 MiB fp32: stays in a core's L2 cache)
GPU_BLOCK_ELEMS = 1 << 26  # on a GPU blocks only bound memory (256 MiB fp32); small ones cost kernel launches
LOG_TINY = 60.0  # decays exp(-x) below exp(-60) ~ 1e-26 are taken as exp(-60): no slow denormals


def ssd_scan(x, dt, A, B, C, chunk_size: int, D=None, initial_state=None, return_state=False):
    """Chunked selective-state-space scan.

    x [b, l, h, p], dt [b, l, h] (already softplus'ed and clamped), A [h] (negative),
    B, C [b, l, g, n], D [h] or None, initial_state [b, h, p, n] or None.
    Returns y [b, l, h, p] (and the final state [b, h, p, n]). Computed in float32 (float64 stays
    float64). Any chunk size gives the same result; memory and time are linear in length.
    """
    b, l, h, p = x.shape
    dtype = _compute_dtype(x)
    if l == 0:
        y = x.new_zeros(b, 0, h, p, dtype=dtype)
        s0 = x.new_zeros(b, h, p, B.shape[3], dtype=dtype) if initial_state is None else initial_state.to(dtype)
        return (y, s0) if return_state else y
    x, dt, A, B, C = (t.to(dtype) for t in (x, dt, A, B, C))
    D = D.to(dtype) if D is not None else None
    s0 = initial_state.to(dtype) if initial_state is not None else None
    y, s = _SSD.apply(x, dt, A, B, C, D, s0, min(chunk_size, l))
    return (y, s) if return_state else y


class _SSD(torch.autograd.Function):
    """The SSD scan with a hand-written backward, in blocks of chunks small enough to stay in cache.

    Per chunk of Q steps: y = (C B^T o L) X + exp(Acum) C state_in^T with X = dt x,
    L_ij = exp(Acum_i - Acum_j) for i >= j, and state_out = exp(Acum_Q) state_in + (exp(Acum_Q - Acum) X)^T B.
    Inside a block tensors are [b, c, g, r, Q, ...] (group g, head r of the group; contiguous, so every
    product is one batched matmul); C.B is formed once per group. The state entering each chunk and
    the state->output term are kept for backward, which recomputes the rest block by block.
    """

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, s0, Q):
        b, l, h, p = x.shape
        g, n = B.shape[2], B.shape[3]
        r, pad = h // g, (-l) % Q
        if pad:
            x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
        c = (l + pad) // Q
        y = x.new_empty(b, c * Q, h, p)
        prev = x.new_empty(b, c, g, r, p, n)  # state entering each chunk
        s = s0.view(b, g, r, p, n) if s0 is not None else x.new_zeros(b, g, r, p, n)
        y_off = []  # per block exp(Acum) C.state_in, kept for backward
        for k0, k1 in _chunk_blocks(c, b * h * Q * max(p, Q), _elems(x)):
            t0, t1 = k0 * Q, k1 * Q
            s, T = _fwd_block(x[:, t0:t1], dt[:, t0:t1], A, B[:, t0:t1], C[:, t0:t1], D, Q, s, prev[:, k0:k1],
                              _heads(y, k0, k1, Q, g))
            y_off.append(T)
        ctx.save_for_backward(x, dt, A, B, C, D, s0, prev, *y_off)  # saved, not ctx fields: checkpoint drops them
        ctx.dims = (l, Q)
        return y[:, :l], s.reshape(b, h, p, n)

    @staticmethod
    def backward(ctx, dy, ds):
        x, dt, A, B, C, D, s0, prev, *y_off = ctx.saved_tensors
        l, Q = ctx.dims
        b, L_, h, p = x.shape
        g, n = B.shape[2], B.shape[3]
        r, c = h // g, L_ // Q
        if dy.shape[1] != L_:
            dy = F.pad(dy, (0, 0, 0, 0, 0, L_ - dy.shape[1]))
        dx, ddt = torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(dt)
        dB, dC = torch.empty_like(B), torch.empty_like(C)
        dA = torch.zeros(g, r, dtype=x.dtype, device=x.device)
        dD = torch.zeros(h, dtype=x.dtype, device=x.device) if D is not None else None
        G = ds.view(b, g, r, p, n).to(x.dtype) if ds is not None else x.new_zeros(b, g, r, p, n)
        blocks = _chunk_blocks(c, b * h * Q * max(p, Q), _elems(x))
        for i in reversed(range(len(blocks))):
            k0, k1 = blocks[i]
            t0, t1 = k0 * Q, k1 * Q
            G = _bwd_block(x[:, t0:t1], dt[:, t0:t1], A, B[:, t0:t1], C[:, t0:t1], D, Q, prev[:, k0:k1],
                           y_off[i], dy[:, t0:t1], G, dx[:, t0:t1], ddt[:, t0:t1], dB[:, t0:t1], dC[:, t0:t1],
                           dA, dD)
        ds0 = G.reshape(b, h, p, n) if s0 is not None else None
        return dx[:, :l], ddt[:, :l], dA.view(h), dB[:, :l], dC[:, :l], dD, ds0, None


def _fwd_block(x, dt, A, B, C, D, Q, s, prev, yv):
    """Scan forward over one block of whole chunks. x [b, cb*Q, h, p], dt [b, cb*Q, h], B, C [b, cb*Q, g, n]
    are this block's time steps (views), s [b, g, r, p, n] the state entering it. Writes the output (D skip
    included) to yv [b, cb, g, r, Q, p] and the state entering each chunk to prev [b, cb, g, r, p, n];
    returns the state after the block and the state->output term (kept for backward)."""
    g, p = B.shape[2], x.shape[3]
    cb, r = x.shape[1] // Q, x.shape[2] // g
    Acum, X, Bh, Ch, CB, L, M = _ssd_block(x, dt, A, B, C, 0, cb, Q, g)
    Alast = Acum[..., -1:]
    W = X * torch.exp(Alast - Acum)[..., None]
    S = torch.matmul(W.transpose(-1, -2), Bh)  # [b, cb, g, r, p, n]
    e = torch.exp(Alast)[..., None]
    for j in range(cb):
        prev[:, j] = s
        s = torch.addcmul(S[:, j], e[:, j], s)
    T = torch.matmul(Ch, prev.transpose(-1, -2)).mul_(torch.exp(Acum)[..., None])
    Y = torch.baddbmm(T.view(-1, Q, p), M.view(-1, Q, Q), X.view(-1, Q, p)).view(T.shape)  # [b, cb, g, r, Q, p]
    if D is not None:
        torch.addcmul(Y, _heads(x, 0, cb, Q, g), D.view(g, r, 1, 1), out=yv)
    else:
        yv.copy_(Y)
    return s, T


def _bwd_block(x, dt, A, B, C, D, Q, prev, y_off, dy, G, dx, ddt, dB, dC, dA, dD):
    """Scan backward over one block (the arguments of `_fwd_block`, its saved prev and state->output term,
    the output gradient dy [b, cb*Q, h, p] and the gradient G of the state leaving the block). Writes dx,
    ddt, dB, dC (views of this block's steps), accumulates dA [g, r] and dD [h]; returns the gradient of
    the state entering the block."""
    b, _, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    cb, r = x.shape[1] // Q, h // g
    Acum, X, Bh, Ch, CB, L, M = _ssd_block(x, dt, A, B, C, 0, cb, Q, g)
    dY = _heads(dy, 0, cb, Q, g).contiguous()
    if D is not None:
        dD += (dy * x).sum((0, 1, 3))
    Alast = Acum[..., -1:]
    decay_out, decay_in, e = torch.exp(Acum), torch.exp(Alast - Acum), torch.exp(Alast)
    # state -> output
    d_out = (dY * y_off).sum(-1)  # d(decay_out) * decay_out
    dT = dY * decay_out[..., None]
    dCh = torch.matmul(dT, prev)  # [b, cb, g, r, Q, n]
    dprev = torch.matmul(dT.transpose(-1, -2), Ch)  # [b, cb, g, r, p, n]
    # recurrence over the block's chunks, backwards
    dS = torch.empty_like(dprev)
    for j in range(cb - 1, -1, -1):
        dS[:, j] = G
        G = torch.addcmul(dprev[:, j], e[:, j, ..., None], G)
    de = (dS * prev).sum((-1, -2)) * e[..., 0]  # d(e) * e  [b, cb, g, r]
    # chunk states
    W = X * decay_in[..., None]
    dW = torch.matmul(Bh, dS.transpose(-1, -2))  # [b, cb, g, r, Q, p]
    dBh = torch.matmul(W, dS)  # [b, cb, g, r, Q, n]
    d_in = (dW * X).sum(-1) * decay_in  # d(decay_in) * decay_in
    dX = dW.mul_(decay_in[..., None])
    # diagonal blocks
    dM = torch.matmul(dY, X.transpose(-1, -2))  # [b, cb, g, r, Q, Q]
    dX.view(-1, Q, p).baddbmm_(M.view(-1, Q, Q).transpose(-1, -2), dY.view(-1, Q, p))
    dseg = dM * M
    dM.mul_(L)
    # per group: sum over the group's heads (a view when there is one head per group)
    dCB, dCg, dBg = (t[:, :, :, 0] if r == 1 else t.sum(3) for t in (dM, dCh, dBh))  # [b, cb, g, Q, Q|n]
    Bc, Cc = Bh[:, :, :, 0], Ch[:, :, :, 0]
    _heads_bc(dC, 0, cb, Q).copy_(dCg.view(-1, Q, n).baddbmm_(dCB.reshape(-1, Q, Q), Bc.reshape(-1, Q, n)).view(dCg.shape))
    _heads_bc(dB, 0, cb, Q).copy_(dBg.view(-1, Q, n).baddbmm_(dCB.reshape(-1, Q, Q).transpose(-1, -2),
                                                              Cc.reshape(-1, Q, n)).view(dBg.shape))
    # cumulative decays -> dt, A
    dAcum = dseg.sum(-1) - dseg.sum(-2) + d_out - d_in
    dAcum[..., -1] += d_in.sum(-1) + de
    da = dAcum.flip(-1).cumsum(-1).flip(-1)  # [b, cb, g, r, Q]
    dt_h = dt.view(b, cb, Q, g, r).permute(0, 1, 3, 4, 2)
    dA += (da * dt_h).sum((0, 1, 4))
    dd = da * A.view(g, r, 1) + (dX * _heads(x, 0, cb, Q, g)).sum(-1)
    ddt.view(b, cb, Q, g, r).permute(0, 1, 3, 4, 2).copy_(dd)
    torch.mul(dX, dt_h[..., None], out=_heads(dx, 0, cb, Q, g))
    if D is not None:
        dx.addcmul_(dy, D[:, None])
    return G


def _chunk_blocks(c: int, per_chunk: int, elems: int | None = None) -> list[tuple[int, int]]:
    """Ranges [k0, k1) of c chunks (or rows) of `per_chunk` elements each, ~`elems` elements per range:
    the scan's [.., Q, Q] / [.., Q, p] block tensors, the gated norm's row blocks."""
    step = max(1, (BLOCK_ELEMS if elems is None else elems) // max(per_chunk, 1))  # read now: tests shrink it
    return [(k, min(k + step, c)) for k in range(0, c, step)]


def _on_gpu(t) -> bool:
    """Which mixer path runs: the fused cache-blocked CPU one, or whole-tensor ops (+ mamba-ssm's scan)."""
    return t.is_cuda


def _elems(t) -> int:
    return GPU_BLOCK_ELEMS if _on_gpu(t) else BLOCK_ELEMS


def _compute_dtype(t) -> torch.dtype:
    """The scan's arithmetic dtype: float64 stays float64, everything else runs in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _heads(t, k0, k1, Q, g):
    """[b, L, h, p] time steps of chunks k0..k1 viewed as [b, cb, g, r, Q, p] (no copy)."""
    b, _, h, p = t.shape
    return t[:, k0 * Q:k1 * Q].view(b, k1 - k0, Q, g, h // g, p).permute(0, 1, 3, 4, 2, 5)


def _heads_bc(t, k0, k1, Q):
    """[b, L, g, n] time steps of chunks k0..k1 viewed as [b, cb, g, Q, n] (no copy)."""
    b, _, g, n = t.shape
    return t[:, k0 * Q:k1 * Q].view(b, k1 - k0, Q, g, n).transpose(2, 3)


def _ssd_block(x, dt, A, B, C, k0, k1, Q, g):
    """Per-block quantities shared by forward and backward: cumulative log-decays Acum [b, cb, g, r, Q],
    X = dt x [b, cb, g, r, Q, p], B and C per head [b, cb, g, r, Q, n], C.B per group [b, cb, g, Q, Q],
    the decay mask L and M = C.B o L [b, cb, g, r, Q, Q]."""
    b, _, h, p = x.shape
    n, r, cb, t0 = B.shape[3], h // g, k1 - k0, k0 * Q
    dt_h = dt[:, t0:t0 + cb * Q].view(b, cb, Q, g, r).permute(0, 1, 3, 4, 2)
    Acum = (dt_h * A.view(g, r, 1)).cumsum(-1)
    X = torch.mul(_heads(x, k0, k1, Q, g), dt_h[..., None], out=x.new_empty(b, cb, g, r, Q, p))
    Bh = _heads_bc(B, k0, k1, Q)[:, :, :, None].expand(b, cb, g, r, Q, n).contiguous()
    Ch = _heads_bc(C, k0, k1, Q)[:, :, :, None].expand(b, cb, g, r, Q, n).contiguous()
    CB = torch.matmul(Ch[:, :, :, 0], Bh[:, :, :, 0].transpose(-1, -2))
    L = (Acum[..., :, None] - Acum[..., None, :]).clamp_(-LOG_TINY, 0.0).exp_().mul_(_lower(Q, x))
    M = L * CB[:, :, :, None]
    return Acum, X, Bh, Ch, CB, L, M


_LOWER = {}


def _lower(Q, x):
    """Lower-triangular 0/1 mask [Q, Q] in x's dtype (cached)."""
    key = (Q, str(x.device), x.dtype)
    if key not in _LOWER:
        _LOWER[key] = torch.ones(Q, Q, dtype=x.dtype, device=x.device).tril()
    return _LOWER[key]


class _CausalConvSiLU(torch.autograd.Function):
    """silu(causal depthwise conv1d(x) + bias) on [b, l, C] (time-major, no transposes): K shifted
    multiply-adds instead of a convolution kernel (whose CPU backward is slow), done in blocks of
    time steps small enough to stay in cache; the pre-activation is recomputed in backward."""

    @staticmethod
    def _pre(x, wk, bias, t0, t1):
        """conv output (before silu) for steps t0..t1 and the padded input window it read."""
        K = wk.shape[0]
        xb = x[:, max(t0 - K + 1, 0):t1]
        if t0 < K - 1:
            xb = F.pad(xb, (0, 0, K - 1 - t0, 0))
        T = t1 - t0
        y = torch.mul(xb[:, K - 1:], wk[K - 1]) if bias is None else torch.addcmul(bias, xb[:, K - 1:], wk[K - 1])
        for k in range(K - 1):
            y.addcmul_(xb[:, k:k + T], wk[k])
        return y, xb

    @staticmethod
    def forward(ctx, x, w, bias):
        b, l, Cn = x.shape
        wk = w.view(Cn, -1).t().contiguous()  # [K, C]
        out = x.new_empty(b, l, Cn)
        for t0, t1 in _spans(l, max(_block(b * Cn), wk.shape[0])):
            y, _ = _CausalConvSiLU._pre(x, wk, bias, t0, t1)
            torch.ops.aten.silu.out(y, out=out[:, t0:t1])
        ctx.save_for_backward(x, wk, bias)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, wk, bias = ctx.saved_tensors
        b, l, Cn = x.shape
        K = wk.shape[0]
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        dw = torch.zeros_like(wk)
        db = torch.zeros_like(bias) if bias is not None else None
        carry = None  # gradient for the K-1 steps before the block processed last
        for t0, t1 in reversed(_spans(l, max(_block(b * Cn), K))):  # only the first block may be short
            T = t1 - t0
            y, xb = _CausalConvSiLU._pre(x, wk, bias, t0, t1)
            g = torch.ops.aten.silu_backward(dout[:, t0:t1], y)
            dxb = torch.mul(g, wk[K - 1])
            if carry is not None:
                dxb[:, max(T - K + 1, 0):] += carry[:, max(K - 1 - T, 0):]  # a short block starts at 0
            head = x.new_zeros(b, K - 1, Cn)  # steps t0-K+1 .. t0-1
            for k in range(K - 1):
                d = K - 1 - k  # output step j reads input step j - d
                dw[k] += (g * xb[:, k:k + T]).sum((0, 1))
                if T > d:
                    dxb[:, :T - d].addcmul_(g[:, d:], wk[k])
                m = min(d, T)
                head[:, k:k + m].addcmul_(g[:, :m], wk[k])
            dw[K - 1] += (g * xb[:, K - 1:]).sum((0, 1))
            if db is not None:
                db += g.sum((0, 1))
            dx[:, t0:t1] = dxb
            carry = head
        return dx, dw.t().reshape(Cn, 1, K), db


def causal_conv_silu(x, conv: nn.Conv1d, blocked: bool):
    """silu(causal depthwise conv(x)) on x [b, l, C]. blocked: the cache-blocked shifted multiply-adds
    (CPU); else one F.conv1d call (cuDNN on GPU, where small blocks would cost thousands of launches)."""
    w, bias = conv.weight, conv.bias
    if blocked:
        return _CausalConvSiLU.apply(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
    y = F.conv1d(x.transpose(1, 2), w, bias, padding=w.shape[-1] - 1, groups=w.shape[0])
    return F.silu(y[..., :x.shape[1]].transpose(1, 2))


class _MambaCore(torch.autograd.Function):
    """The mixer between in_proj and the gated norm, fused over blocks of chunks: causal conv + silu
    (x mask), dt = clamp(softplus(dt + dt_bias)), the SSD scan with the D skip.

    Reads the in_proj output [b, l, z|xBC|dt] in place and returns the scan output y [b, l, Im] and z (a
    copy, so that its gradient comes back here); the backward writes the whole in_proj-output gradient
    into one tensor. Only cache-sized tensors exist per block (the conv output is never materialised
    over the full length, nothing is split and concatenated back); kept for backward: the state entering
    each chunk and the state->output term. Same arithmetic as conv -> ssd_scan.
    """

    @staticmethod
    def forward(ctx, zx, w, conv_b, dt_bias, A, D, mask, dims):
        Im, g, n, h, Q, tmin, tmax = dims
        b, l, _ = zx.shape
        cd = _compute_dtype(zx)
        ctx.dtypes = [t.dtype if t is not None else None for t in (w, conv_b, dt_bias, A, D)]
        wk = w.view(w.shape[0], -1).t().to(cd).contiguous()  # [K, C]
        conv_b, dt_bias, A, D = (t.to(cd) if t is not None else None for t in (conv_b, dt_bias, A, D))
        p, Cn, r, GN = Im // h, Im + 2 * g * n, h // g, g * n
        src, raw = zx[..., Im:Im + Cn], zx[..., Im + Cn:]
        dt = F.softplus(raw.to(cd) + dt_bias).clamp(tmin, tmax)
        c = -(-l // Q)
        ys = zx.new_empty(b, l, Im, dtype=cd)
        prev = zx.new_empty(b, c, g, r, p, n, dtype=cd)
        s = zx.new_zeros(b, g, r, p, n, dtype=cd)
        y_off = []
        for k0, k1 in _chunk_blocks(c, b * h * Q * max(p, Q)):
            t0, t1, cb = k0 * Q, min(k1 * Q, l), k1 - k0
            xbc = _core_conv(src, wk, conv_b, mask, t0, t1, cb * Q)
            y = xbc.new_empty(b, cb * Q, h, p)
            s, Toff = _fwd_block(xbc[..., :Im].view(b, -1, h, p), _pad_to(dt[:, t0:t1], cb * Q), A,
                                 xbc[..., Im:Im + GN].view(b, -1, g, n), xbc[..., Im + GN:].view(b, -1, g, n), D, Q,
                                 s, prev[:, k0:k1], _heads(y, 0, cb, Q, g))
            y_off.append(Toff)
            ys[:, t0:t1] = y.view(b, -1, Im)[:, :t1 - t0]
        z = torch.empty(b, l, Im, dtype=zx.dtype, device=zx.device)
        z.copy_(zx[..., :Im])
        ctx.save_for_backward(zx, wk, conv_b, dt_bias, A, D, mask, prev, *y_off)  # checkpoint sees them all
        ctx.dims, ctx.cd = dims, cd
        return ys, z

    @staticmethod
    def backward(ctx, dys, dz):
        zx, wk, conv_b, dt_bias, A, D, mask, prev, *y_off = ctx.saved_tensors
        Im, g, n, h, Q, tmin, tmax = ctx.dims
        cd, (b, l, _), K = ctx.cd, zx.shape, wk.shape[0]
        p, Cn, r, GN = Im // h, Im + 2 * g * n, h // g, g * n
        src, raw = zx[..., Im:Im + Cn], zx[..., Im + Cn:]
        dzx = torch.empty(zx.shape, dtype=zx.dtype, device=zx.device)
        if dz is None:
            dzx[..., :Im].zero_()
        else:
            dzx[..., :Im] = dz
        if dys is None:
            dys = zx.new_zeros(b, l, Im, dtype=cd)
        dwk, db = torch.zeros_like(wk), torch.zeros_like(conv_b) if conv_b is not None else None
        dA = torch.zeros(g, r, dtype=cd, device=zx.device)
        dD = torch.zeros_like(D) if D is not None else None
        ddt_bias = torch.zeros_like(dt_bias)
        G = zx.new_zeros(b, g, r, p, n, dtype=cd)  # gradient of the state leaving the block
        look = None  # conv-output gradient of the K-1 steps after the sub-block processed last
        blocks = _chunk_blocks(prev.shape[1], b * h * Q * max(p, Q))
        for i in reversed(range(len(blocks))):
            k0, k1 = blocks[i]
            t0, t1, cb = k0 * Q, min(k1 * Q, l), k1 - k0
            T, Tp = t1 - t0, cb * Q
            pre = zx.new_empty(b, T, Cn, dtype=cd)
            xbc = _core_conv(src, wk, conv_b, mask, t0, t1, Tp, pre)
            rawb = raw[:, t0:t1].to(cd) + dt_bias
            sp = F.softplus(rawb)
            dY = _pad_to(dys[:, t0:t1].to(cd), Tp).view(b, Tp, h, p)
            # scan
            dxbc, ddt = xbc.new_empty(b, Tp, Cn), xbc.new_empty(b, Tp, h)
            G = _bwd_block(xbc[..., :Im].view(b, -1, h, p), _pad_to(sp.clamp(tmin, tmax), Tp), A,
                           xbc[..., Im:Im + GN].view(b, -1, g, n), xbc[..., Im + GN:].view(b, -1, g, n), D, Q,
                           prev[:, k0:k1], y_off[i], dY, G, dxbc[..., :Im].view(b, -1, h, p), ddt,
                           dxbc[..., Im:Im + GN].view(b, -1, g, n), dxbc[..., Im + GN:].view(b, -1, g, n), dA, dD)
            # dt = clamp(softplus(raw + dt_bias))
            ddt = torch.ops.aten.softplus_backward(ddt[:, :T] * ((sp >= tmin) & (sp <= tmax)), rawb, 1.0, 20.0)
            ddt_bias += ddt.sum((0, 1))
            dzx[:, t0:t1, Im + Cn:] = ddt
            # causal conv + silu, in sub-blocks (last first)
            for s0, s1 in reversed(_sub_spans(t0, t1, Cn * b, K)):
                a0, a1 = s0 - t0, s1 - t0
                gr = dxbc[:, a0:a1] if mask is None else dxbc[:, a0:a1] * mask[:, s0:s1, None]
                gr = torch.ops.aten.silu_backward(gr, pre[:, a0:a1])
                look = _conv_backward(src, wk, gr, look, s0, dzx[:, s0:s1, Im:Im + Cn], dwk, db)
        grads = (dwk.t().reshape(-1, 1, K), db, ddt_bias, dA.view(h), dD)
        grads = [x.to(dt) if x is not None else None for x, dt in zip(grads, ctx.dtypes)]
        return (dzx, *grads, None, None)


class _GatedRMSNorm(torch.autograd.Function):
    """weight * group_rms_normalise(y * silu(z)) in fp32 with a hand-written backward (keeps y, z, 1/rms).
    On CPU both directions run over blocks of rows that stay in cache: every intermediate (silu(z), the
    gated and normalised values, their gradients) lives only for one block, so each full-length tensor
    is read or written once (autograd's version made ~10 passes over fresh full-length tensors)."""

    @staticmethod
    def forward(ctx, y, z, w, groups, eps):
        shape, Im = y.shape, y.shape[-1]
        y2, z2 = y.reshape(-1, Im), z.reshape(-1, Im)
        # as transformers: normalise in fp32, round to y's dtype, then times the weight (type promotion)
        out = torch.empty(y2.shape, dtype=torch.promote_types(y.dtype, w.dtype), device=y.device)
        rs = torch.empty(y2.shape[0], groups, 1, dtype=torch.float32, device=y.device)
        for r0, r1 in _chunk_blocks(y2.shape[0], Im, _elems(y2)):  # rows
            yz = F.silu(z2[r0:r1].float()).mul_(y2[r0:r1].float()).view(r1 - r0, groups, -1)
            torch.rsqrt(yz.pow(2).mean(-1, keepdim=True).add_(eps), out=rs[r0:r1])
            torch.mul(w, yz.mul_(rs[r0:r1]).view(r1 - r0, Im).to(y.dtype), out=out[r0:r1])
        ctx.save_for_backward(y, z, w, rs)
        ctx.groups = groups
        return out.view(shape)

    @staticmethod
    def backward(ctx, dout):
        y, z, w, rs = ctx.saved_tensors
        shape, G, Im = y.shape, ctx.groups, y.shape[-1]
        y2, z2, do2 = y.reshape(-1, Im), z.reshape(-1, Im), dout.reshape(-1, Im)
        dy = torch.empty(y2.shape, dtype=y.dtype, device=y.device)
        dz = torch.empty(z2.shape, dtype=z.dtype, device=z.device)
        need_w = ctx.needs_input_grad[2]
        dw = torch.zeros(Im, dtype=torch.float32, device=y.device) if need_w else None
        wf = w.float()
        for r0, r1 in _chunk_blocks(y2.shape[0], Im, _elems(y2)):  # rows
            R = r1 - r0
            yf, zf, do = y2[r0:r1].float(), z2[r0:r1].float(), do2[r0:r1].float()
            gz = F.silu(zf)
            nv = (yf * gz).view(R, G, -1).mul_(rs[r0:r1])  # the normalised value before the weight
            if need_w:
                dw.unsqueeze(0).addmm_(torch.ones(1, R, dtype=do.dtype, device=do.device), do * nv.view(R, Im))
            dn = (do * wf).view(R, G, -1)
            s = (dn * nv).mean(-1, keepdim=True)
            dyz = dn.sub_(nv.mul_(s)).mul_(rs[r0:r1]).view(R, Im)
            dz[r0:r1] = torch.ops.aten.silu_backward(dyz * yf, zf)
            dy[r0:r1] = dyz.mul_(gz)
        return dy.view(shape), dz.view(shape), (dw.to(w.dtype) if need_w else None), None, None


def _sub_spans(t0: int, t1: int, width: int, K: int) -> list[tuple[int, int]]:
    """[s0, s1) pieces of t0..t1 whose [steps, width] tensors have ~BLOCK_ELEMS elements (>= K steps)."""
    step = max(K, 8, BLOCK_ELEMS // max(width, 1))
    return [(s, min(s + step, t1)) for s in range(t0, t1, step)]


def _conv_into(src, wk, bias, s0, s1, out):
    """Causal depthwise conv (before the activation) of steps s0..s1 of src [b, l, C] into out [b, s1-s0, C]:
    out[t] = bias + sum_k wk[k] src[t - (K-1-k)], zero before step 0."""
    K, T = wk.shape[0], s1 - s0
    if bias is None:
        torch.mul(src[:, s0:s1], wk[K - 1], out=out)
    else:
        torch.addcmul(bias, src[:, s0:s1], wk[K - 1], out=out)
    for k in range(K - 1):
        d = K - 1 - k
        j0 = min(max(d - s0, 0), T)  # rows reading before step 0 get nothing
        out[:, j0:].addcmul_(src[:, s0 + j0 - d:s1 - d], wk[k])


def _conv_backward(src, wk, gr, look, s0, dx, dwk, db):
    """Backward of `_conv_into` for steps s0..s0+T given its output gradient gr [b, T, C] (sub-blocks are
    processed last first; `look` is the output gradient of the K-1 steps after this one, None at the end).
    Writes the input gradient of steps s0..s0+T to dx (copied if dx has another dtype), accumulates dwk
    [K, C] and db [C]; returns the `look` for the sub-block before."""
    K, T = wk.shape[0], gr.shape[1]
    out = dx if dx.dtype == gr.dtype else torch.empty_like(gr)
    torch.mul(gr, wk[K - 1], out=out)  # input step t gets sum_k wk[k] gr[t + K-1-k]
    dwk[K - 1] += (gr * src[:, s0:s0 + T]).sum((0, 1))
    for k in range(K - 1):
        d = K - 1 - k
        if T > d:
            out[:, :T - d].addcmul_(gr[:, d:], wk[k])
        if look is not None:
            m = min(d, T)
            out[:, T - m:].addcmul_(look[:, d - m:d], wk[k])
        j0 = min(max(d - s0, 0), T)
        if T > j0:
            dwk[k] += (gr[:, j0:] * src[:, s0 + j0 - d:s0 + T - d]).sum((0, 1))
    if db is not None:
        db += gr.sum((0, 1))
    if out is not dx:
        dx.copy_(out)
    if T >= K - 1:
        return gr[:, :K - 1]
    tail = look[:, :K - 1 - T] if look is not None else gr.new_zeros(gr.shape[0], K - 1 - T, gr.shape[2])
    return torch.cat([gr, tail], 1)


def _core_conv(src, wk, bias, mask, t0, t1, Tp, pre=None):
    """silu(causal conv) (x mask) of steps t0..t1 of src [b, l, C] as a new [b, Tp, C] tensor, zero after
    t1, computed in cache-sized sub-blocks; the pre-activation is also written to `pre` when given."""
    b, _, C = src.shape
    out = src.new_empty(b, Tp, C, dtype=wk.dtype)
    if Tp > t1 - t0:
        out[:, t1 - t0:].zero_()
    for s0, s1 in _sub_spans(t0, t1, C * b, wk.shape[0]):
        o = out[:, s0 - t0:s1 - t0]
        if pre is None:
            _conv_into(src, wk, bias, s0, s1, o)
            torch.ops.aten.silu_(o)
        else:
            _conv_into(src, wk, bias, s0, s1, pre[:, s0 - t0:s1 - t0])
            torch.ops.aten.silu.out(pre[:, s0 - t0:s1 - t0], out=o)
        if mask is not None:
            o.mul_(mask[:, s0:s1, None])
    return out


def _pad_to(t, steps):
    """t [b, T, ...] zero-padded to `steps` time steps."""
    pad = steps - t.shape[1]
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) if pad else t


def _spans(l: int, step: int) -> list[tuple[int, int]]:
    """[t0, t1) blocks covering 0..l, all of length `step` but the first."""
    first = l % step or min(step, l)
    return [(0, first)] + [(t, t + step) for t in range(first, l, step)]


def _block(width: int) -> int:
    """Time steps per block so that one [block, width] tensor has ~BLOCK_ELEMS elements."""
    return max(16, BLOCK_ELEMS // max(width, 1))


def ssd_reference(x, dt, A, B, C, D=None):
    """Naive sequential recurrence (the definition), for tests: h_t = exp(dt A) h_{t-1} + dt x_t B_t."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    Bh = B.repeat_interleave(h // g, dim=2)
    Ch = C.repeat_interleave(h // g, dim=2)
    s = x.new_zeros(b, h, p, n)
    ys = []
    for t in range(l):
        s = torch.exp(dt[:, t] * A)[..., None, None] * s + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        y = (s * Ch[:, t, :, None, :]).sum(-1)
        if D is not None:
            y = y + D[:, None] * x[:, t]
        ys.append(y)
    return torch.stack(ys, dim=1)


USE_KERNEL = True  # set False to force the pure-PyTorch scan on CUDA (benchmarks, parity checks)


def _mamba_kernel():
    """mamba-ssm's fused Triton SSD scan when the optional extra is importable, else None."""
    if not USE_KERNEL:
        return None
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        return mamba_chunk_scan_combined
    except Exception:  # optional GPU extra
        return None


def init_a_log(p: torch.Tensor) -> torch.Tensor:
    """A_log's initial value in place: log(1..h), i.e. A = -1..-h (transformers' nemotron_h init)."""
    return p.copy_(torch.log(torch.arange(1, p.numel() + 1, dtype=torch.float32, device=p.device)))


class GatedRMSNorm(nn.Module):
    """y * silu(z), then RMS-normalised within each of `groups` groups, times weight."""

    def __init__(self, size: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups, self.eps = groups, eps

    def forward(self, y, z):
        return _GatedRMSNorm.apply(y, z, self.weight, self.groups, self.eps)


class Mamba2Mixer(nn.Module):
    recompute_core = False  # models.recompute "selective": conv + scan + gated norm recomputed in backward

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.in_proj = nn.Linear(cfg.hidden_size, cfg.mamba_in_proj_size, bias=cfg.mamba_proj_bias)
        self.conv1d = nn.Conv1d(cfg.mamba_conv_dim, cfg.mamba_conv_dim, cfg.conv_kernel,
                                groups=cfg.mamba_conv_dim, bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(cfg.mamba_num_heads))
        self.A_log = nn.Parameter(torch.empty(cfg.mamba_num_heads))
        if not self.A_log.is_meta:  # arange on the meta device imports torch._dynamo (~1.8 s)
            with torch.no_grad():
                init_a_log(self.A_log)
        self.D = nn.Parameter(torch.ones(cfg.mamba_num_heads))
        self.norm = GatedRMSNorm(cfg.mamba_inner, cfg.n_groups, cfg.norm_eps)
        self.out_proj = nn.Linear(cfg.mamba_inner, cfg.hidden_size, bias=cfg.mamba_proj_bias)

    def forward(self, u, attention_mask=None):
        cfg = self.cfg
        b, l, _ = u.shape
        Im, GN, nh = cfg.mamba_inner, cfg.n_groups * cfg.ssm_state_size, cfg.mamba_num_heads
        if attention_mask is not None:
            u = u * attention_mask[:, :, None].to(u.dtype)
        zxbcdt = self.in_proj(u)
        if b == 0 or l == 0:  # nothing to scan (the blocked paths cannot view an empty tensor)
            return self.out_proj(zxbcdt.new_zeros(b, l, Im))
        A = -torch.exp(self.A_log.float())
        gpu = _on_gpu(u)
        if not gpu:  # fused conv + scan: same arithmetic, in cache-sized blocks
            m = attention_mask.to(_compute_dtype(u)) \
                if attention_mask is not None else None
            dims = (Im, cfg.n_groups, cfg.ssm_state_size, nh, min(CPU_CHUNK, l), cfg.time_step_min, cfg.time_step_max)

            def core(zx):
                y, z = _MambaCore.apply(zx, self.conv1d.weight, self.conv1d.bias, self.dt_bias, A, self.D, m, dims)
                return self.norm(y, z).to(u.dtype)
            return self.out_proj(maybe_checkpoint(self, core, zxbcdt))
        return self.out_proj(maybe_checkpoint(self, self._core, zxbcdt, A, attention_mask).to(u.dtype))

    def _core(self, zxbcdt, A, attention_mask):
        """conv + scan + gated norm as separate ops (GPU): the in_proj output -> the out_proj input."""
        cfg = self.cfg
        b, l, _ = zxbcdt.shape
        Im, GN, nh = cfg.mamba_inner, cfg.n_groups * cfg.ssm_state_size, cfg.mamba_num_heads
        gpu = _on_gpu(zxbcdt)
        z, xBC, dt = zxbcdt.split([Im, Im + 2 * GN, nh], dim=-1)
        xBC = causal_conv_silu(xBC, self.conv1d, blocked=not gpu)
        if attention_mask is not None:
            xBC = xBC * attention_mask[:, :, None].to(xBC.dtype)
        x, B, C = xBC.split([Im, GN, GN], dim=-1)
        x = x.reshape(b, l, nh, cfg.mamba_head_dim)
        B = B.reshape(b, l, cfg.n_groups, cfg.ssm_state_size)
        C = C.reshape(b, l, cfg.n_groups, cfg.ssm_state_size)
        kernel = _mamba_kernel() if gpu else None
        if kernel is not None:
            y = kernel(x, dt, A, B, C, cfg.chunk_size, D=self.D.float(), dt_bias=self.dt_bias.float(),
                       dt_softplus=True, dt_limit=(cfg.time_step_min, cfg.time_step_max))
        else:
            cd = _compute_dtype(dt)
            dt = F.softplus(dt.to(cd) + self.dt_bias.to(cd)).clamp(cfg.time_step_min, cfg.time_step_max)
            # the chunk size only changes the order of summation; 64 is the fastest on CPU
            y = ssd_scan(x, dt, A, B, C, cfg.chunk_size if gpu else CPU_CHUNK, D=self.D)
        return self.norm(y.reshape(b, l, Im), z)
