"""Fused vocabulary losses: CE and KL straight from hidden states and the lm_head weight, in token chunks.

No [tokens, V] logits tensor is ever materialised, for the student or the teacher (Liger-style fused
linear loss). The loss is a scalar, so its gradients are computed during the forward: per token chunk
(up to ROWS_MAX rows) a first pass over vocabulary blocks gives each row's log-sum-exp, a second one
recomputes each block's logits (kept instead when one block is the whole vocabulary) for the
gradient block, whose grad_W rows are written once (one token chunk) or accumulated in fp32 (several);
backward scales the stored gradients by grad_output in place. On a GPU this trades a fourth [N, V, H]
matmul for the [V, H] read-modify-write per chunk that the token-only chunking paid (the 8B window's
largest profile row, bench/gpu_profile_8b_ours.txt). Peak extra memory: a few [rows, block] fp32 blocks
(~CHUNK_ELEMS each), grad_h [N, H] and grad_W [V, H] in W's dtype (fp32 with several chunks).
Each block's arithmetic (`_block_stats`, `_softmax_grad`, `_kl_block`) reads the raw logits in the matmul's
dtype and is one torch.compile'd kernel on CUDA (`_kernel`); CE's one-hot part is applied once per token
chunk, exactly (`_Grads.onehot`), so the blocks carry the softmax alone.

Same definitions as pipelines.training.losses.lm_loss / kl_div on `h @ W.T` (CE mean over non-ignored tokens;
KL(teacher || student) of softmax(z / T) summed over the vocabulary, mean over tokens, no T^2).

Caller (next-token CE; KL at every position, as compute_losses does):
    h = model(ids, return_hidden=True); w = lm_head_weight(model)
    ce = fused_lm_loss(h[:, :-1].reshape(-1, H), w, ids[:, 1:].reshape(-1), group=vocab_group)
    kl = fused_kl_div(h.reshape(-1, H), w, h_t.reshape(-1, H_t), lm_head_weight(teacher), T, group=vocab_group)

Call the model (its forward, not `hidden`) before reading lm_head_weight: under FSDP2 the root's hooks
then hold the full embeddings / lm_head until the backward, whose final callback reduce-scatters the
gradient given here.

Tensor parallelism (`group` = parallel_info(model).vocab_group): h is replicated, W is this rank's
vocabulary shard (rows [r*Vl, (r+1)*Vl)); the logsumexp, the picked target logit and the per-token KL
are all-reduced over the group (pipelines.training.vocab_parallel's math, in place), grad_h is all-reduced (h is
replicated), grad_W stays local. A full (unsharded) teacher weight is sliced to this rank's shard.
Every rank returns the same loss. Under autocast the matmuls run in the autocast dtype (as the
unfused F.linear would), the softmax arithmetic in fp32.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

from remodel.models.mamba import optional_import

from ..distributed.collectives import group_rank, group_size
from .compiled import Compiled

CHUNK_ELEMS = 1 << 25  # one [rows, vocabulary block] fp32 block: ~128 MB
ROWS_MAX = 1 << 14  # default token rows per chunk: the weight-gradient GEMM's inner size stays large
BLOCK_ALIGN = 64  # vocabulary rows per block, a multiple of this (aligned GEMM operands)
COMPILE = True  # on CUDA each block's softmax arithmetic runs torch.compile'd (`_kernel`); False: eager there too
LIGER = False  # True: on CUDA, the vocabulary on one rank, the CE is liger-kernel's where it imports (`_liger_ce`).
# Off by default since the H200 lease of 2026-11-28: with it on, the 8B window's plain step went 0.201 -> 0.240 s
# (transformers' step beside it 0.232 -> 0.234 s; the distill step, whose CE is ours, 0.289 s both times).
LIGER_CE = ("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy")
_COMPILED: dict = {}


class _Run(NamedTuple):
    """How a fused loss runs: token rows per chunk (None: `_plan`'s default), the vocab group, and which
    gradients (w.r.t. the hidden states, the weight) the forward computes."""
    chunk: int | None
    group: object
    need_h: bool
    need_w: bool


def lm_head_weight(model):
    """The output projection [V(_local), H]: lm_head.weight, or the tied embedding weight."""
    return model.embeddings.weight if model.lm_head is None else model.lm_head.weight


def _plan(chunk, N: int, Vl: int, blocks: int = 1, cuda: bool = True):
    """(token rows per chunk, vocabulary rows per block): `chunk` rows (default: up to ROWS_MAX on a GPU; on
    CPU rows such that one [rows, V] block is ~CHUNK_ELEMS, the whole vocabulary per block, where the
    [V, H] accumulation is cheap and a fourth matmul is not), and
    blocks of the vocabulary small enough that `blocks` [rows, block] fp32 tensors are ~CHUNK_ELEMS each,
    a multiple of BLOCK_ALIGN rows unless one block is the whole vocabulary: an odd block width (4097 at
    8190 rows) made every logits GEMM's leading dimension odd, and cuBLAS fell back from Hopper's kernels
    to sm75 align-1 ones, 5x slower (bench/gpu_profile_8b_ours.txt)."""
    default = ROWS_MAX if cuda else CHUNK_ELEMS // (blocks * Vl)
    rows = max(1, min(int(chunk) if chunk else default, max(N, 1)))
    vb = max(1, min(Vl, CHUNK_ELEMS // (blocks * rows)))
    return rows, vb if vb >= Vl else max(BLOCK_ALIGN, vb // BLOCK_ALIGN * BLOCK_ALIGN)


def _compute_dtype(h, w):
    """Matmul dtype: the autocast dtype where autocast is on (what F.linear would use), else promoted."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(h.dtype, w.dtype)


class _Grads:
    """grad_h and grad_W built block by block: grad_h rows of a token chunk summed over vocabulary blocks in
    fp32, grad_W rows written once per block when there is one token chunk (no [V, H] accumulator, no
    [V, H] temporary), accumulated in fp32 over several chunks otherwise."""

    def __init__(self, h, w, cd, need_h: bool, need_w: bool, one_chunk: bool):
        self.h, self.w, self.one = h, w, one_chunk
        self.gh = torch.empty(h.shape, dtype=cd, device=h.device) if need_h else None
        self.gw = None
        if need_w:
            self.gw = (torch.empty(w.shape, dtype=w.dtype, device=w.device) if one_chunk
                       else torch.zeros(w.shape, dtype=torch.float32, device=w.device))
        self.acc = None

    def wanted(self) -> bool:
        return self.gh is not None or self.gw is not None

    def block(self, dz, hc, wc, a: int, b: int, v0: int):
        """dz [rows, vb] in the matmul dtype: dloss/dlogits of token rows a:b, vocabulary rows v0:v0+vb."""
        vb = dz.shape[1]
        if self.gh is not None:
            part = dz @ wc[v0:v0 + vb]
            self.acc = part.float() if self.acc is None else self.acc.add_(part)
        if self.gw is None:
            return
        rows, same = self.gw[v0:v0 + vb], self.gw.dtype == dz.dtype  # same dtype: no [vb, H] temporary
        if self.one and same:
            torch.mm(dz.T, hc[a:b], out=rows)
        elif self.one:
            rows.copy_(dz.T @ hc[a:b])
        elif same:
            rows.addmm_(dz.T, hc[a:b])
        else:
            rows.add_(dz.T @ hc[a:b])

    def onehot(self, hc, wc, idx, c, a: int, b: int):
        """The CE gradient's one-hot part for token rows a:b, after their blocks: -c_i at logit (i, idx_i)
        (c [rows, 1] fp32, 0 where the label is ignored or on another rank), so grad_h_i -= c_i W[idx_i]
        and grad_W[idx_i] -= c_i h_i: exact, where folding it into each block rounded it with the softmax."""
        lab = idx[a:b]
        if self.gh is not None:
            part = c * wc[lab].float()
            self.acc = -part if self.acc is None else self.acc.sub_(part)
        if self.gw is not None:
            self.gw.index_add_(0, lab, (c * hc[a:b].float()).neg_().to(self.gw.dtype))

    def end_chunk(self, a: int, b: int):
        if self.acc is not None:
            self.gh[a:b].copy_(self.acc)
            self.acc = None

    def finish(self, group):
        """All-reduce grad_h over the vocab group (h is replicated there); cast to the inputs' dtypes."""
        gh, gw = self.gh, self.gw
        if gh is not None:
            if group_size(group) > 1:
                dist.all_reduce(gh, group=group)
            gh = gh.to(self.h.dtype)
        return gh, (gw.to(self.w.dtype) if gw is not None else None)


def _logits(hc, wc, a, b, v0, vb, cache=None):
    """Logits of token rows a:b over vocabulary rows v0:v0+vb, raw (the matmul's dtype). `cache` (a dict):
    when the block is the whole vocabulary it is kept there and the second pass takes it back instead of
    recomputing it."""
    if cache is not None and "z" in cache:
        return cache.pop("z")
    z = hc[a:b] @ wc[v0:v0 + vb].T
    if cache is not None and vb == wc.shape[0]:
        cache["z"] = z
    return z


def _kernel(fn, cuda: bool):
    """fn, or on CUDA (COMPILE) its torch.compile'd form: one fused kernel reading the block once in the
    matmul's dtype, where the eager form makes ~6 fp32 passes (26 ms of the 8B window's 220 ms step on an
    H200, bench/gpu_profile_8b_ours.txt). Both compute the same thing; CPU runs the eager form."""
    if not (cuda and COMPILE):
        return fn
    if fn not in _COMPILED:
        # dynamic=False: torch 2.13's dynamic float reused a CE graph, 1 / T = 1.0, for the KL's 1 / T = 0.5
        # under bf16 and returned a 10x smaller loss (tests/test_fused_loss.py)
        _COMPILED[fn] = Compiled(fn, "fused loss block arithmetic", dynamic=False)
    return _COMPILED[fn]


def _block_stats(z, inv_t: float):
    """(row max, row sum of exp(z / T - max)) of a block of raw logits z, fp32 [rows, 1] each. Eager, by
    eighths of the rows: z may be kept for the second pass, and a whole fp32 temporary beside it would
    double the CPU's peak (one block of the whole vocabulary there). A max that is not finite counts as 0
    (vocab_parallel_logsumexp's shift, as `_group_max`)."""
    m = z.amax(-1, keepdim=True).float() * inv_t
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    step = z.shape[0] if torch.compiler.is_compiling() else -(-z.shape[0] // 8)
    return m, torch.cat([torch.add(-m[i:i + step], z[i:i + step], alpha=inv_t).exp_().sum(-1, keepdim=True)
                         for i in range(0, z.shape[0], step)])


def _shifted(z, lse, inv_t: float):
    """z / T - lse in fp32: in place when z is fp32 (its last use: no second block on the CPU's one-block
    plan), else a new fp32 block (a bf16 z under autocast)."""
    if z.dtype != torch.float32:
        return torch.add(-lse, z, alpha=inv_t)
    return (z.mul_(inv_t) if inv_t != 1.0 else z).sub_(lse)


def _softmax_grad(z, lse, scale, dtype):
    """softmax(z) * scale over a block (lse: the rows' log-sum-exp) in the matmul dtype: the CE gradient
    without its one-hot part (`_Grads.onehot` subtracts that exactly, once per token chunk)."""
    return _shifted(z, lse, 1.0).exp_().mul_(scale).to(dtype)


def _kl_block(zq, zp, lse_q, lse_p, inv_t: float, wscale, dtype):
    """(per row sum of p (log p - log q), 0 where p == 0; (q - p) * wscale in dtype, None without one) for a block
    pair of raw student (zq) and teacher (zp) logits: the KL's value and gradient w.r.t. the logits."""
    logq, logp = _shifted(zq, lse_q, inv_t), _shifted(zp, lse_p, inv_t)
    p = logp.exp()
    per = logp.sub_(logq).mul_(p).masked_fill_(p == 0, 0.0).sum(-1)
    return per, (None if dtype is None else logq.exp_().sub_(p).mul_(wscale).to(dtype))


def _lse(stats, group):
    """Log-sum-exp over the (sharded) vocabulary from the blocks' (row max, row sum exp) pairs."""
    m = s = None
    for bm, bs in stats:
        if m is None:
            m, s = bm, bs
            continue
        new = torch.maximum(m, bm)
        s = s * torch.exp(m - new) + bs * torch.exp(bm - new)
        m = new
    big = _group_max(m, group)
    return big + _group_sum(s * torch.exp(m - big), group).log()


def _label_in_block(idx, inside, a: int, b: int, v0: int, width: int):
    """(rows a:b whose label lies in vocabulary rows v0:v0+width [c, 1], that label's column there, clamped
    into the block for the rows whose label lies elsewhere [c, 1])."""
    i = idx[a:b, None] - v0
    return inside[a:b, None] & (i >= 0) & (i < width), i.clamp(0, width - 1)


def _ce_chunks(h, w, labels, ignore_index, run: _Run, cd):
    """-> (loss, grad_h, grad_W) of the mean CE: per token chunk, the log-sum-exp over vocabulary blocks,
    then (with gradients) the blocks again for softmax, and the one-hot part once."""
    chunk, group = run.chunk, run.group
    hc, wc = h.detach().to(cd), w.detach().to(cd)
    N, Vl = h.shape[0], w.shape[0]
    keep = labels != ignore_index
    n = keep.sum().clamp(min=1).to(torch.float32)
    local = labels - group_rank(group) * Vl
    inside = (local >= 0) & (local < Vl) & keep
    idx = torch.where(inside, local, torch.zeros_like(local))
    rows, vb = _plan(chunk, N, Vl, cuda=h.is_cuda)
    grads = _Grads(h, w, cd, run.need_h, run.need_w, rows >= N)
    stats, softmax_grad = _kernel(_block_stats, h.is_cuda), _kernel(_softmax_grad, h.is_cuda)
    total = torch.zeros((), dtype=torch.float64, device=h.device)
    for a in range(0, N, rows):
        b, cache = min(a + rows, N), ({} if grads.wanted() else None)
        picked = torch.zeros(b - a, 1, dtype=torch.float32, device=h.device)

        def blocks():
            for v0 in range(0, Vl, vb):
                z = _logits(hc, wc, a, b, v0, vb, cache=cache)
                sel, col = _label_in_block(idx, inside, a, b, v0, z.shape[1])
                picked.add_(torch.where(sel, z.gather(1, col).float(), 0.0))
                yield stats(z, 1.0)
        lse = _lse(blocks(), group)
        picked = _group_sum(picked, group)
        total += ((lse - picked).squeeze(1) * keep[a:b]).sum(dtype=torch.float64)
        if not grads.wanted():
            continue
        scale = (keep[a:b, None] / n).to(torch.float32)
        for v0 in range(0, Vl, vb):
            grads.block(softmax_grad(_logits(hc, wc, a, b, v0, vb, cache=cache), lse, scale, cd), hc, wc, a, b, v0)
        grads.onehot(hc, wc, idx, scale * inside[a:b, None], a, b)
        grads.end_chunk(a, b)
    return ((total / n).to(torch.float32),) + grads.finish(group)


class _GradsInForward(torch.autograd.Function):
    """Backward of a loss whose gradients w.r.t. its first two inputs were computed in the forward:
    scale them by grad_output; the `ctx.n_rest` other inputs get none."""

    @staticmethod
    def backward(ctx, g):
        """Scales the stored gradients in place (no second [V, H] copy): one backward per loss."""
        gh, gw = ctx.saved_tensors
        return (gh.mul_(g) if gh is not None else None, gw.mul_(g) if gw is not None else None) + (None,) * ctx.n_rest


class _FusedLMLoss(_GradsInForward):
    @staticmethod
    def forward(ctx, h, w, labels, ignore_index, run):
        cd = _compute_dtype(h, w)
        with torch.autocast(h.device.type, enabled=False):
            loss, gh, gw = _ce_chunks(h, w, labels, ignore_index, run, cd)
        ctx.save_for_backward(gh, gw)
        ctx.n_rest = 3
        return loss


def fused_lm_loss(h, weight, labels, chunk: int | None = None, ignore_index: int = -100, group=None):
    """Mean cross-entropy of the logits h @ weight.T against labels over the tokens != ignore_index,
    never materialising [N, V]. h [N, H] (final hidden states, after norm_f), weight [V_local, H],
    labels [N] (already shifted by the caller). Equals losses.lm_loss(h @ weight.T, labels)."""
    need_h = torch.is_grad_enabled() and h.requires_grad
    need_w = torch.is_grad_enabled() and weight.requires_grad
    liger = _liger_ce(h, group) if need_h or need_w else None  # liger computes gradients in its forward
    if liger is not None:
        return liger(h, weight, labels, ignore_index=ignore_index)
    return _FusedLMLoss.apply(h, weight, labels, ignore_index, _Run(chunk, group, need_h, need_w))


def _on_gpu(h) -> bool:
    """Whether h is where liger's Triton kernels run (the tests force this on CPU tensors)."""
    return h.is_cuda


def _liger_ce(h, group):
    """liger-kernel's fused linear cross-entropy where it applies, else None: CUDA, LIGER on, the whole
    vocabulary on this rank (liger has no vocabulary-parallel form) and installed. On an H200 at 8K x 4096 x
    131k alone it beat ours (0.055 s / 1.13 GiB against 0.062 s / 1.56 GiB), but not inside the train step
    (see LIGER); the KL stays ours (liger's JSD took 1.1x the time and 1.7x the memory)."""
    if not (LIGER and _on_gpu(h) and group_size(group) == 1):
        return None
    return liger_ce()


@functools.lru_cache(maxsize=None)
def liger_ce():
    """liger's `liger_fused_linear_cross_entropy`, or None where it does not import (tried once)."""
    return optional_import(*LIGER_CE)


def _teacher_shard(w_t, Vl: int, group):
    """This rank's vocabulary rows of the teacher weight (sharded already, or full)."""
    if w_t.shape[0] == Vl:
        return w_t
    r = group_rank(group)
    return w_t[r * Vl:(r + 1) * Vl]


def _group_max(z, group):
    """Row max over the (sharded) vocabulary, 0 where not finite (vocab_parallel_logsumexp's shift)."""
    m = z.amax(-1, keepdim=True)
    if group_size(group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _group_sum(x, group):
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def _kl_chunks(h_s, w_s, h_t, w_t, temperature, keep, run: _Run, cds):
    """-> (loss, grad_h_s, grad_W_s) of the mean KL: per token chunk, both log-sum-exps over vocabulary
    blocks, then the block pairs again for p (log p - log q) and (q - p) / T. cds: the student's and the
    teacher's matmul dtypes."""
    (cd, cdt), group = cds, run.group
    hs, ws = h_s.detach().to(cd), w_s.detach().to(cd)
    w_t = _teacher_shard(w_t, w_s.shape[0], group)
    ht, wt = h_t.detach().to(cdt), w_t.detach().to(cdt)
    N, Vl, T = h_s.shape[0], w_s.shape[0], temperature
    keep = torch.ones(N, dtype=torch.float32, device=h_s.device) if keep is None else keep.to(torch.float32)
    n = keep.sum().clamp(min=1)
    rows, vb = _plan(run.chunk, N, Vl, blocks=2, cuda=h_s.is_cuda)
    grads = _Grads(h_s, w_s, cd, run.need_h, run.need_w, rows >= N)
    stats, kl_block = _kernel(_block_stats, h_s.is_cuda), _kernel(_kl_block, h_s.is_cuda)
    total = torch.zeros((), dtype=torch.float64, device=h_s.device)
    for a in range(0, N, rows):
        b, cs, ct = min(a + rows, N), {}, {}
        lse_q = _lse((stats(_logits(hs, ws, a, b, v0, vb, cs), 1 / T) for v0 in range(0, Vl, vb)), group)
        lse_p = _lse((stats(_logits(ht, wt, a, b, v0, vb, ct), 1 / T) for v0 in range(0, Vl, vb)), group)
        per = torch.zeros(b - a, dtype=torch.float32, device=h_s.device)
        wscale = keep[a:b, None] / (n * T)
        for v0 in range(0, Vl, vb):  # each block pair freed before the next is allocated
            part, dz = kl_block(_logits(hs, ws, a, b, v0, vb, cs), _logits(ht, wt, a, b, v0, vb, ct), lse_q, lse_p,
                                1 / T, wscale, cd if grads.wanted() else None)
            per += part
            if dz is not None:
                grads.block(dz, hs, ws, a, b, v0)
            del part, dz
        grads.end_chunk(a, b)
        total += (_group_sum(per, group) * keep[a:b]).sum(dtype=torch.float64)
    return ((total / n).to(torch.float32),) + grads.finish(group)


class _FusedKL(_GradsInForward):
    @staticmethod
    def forward(ctx, h_s, w_s, h_t, w_t, temperature, keep, run):
        cds = _compute_dtype(h_s, w_s), _compute_dtype(h_t, w_t)
        with torch.autocast(h_s.device.type, enabled=False):
            loss, gh, gw = _kl_chunks(h_s, w_s, h_t, w_t, temperature, keep, run, cds)
        ctx.save_for_backward(gh, gw)
        ctx.n_rest = 5
        return loss


def fused_kl_div(h_s, w_s, h_t, w_t, temperature: float = 1.0, chunk: int | None = None, group=None, mask=None):
    """KL(teacher || student) of softmax(logits / T), summed over the vocabulary, mean over the (unmasked)
    tokens, no T^2; student logits h_s @ w_s.T, teacher logits h_t @ w_t.T (frozen: no gradient),
    neither materialised as [N, V]. h_s [N, H_s], w_s [V_local, H_s], h_t [N, H_t], w_t [V_local or V,
    H_t]. Equals losses.kl_div(h_s @ w_s.T, h_t @ w_t.T, T, mask)."""
    need_h = torch.is_grad_enabled() and h_s.requires_grad
    need_w = torch.is_grad_enabled() and w_s.requires_grad
    keep = None if mask is None else mask.reshape(-1).bool()
    return _FusedKL.apply(h_s, w_s, h_t, w_t, float(temperature), keep, _Run(chunk, group, need_h, need_w))
