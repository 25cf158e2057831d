"""Cross-entropy and KL on vocab-parallel logits (each tensor-parallel rank holds a vocabulary shard).

Same definitions and signatures as pipelines.training.losses.lm_loss / kl_div plus `group` (the group the
vocabulary is sharded over, `parallel_info(model).vocab_group`; None = unsharded, then these equal
the plain losses). Rank r holds vocabulary ids [r*Vl, (r+1)*Vl). Every rank returns the same loss
and the gradient of its own logits shard.

log-softmax needs the global logsumexp: m = all-reduce(max) of the local maxima (detached);
d = all-reduce(sum exp(z - m)), autograd-aware (all-reduce both ways, since every rank's shard of the
log-softmax uses it); LSE = m + log d. Per-token sums over the local shard (the picked target logit,
the KL terms) are then all-reduced into the replicated loss (all-reduce forward, identity backward).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .losses import load_balancing_loss, router_probs, topk_kl
from ..distributed.collectives import all_reduce_sum, gather_rows, group_rank, group_size, reduce_from_group


def _masked_mean(per_token, mask):
    if mask is None:
        return per_token.mean()
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / m.sum().clamp(min=1)


def vocab_parallel_logsumexp(z, group=None):
    """logsumexp over the full (sharded) last dim of z (float), keepdim."""
    m = z.detach().amax(-1, keepdim=True)
    if group_size(group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    d = all_reduce_sum((z - m).exp().sum(-1, keepdim=True), group)
    return m + d.log()


def vocab_parallel_log_softmax(logits, group=None, temperature: float = 1.0):
    """This rank's shard of log_softmax(logits / T) over the full vocabulary, in fp32."""
    z = logits.float() / temperature
    return z - vocab_parallel_logsumexp(z, group)


def vocab_parallel_lm_loss(logits, labels, group=None, mask=None, ignore_index: int = -100):
    """Cross-entropy of vocab-sharded logits [..., Vl] against full-vocabulary labels [...] (shifted by
    the caller); labels == ignore_index (or mask 0) don't count. Mean over counted tokens."""
    logp = vocab_parallel_log_softmax(logits, group)
    Vl = logp.shape[-1]
    local = labels - group_rank(group) * Vl
    inside = (local >= 0) & (local < Vl) & (labels != ignore_index)
    picked = logp.gather(-1, torch.where(inside, local, torch.zeros_like(local))[..., None]).squeeze(-1)
    per = -reduce_from_group(torch.where(inside, picked, torch.zeros_like(picked)), group)
    keep = labels != ignore_index
    if mask is not None:
        keep = keep & mask.bool()
    return _masked_mean(per, keep)


def vocab_parallel_kl_div(student_logits, teacher_logits, group=None, temperature: float = 1.0, mask=None):
    """Forward KL(teacher || student) of softmax(logits / T) over the full vocabulary, from both
    models' vocab shards; summed over the vocabulary, averaged over (unmasked) tokens; no T^2."""
    logq = vocab_parallel_log_softmax(student_logits, group, temperature)
    logp = vocab_parallel_log_softmax(teacher_logits.detach(), group, temperature)
    p = logp.exp()
    local = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)
    return _masked_mean(reduce_from_group(local, group), mask)


def vocab_shard(full_logits, group=None):
    """This rank's vocabulary shard of full logits [..., V] (e.g. an unsharded teacher's)."""
    n = group_size(group)
    if n == 1:
        return full_logits
    Vl = full_logits.shape[-1] // n
    return full_logits[..., group_rank(group) * Vl:(group_rank(group) + 1) * Vl]


# ---- every loss of the trainer on a parallelized model ----------------------------------------

def dp_load_balancing_loss(router_logits_list, top_k: int, n_experts: int, router_kind: str = "softmax",
                           group=None) -> torch.Tensor:
    """losses.load_balancing_loss of the global batch, tokens split evenly over the ranks of `group`: the
    expert load f counts every rank's routing slots (all-reduced; not differentiable), the mean routing
    probability P is this rank's. The group mean of the per-rank values (and of their gradients)
    is the single-process loss of the whole batch."""
    if group_size(group) == 1:
        return load_balancing_loss(router_logits_list, top_k, n_experts, router_kind)
    logits = [lg.reshape(-1, lg.shape[-1]).float() for lg in router_logits_list]
    counts = torch.stack([torch.bincount(lg.detach().topk(top_k, dim=-1)[1].reshape(-1), minlength=n_experts)
                          for lg in logits]).to(logits[0].dtype)
    dist.all_reduce(counts, group=group)
    losses = []
    for lg, c in zip(logits, counts):
        f = c / (lg.shape[0] * top_k * group_size(group))
        losses.append(n_experts * (f * router_probs(lg, router_kind).mean(0)).sum())
    return torch.stack(losses).mean()


def parallel_loss_fns(info) -> dict:
    """compute_losses' loss functions on vocab-sharded logits (teacher logits may be a shard or full)."""
    g, n = info.vocab_group, group_size(info.vocab_group)
    if n == 1 and info.dp_group is None:
        return {}  # one rank: the plain losses

    def shard(t, like):
        return t if t.shape[-1] == like.shape[-1] else vocab_shard(t, g)

    def full(z, V):  # [..., V/n] -> [..., V]; backward keeps this rank's block (the loss is replicated)
        if z.shape[-1] == V:
            return z
        return gather_rows(z.movedim(-1, 0).contiguous(), g, V).movedim(0, -1)

    def top(s, t, k, T):
        V = s.shape[-1] * n
        return topk_kl(full(s, V), full(t, V), k, T)

    return {"lm_loss": lambda logits, labels: vocab_parallel_lm_loss(logits, labels, g),
            "kl_div": lambda s, t, T: vocab_parallel_kl_div(s, shard(t, s), g, T),
            "topk_kl": top,
            "load_balancing_loss": lambda lg, k, E, kind: dp_load_balancing_loss(lg, k, E, kind, info.dp_group)}
