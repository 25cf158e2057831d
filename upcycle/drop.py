"""Drop-Upcycling (Nakamura et al., ICLR 2025, arXiv 2502.19261) on top of the virtual-group upcycle.

After upcycle_mlp, every routed expert e re-initialises k = round(R * Fm) of its Fm intermediate
neurons: a subset drawn afresh for each expert (torch.randperm), whose gate and up rows and the
matching down columns are replaced by draws from N(mean, std) of the ORIGINAL dense matrix (gate, up
and down each with their own mean and std, over the whole unscaled dense matrix, shared-expert neurons
included). Every other neuron keeps its scaled copy bit for bit; the router, the shared expert and
every other tensor are untouched. The draws come from one torch.Generator per layer, seeded from
(seed, layer) apart from the router's stream, so the same arguments give the same checkpoint. The
experts are then N distinct tensors: LazyExperts over N "shards", one per expert, which the writer and
the deviation check read as before (memory: the layer's N experts, E copies of the dense MLP); that
wrapping is virtual_groups.drop_upcycle's, this module works on plain fused tensors.
Not function-preserving: the MoE no longer reproduces the dense model at step 0 (reported, never
--exact).
"""
from __future__ import annotations

import torch

DROP_SEED_OFFSET = 1 << 62  # keeps the drop stream apart from the router's (layer seeds < 2**53)
PROJECTIONS = ("up_proj", "gate_proj", "down_proj")


def drop_count(ratio: float, expert_size: int) -> int:
    """Neurons re-initialised per expert: round(R * Fm) (Python round: halves to even)."""
    return round(ratio * expert_size)


def drop_seed(layer_seed: int) -> int:
    """The drop stream's seed of a layer, from the layer's router seed (virtual_groups.layer_seed)."""
    return layer_seed + DROP_SEED_OFFSET


def mean_std(t: torch.Tensor, rows: int = 4096) -> tuple[float, float]:
    """Mean and (unbiased) std of every element of t, summed in float64 a block of rows at a time (no
    float copy of the whole matrix)."""
    flat = t.reshape(-1, t.shape[-1])
    s = s2 = 0.0
    for b in flat.split(rows):
        b = b.double()
        s += b.sum().item()
        s2 += b.square().sum().item()
    n = t.numel()
    mean = s / n
    var = max(0.0, (s2 - n * mean * mean) / max(1, n - 1))
    return mean, var ** 0.5


def dense_stats(up: torch.Tensor, down: torch.Tensor, gate: torch.Tensor | None) -> dict:
    """{projection: (mean, std)} of the dense MLP's matrices, as the experts' projections are named."""
    out = {"up_proj": mean_std(up), "down_proj": mean_std(down)}
    if gate is not None:
        out["gate_proj"] = mean_std(gate)
    return out


def _draw(shape, stats: tuple, g: torch.Generator, dtype) -> torch.Tensor:
    mean, std = stats
    return (torch.randn(shape, generator=g) * std + mean).to(dtype)


@torch.no_grad()
def drop_neurons(experts: dict, stats: dict, ratio: float, seed: int) -> int:
    """experts: {"up_proj"|"gate_proj"|"down_proj": fused [N, Fm, L] / [N, L, Fm] tensor}, changed in
    place: round(ratio * Fm) neurons of each expert re-initialised (see the module doc); stats:
    dense_stats of the source MLP. -> the number of neurons re-initialised per expert."""
    up = experts["up_proj"]
    n_exp, fm = up.shape[0], up.shape[1]
    k = drop_count(ratio, fm)
    g = torch.Generator().manual_seed(seed)
    for e in range(n_exp if k else 0):
        idx = torch.randperm(fm, generator=g)[:k]
        for leaf in (n for n in PROJECTIONS if n in experts):
            t = experts[leaf]
            if leaf == "down_proj":
                t[e][:, idx] = _draw((t.shape[1], k), stats[leaf], g, t.dtype)
            else:
                t[e][idx] = _draw((k, t.shape[2]), stats[leaf], g, t.dtype)
    return k


def drop_report(ratio: float, expert_size: int, seed: int) -> dict:
    """The upcycle report's description of the drop step."""
    k = drop_count(ratio, expert_size)
    return {"ratio": ratio, "neurons_per_expert": k, "expert_size": expert_size, "seed": seed,
            "method": "Drop-Upcycling (arXiv 2502.19261): per routed expert, a fresh random subset of "
                      "round(ratio * expert_size) intermediate neurons has its gate/up rows and down columns "
                      "drawn from N(mean, std) of the original dense matrix (each of gate, up, down its own)"
            if k else "none (naive copies)"}
