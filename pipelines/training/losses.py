"""Training losses: logit distillation, LM cross-entropy, hidden-state cosine, MoE router aux losses.

Plain functions, computed in fp32 and in log-space. Token-level losses take logits [..., V] and an
optional mask [...] (True/1 = count the token) and return the mean over the counted tokens.

Next-token convention (the caller shifts): `lm_loss(logits[:, :-1], ids[:, 1:])`. The KL losses
compare two models at the same positions, so they take unshifted logits (every position counts).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from remodel.models.moe import router_probs  # noqa: F401  (re-exported: vocab_parallel, tests)


def _masked_mean(per_token: torch.Tensor, mask) -> torch.Tensor:
    if mask is None:
        return per_token.mean()
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / m.sum().clamp(min=1)


def _xlogx_minus(p: torch.Tensor, logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """p * (log p - log q) with 0 where p == 0 (no nan from -inf - -inf)."""
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))


def kl_div(student_logits, teacher_logits, temperature: float = 1.0, mask=None) -> torch.Tensor:
    """Forward KL(teacher || student) of softmax(logits / T), summed over the vocabulary, averaged over
    the (unmasked) tokens. No T^2 factor."""
    logq = F.log_softmax(student_logits.float() / temperature, dim=-1)
    logp = F.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    return _masked_mean(_xlogx_minus(logp.exp(), logp, logq).sum(-1), mask)


def _bucket_logprobs(logits: torch.Tensor, idx: torch.Tensor, temperature: float) -> torch.Tensor:
    """log-probabilities [..., k + 1] of the k tokens `idx` and of the rest of the vocabulary."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    top = z.gather(-1, idx) - lse
    rest = torch.logsumexp(z.scatter(-1, idx, float("-inf")), dim=-1, keepdim=True) - lse
    return torch.cat([top, rest], dim=-1)


def topk_kl(student_logits, teacher_logits, k: int, temperature: float = 1.0, mask=None) -> torch.Tensor:
    """KL(teacher || student) over k + 1 buckets: the teacher's top-k tokens and one bucket holding the
    rest of the vocabulary (each distribution's remaining mass). k >= V equals `kl_div`."""
    V = teacher_logits.shape[-1]
    idx = teacher_logits.detach().topk(min(k, V), dim=-1)[1]
    logp = _bucket_logprobs(teacher_logits.detach(), idx, temperature)
    logq = _bucket_logprobs(student_logits, idx, temperature)
    return _masked_mean(_xlogx_minus(logp.exp(), logp, logq).sum(-1), mask)


def lm_loss(logits, labels, mask=None, ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy of logits [..., V] against labels [...] (already shifted by the caller: next-token
    prediction is `lm_loss(logits[:, :-1], ids[:, 1:])`); labels == ignore_index don't count."""
    V = logits.shape[-1]
    per = F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1), reduction="none",
                          ignore_index=ignore_index).view(labels.shape)
    keep = labels != ignore_index
    if mask is not None:
        keep = keep & mask.bool()
    return _masked_mean(per, keep)


def hidden_cosine_loss(student_states, teacher_states, layer_map, projections=None, mask=None) -> torch.Tensor:
    """Mean over the pairs (s, t) of `layer_map` of 1 - cos(P_s(student_states[s]), teacher_states[t]),
    the cosine taken over the hidden dim and averaged over tokens. `projections` is None or a sequence
    aligned with layer_map of modules (None entries: identity) mapping student width to teacher width."""
    losses = []
    for j, (s, t) in enumerate(layer_map):
        x = student_states[s]
        if projections is not None and projections[j] is not None:
            x = projections[j](x)
        cos = F.cosine_similarity(x.float(), teacher_states[t].detach().float(), dim=-1, eps=1e-8)
        losses.append(_masked_mean(1.0 - cos, mask))
    return torch.stack(losses).mean()


def forced_layer_losses(student_states, teacher_states, layers) -> torch.Tensor:
    """Attention transfer's loss under teacher forcing: per layer i of `layers`, the mean squared error between
    its contribution in the student (output minus the teacher's input to layer i, which the student layer read)
    and the teacher's (teacher layer i's output minus that input). A mean over tokens, so data-parallel ranks'
    gradients average to one process's (a norm-relative error does not); 1 - cos, which leaves the norm free,
    fitted worse (tests/test_hybridize_quality.py). -> [len(layers)]"""
    out = []
    for i in layers:
        x = teacher_states[i].detach().float()
        s, t = student_states[i + 1].float() - x, teacher_states[i + 1].detach().float() - x
        out.append((s - t).square().mean())
    return torch.stack(out)


def load_balancing_loss(router_logits_list, top_k: int, n_experts: int, router_kind: str = "softmax") -> torch.Tensor:
    """Switch-style auxiliary loss without its coefficient: per MoE layer N * sum_i f_i P_i, where f_i is
    the fraction of the T*k routing slots given to expert i (top-k of the logits; not differentiable)
    and P_i the mean routing probability of expert i; averaged over layers. Equals 1 when perfectly
    balanced. The sigmoid router's selection here ignores its correction bias and expert groups."""
    losses = []
    for logits in router_logits_list:
        logits = logits.reshape(-1, logits.shape[-1]).float()
        T = logits.shape[0]
        idx = logits.detach().topk(top_k, dim=-1)[1]
        f = torch.bincount(idx.reshape(-1), minlength=n_experts).to(logits.dtype) / (T * top_k)
        P = router_probs(logits, router_kind).mean(0)
        losses.append(n_experts * (f * P).sum())
    return torch.stack(losses).mean()


def z_loss(router_logits_list) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2, averaged over MoE layers."""
    return torch.stack([torch.logsumexp(lg.reshape(-1, lg.shape[-1]).float(), dim=-1).square().mean()
                        for lg in router_logits_list]).mean()
