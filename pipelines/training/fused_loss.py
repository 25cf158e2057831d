"""Fused vocabulary losses: CE and KL straight from hidden states and the lm_head weight, in token chunks.

No [tokens, V] logits tensor is ever materialised, for the student or the teacher (Liger-style fused
linear loss). The loss is a scalar, so its gradients are computed during the forward, one [chunk, V]
block at a time: grad_h rows are written per chunk, grad_W is accumulated (fp32); backward only
scales the stored gradients by grad_output. Peak extra memory: one [chunk, V] fp32 block for CE, about
three for KL, plus grad_h [N, H] and an fp32 grad_W [V, H].

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

import torch
import torch.distributed as dist

from ..distributed.collectives import group_rank, group_size

CHUNK_ELEMS = 1 << 25  # default chunk: rows such that one [chunk, V_local] fp32 block is ~128 MB


def lm_head_weight(model):
    """The output projection [V(_local), H]: lm_head.weight, or the tied embedding weight."""
    return model.embeddings.weight if model.lm_head is None else model.lm_head.weight


def _chunk_rows(chunk, V: int) -> int:
    return int(chunk) if chunk else max(1, CHUNK_ELEMS // V)


def _compute_dtype(h, w):
    """Matmul dtype: the autocast dtype where autocast is on (what F.linear would use), else promoted."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(h.dtype, w.dtype)


def _accumulate(gw, dz, x):
    """gw (fp32) += dz.T @ x, without a [V, H] temporary when everything is fp32."""
    if gw.dtype == dz.dtype:
        gw.addmm_(dz.T, x)
    else:
        gw.add_(dz.T @ x)


def _finish(gh, gw, group, h, w):
    """All-reduce grad_h over the vocab group (h is replicated there); cast to the inputs' dtypes."""
    if gh is not None:
        if group_size(group) > 1:
            dist.all_reduce(gh, group=group)
        gh = gh.to(h.dtype)
    return gh, (gw.to(w.dtype) if gw is not None else None)


def _grad_buffers(h, w, cd, need_h: bool, need_w: bool):
    gh = torch.empty(h.shape, dtype=cd, device=h.device) if need_h else None
    gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
    return gh, gw


def _backprop_chunk(dz, hc, wc, gh, gw, a: int, b: int):
    """dz [c, Vl] fp32 (dloss/dlogits of rows a:b) -> grad_h rows and the grad_W accumulation."""
    dz = dz.to(wc.dtype)
    if gh is not None:
        torch.mm(dz, wc, out=gh[a:b])
    if gw is not None:
        _accumulate(gw, dz, hc[a:b])


def _ce_chunks(h, w, labels, chunk, ignore_index, group, need_h, need_w, cd):
    """-> (loss, grad_h, grad_W) of the mean CE, one [chunk, Vl] block at a time."""
    hc, wc = h.detach().to(cd), w.detach().to(cd)
    N, Vl = h.shape[0], w.shape[0]
    keep = labels != ignore_index
    n = keep.sum().clamp(min=1).to(torch.float32)
    local = labels - group_rank(group) * Vl
    inside = (local >= 0) & (local < Vl) & keep
    idx = torch.where(inside, local, torch.zeros_like(local))
    gh, gw = _grad_buffers(h, w, cd, need_h, need_w)
    total = torch.zeros((), dtype=torch.float64, device=h.device)
    step = _chunk_rows(chunk, Vl)
    for a in range(0, N, step):
        b = min(a + step, N)
        z = (hc[a:b] @ wc.T).float()
        i, m = idx[a:b, None], inside[a:b, None]
        picked = _group_sum(torch.where(m, z.gather(1, i), torch.zeros_like(z[:, :1])), group)
        mx = _group_max(z, group)
        s = _group_sum(z.sub_(mx).exp_().sum(-1, keepdim=True), group)  # z <- exp(z - max), in place
        total += ((mx + s.log() - picked).squeeze(1) * keep[a:b]).sum(dtype=torch.float64)
        if gh is None and gw is None:
            del z
            continue
        z.div_(s)  # softmax
        z.scatter_add_(1, i, -m.to(z.dtype))
        z.mul_((keep[a:b, None] / n).to(z.dtype))
        _backprop_chunk(z, hc, wc, gh, gw, a, b)
        del z  # before the next chunk's block is allocated
    return ((total / n).to(torch.float32),) + _finish(gh, gw, group, h, w)


class _GradsInForward(torch.autograd.Function):
    """Backward of a loss whose gradients w.r.t. its first two inputs were computed in the forward:
    scale them by grad_output; the `ctx.n_rest` other inputs get none."""

    @staticmethod
    def backward(ctx, g):
        gh, gw = ctx.saved_tensors
        return (gh * g if gh is not None else None, gw * g if gw is not None else None) + (None,) * ctx.n_rest


