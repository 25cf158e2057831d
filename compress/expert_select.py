"""Routed-output reconstruction: rank a MoE layer's experts by how little the layer's routed output
moves when they go, with the pruned model's re-routing.

Per-expert scores (routed contribution, frequency) judge each expert alone; pruning removes several at
once, and a token whose expert goes is re-routed to its next-ranked survivor, with the kept weights
renormalised. Two near-copies (upcycled experts of the same slice) then cost little when one goes and a
lot when both do, which no per-expert score sees. Here, on a sample of calibration tokens, greedy
backward elimination removes one expert at a time: the one whose removal (its tokens re-routed as the
pruned router does) changes sum_t ||routed_out_S(t) - routed_out_all(t)||^2 least. The score is the
elimination order (eliminated first = 0, the last survivor E - 1), so keeping the top n of it keeps the
last n survivors for every n.

The error is measured where the experts write: the hidden space, or the latent of a LatentMoE
(fc2_latent_proj, linear, follows), through a fixed random projection to PROJECT_DIM dimensions when it
is wider (Johnson-Lindenstrauss: squared distances kept in expectation), so that a real-size layer (512
experts of latent 1024) keeps 1,024 sample tokens in SAMPLE_BYTES. The budget is per layer, the same in
both scoring modes (identical numbers): streaming holds one layer's sample, whole-model scoring all.
Selection uses the router's choice scores (e_score_correction_bias included), the weights its unbiased
scores; grouped routing (n_group > 1) is scored as plain top-k.
"""
from __future__ import annotations

import torch

from remodel.models.moe import Experts

SAMPLE_BYTES = 1 << 29  # expert outputs [tokens, E, D] kept per MoE layer (fp32)
SAMPLE_TOKENS = 4096
PROJECT_DIM = 256
STEP_DIV = 16  # each step removes max(1, survivors // STEP_DIV) experts: one at a time below 32 experts


class RoutedSample:
    """The first calibration tokens one MoE layer sees (padding dropped): router logits and every expert's
    output on them, collected by `add` from the experts' forward pre-hook."""

    def __init__(self, moe):
        cfg = moe.cfg
        self.moe, self.cfg = moe, cfg
        D = cfg.moe.moe_latent_size or cfg.hidden_size
        self.dim = min(D, PROJECT_DIM)
        g = torch.Generator().manual_seed(0)
        self.proj = None if D <= PROJECT_DIM else torch.randn(D, self.dim, generator=g) / self.dim ** 0.5
        self.cap = max(1, min(SAMPLE_TOKENS, SAMPLE_BYTES // (4 * cfg.moe.n_routed_experts * self.dim)))
        self.logits, self.outputs, self.n = [], [], 0

    def add(self, x, mask=None):
        """x [T, D]: the experts' input of this forward (the router's logits are the MoE's last ones)."""
        if self.n >= self.cap:
            return
        logits = self.moe.router_logits.detach().float()
        if mask is not None:
            keep = mask.reshape(-1)
            x, logits = x[keep], logits[keep]
        x, logits = x[:self.cap - self.n], logits[:self.cap - self.n]
        ex, proj = self.moe.experts, self.proj if self.proj is None else self.proj.to(x.device)
        y = torch.stack([_project(Experts.expert(ex, e, x).float(), proj) for e in range(self.cfg.moe.n_routed_experts)],
                        1)
        self.logits.append(logits)
        self.outputs.append(y)
        self.n += len(x)

    def scores(self) -> torch.Tensor | None:
        """-> [E] elimination order of the sample (see the module docstring), None if the layer saw no
        token (an MTP head left unrun); frees the sample."""
        if not self.n:
            return None
        cfg, logits, y = self.cfg, torch.cat(self.logits), torch.cat(self.outputs)
        self.logits, self.outputs = [], []
        sig = cfg.moe.router == "sigmoid"
        weight = logits.sigmoid() if sig else logits.softmax(-1)
        bias = self.moe.gate.e_score_correction_bias.float() if sig else 0.0
        return elimination_scores(weight, weight + bias, y, cfg.moe.num_experts_per_tok, cfg.moe.norm_topk_prob)


def _project(y, proj):
    return y if proj is None else y @ proj


def _routed(w, c, y, alive, k: int, norm: bool):
    """Routed output of the survivors `alive` [E] -> (out [T, D], U, Z, top-k ids [T, k'], next id or None)."""
    kk = min(k, int(alive.sum()))
    order = c.masked_fill(~alive, float("-inf")).topk(min(kk + 1, int(alive.sum())), dim=-1).indices
    ids, nxt = order[:, :kk], (order[:, kk] if order.shape[1] > kk else None)
    wk = w.gather(1, ids)
    u = (wk[..., None] * _take(y, ids)).sum(1)
    z = wk.sum(-1, keepdim=True)
    return (u / z.clamp(min=1e-20) if norm else u), u, z, ids, nxt


def _take(y, ids):
    """y [T, E, D], ids [T, k] -> [T, k, D]."""
    return y.gather(1, ids[..., None].expand(-1, -1, y.shape[-1]))


def removal_costs(w, c, y, alive, full, k: int, norm: bool) -> torch.Tensor:
    """[E]: the increase of sum_t ||out - full||^2 if each surviving expert alone were removed (its
    tokens re-routed to their next survivor); inf for experts already gone."""
    out, u, z, ids, nxt = _routed(w, c, y, alive, k, norm)
    wk, yk = w.gather(1, ids), _take(y, ids)
    u2 = u[:, None] - wk[..., None] * yk
    z2 = z - wk
    if nxt is not None:
        wn = w.gather(1, nxt[:, None])
        u2 = u2 + wn[..., None] * y.gather(1, nxt[:, None, None].expand(-1, 1, y.shape[-1]))
        z2 = z2 + wn
    out2 = u2 / z2[..., None].clamp(min=1e-20) if norm else u2
    delta = (out2 - full[:, None]).square().sum(-1) - (out - full).square().sum(-1, keepdim=True)
    cost = torch.zeros(alive.shape, dtype=torch.float64).index_add_(0, ids.reshape(-1), delta.reshape(-1).double())
    return cost.masked_fill(~alive, float("inf"))


def elimination_scores(w, c, y, k: int, norm: bool) -> torch.Tensor:
    """w: router weights [T, E] (unbiased), c: choice scores [T, E], y: expert outputs [T, E, D] ->
    [E] float: position in the greedy elimination (0 = removed first)."""
    E = w.shape[1]
    alive = torch.ones(E, dtype=torch.bool)
    full = _routed(w, c, y, alive, k, norm)[0]
    score, step = torch.empty(E), 0
    while int(alive.sum()) > 1:
        cost = removal_costs(w, c, y, alive, full, k, norm)
        gone = cost.argsort(stable=True)[:max(1, int(alive.sum()) // STEP_DIV)]
        alive[gone] = False
        score[gone] = step + torch.arange(len(gone), dtype=torch.float32)  # cheapest first
        step += len(gone)
    score[alive] = E - 1
    return score
