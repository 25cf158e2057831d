"""The Mamba-2 mixer's CPU kernels.

models/mamba.py states the math; this module computes it fast on CPU. Everything runs over blocks
of scan chunks small enough to stay in a core's cache (BLOCK_ELEMS), with hand-written backwards
that keep only the state entering each chunk and the state->output term and recompute the rest
block by block, so memory is linear in length and no full-length intermediate is materialised:
`mamba_core` (causal conv + silu, dt and the SSD scan as one autograd function, reading the in_proj
output in place and writing its whole gradient into one tensor), `ssd_scan` / `ssd_scan_state` (the chunked
scan alone; the CUDA path's scan when mamba-ssm is missing), `gated_rms_norm` (over cache-sized row blocks).
models.mamba hooks up the optional GPU kernels (mamba-ssm, causal-conv1d) on CUDA.

Column offsets of the in_proj output and the conv channels come from the Mamba spec (models.mamba.layout_spans).
"""
from __future__ import annotations

import functools
from collections import namedtuple
from typing import NamedTuple

import torch
import torch.nn.functional as F

CPU_CHUNK = 64  # scan chunk on CPU (any chunk gives the same result up to summation order)
BLOCK_ELEMS = 1 << 18  # elements of one per-block tensor (1 MiB fp32: stays in a core's L2 cache)
GPU_BLOCK_ELEMS = 1 << 26  # on a GPU blocks only bound memory (256 MiB fp32); small ones cost kernel launches
LOG_TINY = 60.0  # decays exp(-x) below exp(-60) ~ 1e-26 are taken as exp(-60): no slow denormals


class Spans(NamedTuple):
    """Column slices of the in_proj output (z, conv input, dt) and of the conv output (x, B, C)."""
    z: slice
    conv: slice
    dt: slice
    x: slice
    B: slice
    C: slice


class CoreLayout(NamedTuple):
    """`mamba_core`'s non-tensor input: the config with this mixer's (local) head and group counts, its `Spans`."""
    cfg: object
    spans: Spans


# A block of whole scan chunks: x [b, cb*Q, h, p], dt [b, cb*Q, h], B, C [b, cb*Q, g, n] (views of its steps), A [h],
# D [h] or None, the chunk length Q; its gradients: dx, ddt, dB, dC (views as in Block), the sums dA [g, r], dD [h].
Block = namedtuple("Block", "x dt A B C D Q")
BlockGrads = namedtuple("BlockGrads", "dx ddt dB dC dA dD")


