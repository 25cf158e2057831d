"""Mamba-2 mixer: in_proj -> causal depthwise conv -> chunked SSD scan -> gated group RMSNorm -> out_proj.

Numerics follow transformers' `nemotron_h` (dt = clamp(softplus(dt + dt_bias), time_step_min, max),
A = -exp(A_log), gate before the group norm). The scan is the SSD chunked form written for CPU
efficiency: B.C products are computed once per *group* (not per repeated head), chunk states are
batched matmuls, the inter-chunk recurrence is a short loop, and forward and a hand-written backward
run over blocks of chunks that stay in cache (per-chunk states and the state->output term are
kept, the rest is recomputed), so memory is linear in length. The causal conv is K shifted
multiply-adds (the CPU conv1d backward is slow). The chunk size only changes the order of
summation: CPU runs use CPU_CHUNK. On CUDA with mamba-ssm installed, its fused kernel replaces the scan.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CPU_CHUNK = 64  # scan chunk on CPU (any chunk gives the same result up to summation order)
BLOCK_ELEMS = 1 << 18  # elements of one per-block tensor (1 MiB fp32: stays in a core's L2 cache)


def ssd_scan(x, dt, A, B, C, chunk_size: int, D=None, initial_state=None, return_state=False):
    """Chunked selective-state-space scan.

    x [b, l, h, p], dt [b, l, h] (already softplus'ed and clamped), A [h] (negative),
    B, C [b, l, g, n], D [h] or None, initial_state [b, h, p, n] or None.
    Returns y [b, l, h, p] (and the final state [b, h, p, n]). Computed in float32 (float64 stays
    float64). Any chunk size gives the same result; memory and time are linear in length.
    """
    b, l, h, p = x.shape
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
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
        for k0, k1 in _chunk_blocks(c, b * h * Q * max(p, Q)):
            Acum, X, Bh, Ch, CB, L, M = _ssd_block(x, dt, A, B, C, k0, k1, Q, g)
            Y = torch.matmul(M, X)  # [b, cb, g, r, Q, p]
            Alast = Acum[..., -1:]
            W = X * torch.exp(Alast - Acum)[..., None]
            S = torch.matmul(W.transpose(-1, -2), Bh)  # [b, cb, g, r, p, n]
            e = torch.exp(Alast)[..., None]
            for j in range(k1 - k0):
                prev[:, k0 + j] = s
                s = torch.addcmul(S[:, j], e[:, j], s)
            T = torch.matmul(Ch, prev[:, k0:k1].transpose(-1, -2)).mul_(torch.exp(Acum)[..., None])
            Y += T  # [b, cb, g, r, Q, p]
            y_off.append(T)
            yv = _heads(y, k0, k1, Q, g)
            if D is not None:
                torch.addcmul(Y, _heads(x, k0, k1, Q, g), D.view(g, r, 1, 1), out=yv)
            else:
                yv.copy_(Y)
        ctx.save_for_backward(x, dt, A, B, C, D, s0, prev)
        ctx.dims, ctx.y_off = (l, Q), y_off
        return y[:, :l], s.reshape(b, h, p, n)

    @staticmethod
    def backward(ctx, dy, ds):
        x, dt, A, B, C, D, s0, prev = ctx.saved_tensors
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
        blocks = _chunk_blocks(c, b * h * Q * max(p, Q))
        for i in reversed(range(len(blocks))):
            (k0, k1), y_off = blocks[i], ctx.y_off[i]
            cb, t0, t1 = k1 - k0, k0 * Q, k1 * Q
            Acum, X, Bh, Ch, CB, L, M = _ssd_block(x, dt, A, B, C, k0, k1, Q, g)
            dY = _heads(dy, k0, k1, Q, g).contiguous()
            if D is not None:
                dD += (dy[:, t0:t1] * x[:, t0:t1]).sum((0, 1, 3))
            Alast = Acum[..., -1:]
            decay_out, decay_in, e = torch.exp(Acum), torch.exp(Alast - Acum), torch.exp(Alast)
            pv = prev[:, k0:k1]
            # state -> output
            d_out = (dY * y_off).sum(-1)  # d(decay_out) * decay_out
            dT = dY * decay_out[..., None]
            dCh = torch.matmul(dT, pv)  # [b, cb, g, r, Q, n]
            dprev = torch.matmul(dT.transpose(-1, -2), Ch)  # [b, cb, g, r, p, n]
            # recurrence over the block's chunks, backwards
            dS = torch.empty_like(dprev)
            for j in range(cb - 1, -1, -1):
                dS[:, j] = G
                G = torch.addcmul(dprev[:, j], e[:, j, ..., None], G)
            de = (dS * pv).sum((-1, -2)) * e[..., 0]  # d(e) * e  [b, cb, g, r]
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
            dCB = dM.mul_(L).sum(3)  # [b, cb, g, Q, Q]
            Bc, Cc = Bh[:, :, :, 0], Ch[:, :, :, 0]
            _heads_bc(dC, k0, k1, Q).copy_(torch.matmul(dCB, Bc).add_(dCh.sum(3)))
            _heads_bc(dB, k0, k1, Q).copy_(torch.matmul(dCB.transpose(-1, -2), Cc).add_(dBh.sum(3)))
            # cumulative decays -> dt, A
            dAcum = dseg.sum(-1) - dseg.sum(-2) + d_out - d_in
            dAcum[..., -1] += d_in.sum(-1) + de
            da = dAcum.flip(-1).cumsum(-1).flip(-1)  # [b, cb, g, r, Q]
            dt_h = dt[:, t0:t1].view(b, cb, Q, g, r).permute(0, 1, 3, 4, 2)
            dA += (da * dt_h).sum((0, 1, 4))
            dd = da * A.view(g, r, 1) + (dX * _heads(x, k0, k1, Q, g)).sum(-1)
            ddt[:, t0:t1].view(b, cb, Q, g, r).permute(0, 1, 3, 4, 2).copy_(dd)
            torch.mul(dX, dt_h[..., None], out=_heads(dx, k0, k1, Q, g))
            if D is not None:
                dx[:, t0:t1].addcmul_(dy[:, t0:t1], D[:, None])
        ds0 = G.reshape(b, h, p, n) if s0 is not None else None
        return dx[:, :l], ddt[:, :l], dA.view(h), dB[:, :l], dC[:, :l], dD, ds0, None


def _chunk_blocks(c: int, per_chunk: int) -> list[tuple[int, int]]:
    """Chunk ranges [k0, k1) whose [.., Q, Q] / [.., Q, p] tensors have ~BLOCK_ELEMS elements."""
    step = max(1, BLOCK_ELEMS // max(per_chunk, 1))
    return [(k, min(k + step, c)) for k in range(0, c, step)]


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
    L = Acum[..., :, None] - Acum[..., None, :]
    L.masked_fill_(_upper(Q, x.device), float("-inf")).exp_()
    M = L * CB[:, :, :, None]
    return Acum, X, Bh, Ch, CB, L, M


_UPPER = {}


def _upper(Q, device):
    """Strictly upper-triangular boolean mask [Q, Q] (cached)."""
    key = (Q, str(device))
    if key not in _UPPER:
        _UPPER[key] = torch.ones(Q, Q, dtype=torch.bool, device=device).triu(1)
    return _UPPER[key]


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


def _mamba_kernel():
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        return mamba_chunk_scan_combined
    except Exception:  # optional GPU extra
        return None


class GatedRMSNorm(nn.Module):
    """y * silu(z), then RMS-normalised within each of `groups` groups, times weight."""

    def __init__(self, size: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups, self.eps = groups, eps

    def forward(self, y, z):
        dtype = y.dtype
        y = y.float() * F.silu(z.float())
        yg = y.view(*y.shape[:-1], self.groups, -1)
        yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * yg.view(y.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.in_proj = nn.Linear(cfg.hidden_size, cfg.mamba_in_proj_size, bias=cfg.mamba_proj_bias)
        self.conv1d = nn.Conv1d(cfg.mamba_conv_dim, cfg.mamba_conv_dim, cfg.conv_kernel,
                                groups=cfg.mamba_conv_dim, bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(cfg.mamba_num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, cfg.mamba_num_heads + 1, dtype=torch.float32)))
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
        z, xBC, dt = zxbcdt.split([Im, Im + 2 * GN, nh], dim=-1)
        xBC = _CausalConvSiLU.apply(xBC, self.conv1d.weight.to(xBC.dtype),
                                    None if self.conv1d.bias is None else self.conv1d.bias.to(xBC.dtype))
        if attention_mask is not None:
            xBC = xBC * attention_mask[:, :, None].to(xBC.dtype)
        x, B, C = xBC.split([Im, GN, GN], dim=-1)
        A = -torch.exp(self.A_log.float())
        x = x.reshape(b, l, nh, cfg.mamba_head_dim)
        B = B.reshape(b, l, cfg.n_groups, cfg.ssm_state_size)
        C = C.reshape(b, l, cfg.n_groups, cfg.ssm_state_size)
        kernel = _mamba_kernel() if u.is_cuda else None
        if kernel is not None:
            y = kernel(x, dt, A, B, C, cfg.chunk_size, D=self.D.float(), dt_bias=self.dt_bias.float(),
                       dt_softplus=True, dt_limit=(cfg.time_step_min, cfg.time_step_max))
        else:
            dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(cfg.time_step_min, cfg.time_step_max)
            # the chunk size only changes the order of summation; 64 is the fastest on CPU
            y = ssd_scan(x, dt, A, B, C, cfg.chunk_size if u.is_cuda else CPU_CHUNK, D=self.D)
        y = self.norm(y.reshape(b, l, Im), z)
        return self.out_proj(y.to(u.dtype))