class _FusedLMLoss(_GradsInForward):
    @staticmethod
    def forward(ctx, h, w, labels, chunk, ignore_index, group, need_h, need_w):
        cd = _compute_dtype(h, w)
        with torch.autocast(h.device.type, enabled=False):
            loss, gh, gw = _ce_chunks(h, w, labels, chunk, ignore_index, group, need_h, need_w, cd)
        ctx.save_for_backward(gh, gw)
        ctx.n_rest = 6
        return loss


def fused_lm_loss(h, weight, labels, chunk: int | None = None, ignore_index: int = -100, group=None):
    """Mean cross-entropy of the logits h @ weight.T against labels over the tokens != ignore_index,
    never materialising [N, V]. h [N, H] (final hidden states, after norm_f), weight [V_local, H],
    labels [N] (already shifted by the caller). Equals losses.lm_loss(h @ weight.T, labels)."""
    need_h = torch.is_grad_enabled() and h.requires_grad
    need_w = torch.is_grad_enabled() and weight.requires_grad
    return _FusedLMLoss.apply(h, weight, labels, chunk, ignore_index, group, need_h, need_w)


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


def _log_softmax_(z, temperature: float, group):
    """In place: z <- log_softmax(z / T) over the (sharded) vocabulary; one [c, Vl] temporary (exp)."""
    z.div_(temperature)
    z.sub_(_group_max(z, group))
    return z.sub_(_group_sum(z.exp().sum(-1, keepdim=True), group).log_())


def _kl_chunks(h_s, w_s, h_t, w_t, temperature, chunk, group, keep, need_h, need_w, cd, cdt):
    """-> (loss, grad_h_s, grad_W_s) of the mean KL, one [chunk, Vl] block pair at a time."""
    hs, ws = h_s.detach().to(cd), w_s.detach().to(cd)
    w_t = _teacher_shard(w_t, w_s.shape[0], group)
    ht, wt = h_t.detach().to(cdt), w_t.detach().to(cdt)
    N, Vl = h_s.shape[0], w_s.shape[0]
    keep = torch.ones(N, dtype=torch.float32, device=h_s.device) if keep is None else keep.to(torch.float32)
    n = keep.sum().clamp(min=1)
    gh, gw = _grad_buffers(h_s, w_s, cd, need_h, need_w)
    total = torch.zeros((), dtype=torch.float64, device=h_s.device)
    step = _chunk_rows(chunk, 2 * Vl)
    for a in range(0, N, step):
        b = min(a + step, N)
        logq = _log_softmax_((hs[a:b] @ ws.T).float(), temperature, group)
        logp = _log_softmax_((ht[a:b] @ wt.T).float(), temperature, group)
        p = logp.exp()
        logp.sub_(logq).mul_(p).masked_fill_(p == 0, 0.0)  # p (log p - log q), 0 where p == 0
        per = _group_sum(logp.sum(-1), group)
        total += (per * keep[a:b]).sum(dtype=torch.float64)
        del logp
        if gh is not None or gw is not None:
            dz = logq.exp_().sub_(p).mul_((keep[a:b, None] / (n * temperature)))  # (q - p) / (T n)
            _backprop_chunk(dz, hs, ws, gh, gw, a, b)
            del dz
        del logq, p  # every block freed before the next chunk's are allocated
    return ((total / n).to(torch.float32),) + _finish(gh, gw, group, h_s, w_s)


class _FusedKL(_GradsInForward):
    @staticmethod
    def forward(ctx, h_s, w_s, h_t, w_t, temperature, chunk, group, keep, need_h, need_w):
        cd, cdt = _compute_dtype(h_s, w_s), _compute_dtype(h_t, w_t)
        with torch.autocast(h_s.device.type, enabled=False):
            loss, gh, gw = _kl_chunks(h_s, w_s, h_t, w_t, temperature, chunk, group, keep, need_h, need_w, cd, cdt)
        ctx.save_for_backward(gh, gw)
        ctx.n_rest = 8
        return loss


def fused_kl_div(h_s, w_s, h_t, w_t, temperature: float = 1.0, chunk: int | None = None, group=None, mask=None):
    """KL(teacher || student) of softmax(logits / T), summed over the vocabulary, mean over the (unmasked)
    tokens, no T^2; student logits h_s @ w_s.T, teacher logits h_t @ w_t.T (frozen: no gradient),
    neither materialised as [N, V]. h_s [N, H_s], w_s [V_local, H_s], h_t [N, H_t], w_t [V_local or V,
    H_t]. Equals losses.kl_div(h_s @ w_s.T, h_t @ w_t.T, T, mask)."""
    need_h = torch.is_grad_enabled() and h_s.requires_grad
    need_w = torch.is_grad_enabled() and w_s.requires_grad
    keep = None if mask is None else mask.reshape(-1).bool()
    return _FusedKL.apply(h_s, w_s, h_t, w_t, float(temperature), chunk, group, keep, need_h, need_w)