def compute_dtype(t) -> torch.dtype:
    """The kernels' arithmetic dtype: float64 stays float64, everything else runs in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def ssd_scan(x, dt, A, B, C, chunk_size: int, D=None):
    """Chunked selective-state-space scan from a zero state: y [b, l, h, p] (`ssd_scan_state`'s arguments
    and output, without the states)."""
    return ssd_scan_state(x, dt, A, B, C, chunk_size, D)[0]


def ssd_scan_state(x, dt, A, B, C, chunk_size: int, D=None, initial_state=None):
    """Chunked selective-state-space scan.

    x [b, l, h, p], dt [b, l, h] (already softplus'ed and clamped), A [h] (negative),
    B, C [b, l, g, n], D [h] or None, initial_state [b, h, p, n] or None (zero).
    Returns (y [b, l, h, p], the final state [b, h, p, n]), computed in `compute_dtype`.
    Any chunk size gives the same result; memory and time are linear in length.
    """
    b, l, h, p = x.shape
    dtype = compute_dtype(x)
    if l == 0:
        y = x.new_zeros(b, 0, h, p, dtype=dtype)
        s0 = x.new_zeros(b, h, p, B.shape[3], dtype=dtype) if initial_state is None else initial_state.to(dtype)
        return y, s0
    x, dt, A, B, C = (t.to(dtype) for t in (x, dt, A, B, C))
    D = D.to(dtype) if D is not None else None
    s0 = initial_state.to(dtype) if initial_state is not None else None
    return _SSD.apply(x, dt, A, B, C, D, s0, min(chunk_size, l))


def mamba_core(proj, conv_w, conv_b, dt_bias, A, D, mask, layout: CoreLayout):
    """The mixer between in_proj and the gated norm on CPU: the in_proj output proj [b, l, :] ->
    (scan output y [b, l, inner] in `compute_dtype`, gate z [b, l, inner]). mask [b, l] or None
    zeroes the conv output of padded steps; layout: the (local) config and its spans. Same
    arithmetic as conv -> dt -> `ssd_scan`."""
    return _MambaCore.apply(proj, conv_w, conv_b, dt_bias, A, D, mask, layout)


def gated_rms_norm(y, z, w, groups: int, eps: float):
    """w * group_rms_normalise(y * silu(z)), normalised in `compute_dtype` (fp32 as transformers, float64
    for float64 inputs, so a float64 model's result does not depend on the row blocking or the CPU's fp32
    summation order) and rounded to y's dtype."""
    return _GatedRMSNorm.apply(y, z, w, groups, eps)


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
            blk = Block(x[:, t0:t1], dt[:, t0:t1], A, B[:, t0:t1], C[:, t0:t1], D, Q)
            s, T = _fwd_block(blk, s, prev[:, k0:k1], _heads(y, k0, k1, Q, g))
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
            blk = Block(x[:, t0:t1], dt[:, t0:t1], A, B[:, t0:t1], C[:, t0:t1], D, Q)
            out = BlockGrads(dx[:, t0:t1], ddt[:, t0:t1], dB[:, t0:t1], dC[:, t0:t1], dA, dD)
            G = _bwd_block(blk, prev[:, k0:k1], y_off[i], dy[:, t0:t1], G, out)
        ds0 = G.reshape(b, h, p, n) if s0 is not None else None
        return dx[:, :l], ddt[:, :l], dA.view(h), dB[:, :l], dC[:, :l], dD, ds0, None


def _fwd_block(blk: Block, s, prev, yv):
    """Scan forward over one block of whole chunks (`Block`), s [b, g, r, p, n] the state entering it. Writes
    the output (D skip included) to yv [b, cb, g, r, Q, p] and the state entering each chunk to prev
    [b, cb, g, r, p, n]; returns the state after the block and the state->output term (kept for backward)."""
    x, B, D, Q = blk.x, blk.B, blk.D, blk.Q
    g, p = B.shape[2], x.shape[3]
    cb, r = x.shape[1] // Q, x.shape[2] // g
    Acum, X, Bh, Ch, CB, L, M = _ssd_block(blk)
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


def _bwd_block(blk: Block, prev, y_off, dy, G, out: BlockGrads):
    """Scan backward over one block (`_fwd_block`'s block, its saved prev and state->output term, the output
    gradient dy [b, cb*Q, h, p] and the gradient G of the state leaving the block). Writes dx, ddt, dB, dC
    of `out` (views of this block's steps), accumulates its dA [g, r] and dD [h]; returns the gradient of
    the state entering the block."""
    (x, dt, A, B, _, D, Q), (dx, ddt, dB, dC, dA, dD) = blk, out
    b, _, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    cb, r = x.shape[1] // Q, h // g
    Acum, X, Bh, Ch, CB, L, M = _ssd_block(blk)
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


def _elems(t) -> int:
    """Elements of one block tensor for t's device (read now: tests shrink BLOCK_ELEMS)."""
    return GPU_BLOCK_ELEMS if t.is_cuda else BLOCK_ELEMS


def _heads(t, k0, k1, Q, g):
    """[b, L, h, p] time steps of chunks k0..k1 viewed as [b, cb, g, r, Q, p] (no copy)."""
    b, _, h, p = t.shape
    return t[:, k0 * Q:k1 * Q].view(b, k1 - k0, Q, g, h // g, p).permute(0, 1, 3, 4, 2, 5)


def _heads_bc(t, k0, k1, Q):
    """[b, L, g, n] time steps of chunks k0..k1 viewed as [b, cb, g, Q, n] (no copy)."""
    b, _, g, n = t.shape
    return t[:, k0 * Q:k1 * Q].view(b, k1 - k0, Q, g, n).transpose(2, 3)


def _ssd_block(blk: Block):
    """Per-block quantities shared by forward and backward (over the block's cb chunks): cumulative
    log-decays Acum [b, cb, g, r, Q], X = dt x [b, cb, g, r, Q, p], B and C per head [b, cb, g, r, Q, n],
    C.B per group [b, cb, g, Q, Q], the decay mask L and M = C.B o L [b, cb, g, r, Q, Q]."""
    x, dt, A, B, C, _, Q = blk
    b, _, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r, cb = h // g, x.shape[1] // Q
    dt_h = dt[:, :cb * Q].view(b, cb, Q, g, r).permute(0, 1, 3, 4, 2)
    Acum = (dt_h * A.view(g, r, 1)).cumsum(-1)
    X = torch.mul(_heads(x, 0, cb, Q, g), dt_h[..., None], out=x.new_empty(b, cb, g, r, Q, p))
    Bh = _heads_bc(B, 0, cb, Q)[:, :, :, None].expand(b, cb, g, r, Q, n).contiguous()
    Ch = _heads_bc(C, 0, cb, Q)[:, :, :, None].expand(b, cb, g, r, Q, n).contiguous()
    CB = torch.matmul(Ch[:, :, :, 0], Bh[:, :, :, 0].transpose(-1, -2))
    L = (Acum[..., :, None] - Acum[..., None, :]).clamp_(-LOG_TINY, 0.0).exp_().mul_(_tril(Q, x.device, x.dtype))
    M = L * CB[:, :, :, None]
    return Acum, X, Bh, Ch, CB, L, M


@functools.lru_cache(maxsize=None)
def _tril(Q, device, dtype):
    """Lower-triangular 0/1 mask [Q, Q] (cached)."""
    return torch.ones(Q, Q, dtype=dtype, device=device).tril()


def _core_dims(cfg, l):
    """(heads, groups, state size, head dim, scan chunk) of the core under `cfg`, for length l."""
    return cfg.mamba.mamba_num_heads, cfg.mamba.n_groups, cfg.mamba.d_state, cfg.mamba.mamba_head_dim, min(CPU_CHUNK, l)


def _scan_views(conv_out, sp: Spans, h: int, g: int):
    """x [b, T, h, p], B and C [b, T, g, n] as views of a conv output block [b, T, conv channels]."""
    return (conv_out[..., sp.x].unflatten(-1, (h, -1)), conv_out[..., sp.B].unflatten(-1, (g, -1)),
            conv_out[..., sp.C].unflatten(-1, (g, -1)))


class _MambaCore(torch.autograd.Function):
    """`mamba_core`: causal conv + silu (x mask), dt = clamp(softplus(dt + dt_bias)) and the SSD scan with
    the D skip, fused over blocks of chunks. The conv output exists only per block (recomputed in
    backward); z is returned as a copy so that its gradient comes back here, and the backward writes
    the whole in_proj-output gradient into one tensor."""

    @staticmethod
    def forward(ctx, proj, w, conv_b, dt_bias, A, D, mask, layout):
        (cfg, sp), (b, l, _) = layout, proj.shape
        h, g, n, p, Q = _core_dims(cfg, l)
        cd = compute_dtype(proj)
        ctx.dtypes = [t.dtype if t is not None else None for t in (w, conv_b, dt_bias, A, D)]
        wk = w.view(w.shape[0], -1).t().to(cd).contiguous()  # [K, C]
        conv_b, dt_bias, A, D = (t.to(cd) if t is not None else None for t in (conv_b, dt_bias, A, D))
        src = proj[..., sp.conv]
        dt = F.softplus(proj[..., sp.dt].to(cd) + dt_bias).clamp(cfg.mamba.time_step_min, cfg.mamba.time_step_max)
        c = -(-l // Q)
        ys = proj.new_empty(b, l, h * p, dtype=cd)
        prev = proj.new_empty(b, c, g, h // g, p, n, dtype=cd)  # state entering each chunk
        s = proj.new_zeros(b, g, h // g, p, n, dtype=cd)
        y_off = []  # per block exp(Acum) C.state_in, kept for backward
        for k0, k1 in _chunk_blocks(c, b * h * Q * max(p, Q)):
            t0, t1, Tp = k0 * Q, min(k1 * Q, l), (k1 - k0) * Q
            x, B, C = _scan_views(_core_conv(src, wk, conv_b, mask, t0, t1, Tp), sp, h, g)
            y = x.new_empty(b, Tp, h, p)
            s, T = _fwd_block(Block(x, _pad_to(dt[:, t0:t1], Tp), A, B, C, D, Q), s, prev[:, k0:k1],
                              _heads(y, 0, k1 - k0, Q, g))
            y_off.append(T)
            ys[:, t0:t1] = y.view(b, Tp, -1)[:, :t1 - t0]
        z = torch.empty(b, l, h * p, dtype=proj.dtype, device=proj.device)
        z.copy_(proj[..., sp.z])
        ctx.save_for_backward(proj, wk, conv_b, dt_bias, A, D, mask, prev, *y_off)  # checkpoint sees them all
        ctx.cfg, ctx.sp, ctx.cd = cfg, sp, cd
        return ys, z

    @staticmethod
    def backward(ctx, dys, dz):
        proj, wk, conv_b, dt_bias, A, D, mask, prev, *y_off = ctx.saved_tensors
        cfg, sp, cd, (b, l, _), K = ctx.cfg, ctx.sp, ctx.cd, proj.shape, wk.shape[0]
        h, g, n, p, Q = _core_dims(cfg, l)
        tmin, tmax = cfg.mamba.time_step_min, cfg.mamba.time_step_max
        src, raw = proj[..., sp.conv], proj[..., sp.dt]
        dproj = torch.empty(proj.shape, dtype=proj.dtype, device=proj.device)
        if dz is None:
            dproj[..., sp.z].zero_()
        else:
            dproj[..., sp.z] = dz
        if dys is None:
            dys = proj.new_zeros(b, l, h * p, dtype=cd)
        dwk, db = torch.zeros_like(wk), torch.zeros_like(conv_b) if conv_b is not None else None
        dA = torch.zeros(g, h // g, dtype=cd, device=proj.device)
        dD = torch.zeros_like(D) if D is not None else None
        ddt_bias = torch.zeros_like(dt_bias)
        G = proj.new_zeros(b, g, h // g, p, n, dtype=cd)  # gradient of the state leaving the block
        look = None  # conv-output gradient of the K-1 steps after the sub-block processed last
        blocks = _chunk_blocks(prev.shape[1], b * h * Q * max(p, Q))
        for i in reversed(range(len(blocks))):
            k0, k1 = blocks[i]
            t0, t1, Tp = k0 * Q, min(k1 * Q, l), (k1 - k0) * Q
            pre = proj.new_empty(b, t1 - t0, wk.shape[1], dtype=cd)
            conv_out = _core_conv(src, wk, conv_b, mask, t0, t1, Tp, pre)
            rawb = raw[:, t0:t1].to(cd) + dt_bias
            spl = F.softplus(rawb)
            dY = _pad_to(dys[:, t0:t1].to(cd), Tp).unflatten(-1, (h, p))
            # scan
            dconv, ddt = torch.empty_like(conv_out), conv_out.new_empty(b, Tp, h)
            (x, B, C), (dx, dB, dC) = _scan_views(conv_out, sp, h, g), _scan_views(dconv, sp, h, g)
            G = _bwd_block(Block(x, _pad_to(spl.clamp(tmin, tmax), Tp), A, B, C, D, Q), prev[:, k0:k1], y_off[i], dY,
                           G, BlockGrads(dx, ddt, dB, dC, dA, dD))
            # dt = clamp(softplus(raw + dt_bias))
            ddt = ddt[:, :t1 - t0] * ((spl >= tmin) & (spl <= tmax))
            ddt = torch.ops.aten.softplus_backward(ddt, rawb, 1.0, 20.0)
            ddt_bias += ddt.sum((0, 1))
            dproj[:, t0:t1, sp.dt] = ddt
            # causal conv + silu, in sub-blocks (last first)
            for s0, s1 in reversed(_sub_spans(t0, t1, wk.shape[1] * b, K)):
                a0, a1 = s0 - t0, s1 - t0
                gr = dconv[:, a0:a1] if mask is None else dconv[:, a0:a1] * mask[:, s0:s1, None]
                gr = torch.ops.aten.silu_backward(gr, pre[:, a0:a1])
                look = _conv_backward(src, wk, gr, look, s0, dproj[:, s0:s1, sp.conv], dwk, db)
        grads = (dwk.t().reshape(-1, 1, K), db, ddt_bias, dA.view(h), dD)
        grads = [x.to(dt) if x is not None else None for x, dt in zip(grads, ctx.dtypes)]
        return (dproj, *grads, None, None)


class _GatedRMSNorm(torch.autograd.Function):
    """`gated_rms_norm` with a hand-written backward (keeps y, z and 1/rms). Both directions run over
    blocks of rows that stay in cache: every intermediate (silu(z), the gated and normalised values,
    their gradients) lives only for one block, so each full-length tensor is read or written once."""

    @staticmethod
    def forward(ctx, y, z, w, groups, eps):
        shape, Im = y.shape, y.shape[-1]
        y2, z2 = y.reshape(-1, Im), z.reshape(-1, Im)
        # as transformers: normalise in fp32 (float64 stays float64), round to y's dtype, then times the weight
        cd = compute_dtype(y)
        out = torch.empty(y2.shape, dtype=torch.promote_types(y.dtype, w.dtype), device=y.device)
        rs = torch.empty(y2.shape[0], groups, 1, dtype=cd, device=y.device)
        for r0, r1 in _chunk_blocks(y2.shape[0], Im, _elems(y2)):  # rows
            yz = F.silu(z2[r0:r1].to(cd)).mul_(y2[r0:r1].to(cd)).view(r1 - r0, groups, -1)
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
        cd = rs.dtype  # the forward's compute dtype
        dw = torch.zeros(Im, dtype=cd, device=y.device) if need_w else None
        wf = w.to(cd)
        for r0, r1 in _chunk_blocks(y2.shape[0], Im, _elems(y2)):  # rows
            R = r1 - r0
            yf, zf, do = y2[r0:r1].to(cd), z2[r0:r1].to(cd), do2[r0:r1].to(cd)
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
