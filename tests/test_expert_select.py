"""Routed-output reconstruction (compress/expert_select.py): the incremental removal costs equal a
from-scratch recomputation, and the greedy elimination keeps one of two duplicate experts where the
per-expert scores keep both (the case upcycled experts are in)."""
import torch

from compress.expert_select import _routed, elimination_scores, removal_costs


def _err(w, c, y, keep, k, norm):
    alive = torch.zeros(w.shape[1], dtype=torch.bool)
    alive[keep] = True
    full = _routed(w, c, y, torch.ones_like(alive), k, norm)[0]
    return float((_routed(w, c, y, alive, k, norm)[0] - full).square().sum())


def test_removal_costs_equal_recomputing_the_routed_output():
    g = torch.Generator().manual_seed(0)
    T, E, D, k = 40, 7, 5, 3
    for norm in (True, False):
        w = torch.rand(T, E, generator=g)
        c = w + 0.2 * torch.randn(E, generator=g)
        y = torch.randn(T, E, D, generator=g)
        alive = torch.tensor([True, True, False, True, True, True, True])
        full = _routed(w, c, y, torch.ones(E, dtype=torch.bool), k, norm)[0]
        cost = removal_costs(w, c, y, alive, full, k, norm)
        keep = [e for e in range(E) if alive[e]]
        base = _err(w, c, y, keep, k, norm)
        for e in keep:
            want = _err(w, c, y, [x for x in keep if x != e], k, norm) - base
            assert abs(float(cost[e]) - want) <= 1e-4 * max(1.0, abs(want)), (norm, e)
        assert cost[2] == float("inf")


def test_keeps_one_of_two_duplicate_experts():
    """Experts 0 = 1 serve 60% of the tokens, 2 = 3 the rest (top-2 of 4). Keeping 2: routed contribution
    and frequency keep the popular pair {0, 1}, which leaves the other tokens nothing right; the
    elimination keeps one of each pair, and its routed output error is far lower."""
    g = torch.Generator().manual_seed(1)
    T, D, k = 100, 16, 2
    a, b = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    y = torch.stack([a, a, b, b], 1)
    first = torch.arange(T) < 60
    w = torch.where(first[:, None], torch.tensor([0.9, 0.88, 0.1, 0.12]), torch.tensor([0.1, 0.12, 0.9, 0.88]))
    idx = w.topk(k, -1).indices
    wk = w.gather(1, idx) / w.gather(1, idx).sum(-1, keepdim=True)
    contribution = torch.zeros(4).index_add_(0, idx.reshape(-1), (wk * y.gather(
        1, idx[..., None].expand(-1, -1, D)).norm(dim=-1)).reshape(-1))
    by_contribution = sorted(contribution.topk(2).indices.tolist())
    by_elimination = sorted(elimination_scores(w, w, y, k, True).topk(2).indices.tolist())
    assert by_contribution == [0, 1]
    assert by_elimination[0] in (0, 1) and by_elimination[1] in (2, 3)
    assert _err(w, w, y, by_elimination, k, True) < 0.05 * _err(w, w, y, by_contribution, k, True)
