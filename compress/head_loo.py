"""Leave-one-out (LOO) head scores: what each head of a recurrent mixer costs the model, measured.

For every Mamba head, Gated DeltaNet value head and Gated DeltaNet key-head group (a key head with its value
heads), the calibration LM loss with that unit alone removed, minus the full model's loss (nats per token;
`head_costs`). A unit is removed as pruning would remove it:

  Mamba head        its channels dropped from the gated norm's input (y and z): the group RMS is taken over
                    the channels that stay, as in the pruned model, whose norm groups only hold the kept
                    heads; its out_proj columns then read zeros. The other heads' scans do not depend on it
                    (B and C are per group, x, dt, A and D per head), so this is the pruned model's output.
  GDN value head    its output channels zeroed at out_proj's input (its RMS norm is per head: nothing else moves).
  GDN key group     every value head of that key head zeroed (the key head feeds only those).

Cost: one forward per unit over the calibration set, from the unit's layer on (the residual stream entering
each scored layer is kept once per batch, in a StateStore that spills to files past its byte budget), plus one
full forward for the base loss. The model itself is held whole in memory.

`loo_scores` turns the costs into a SCORES dict that `prune --scores` reads unchanged: the head tensors
(`layers.i.mamba_x` [nh, hd], `layers.i.lin_v` [hv, dv]) are rewritten so that the norm over a head's channels,
which prune ranks heads by, orders the heads as their costs do (cost - the layer's lowest cost + a small
positive margin, since a cost may be negative); within a head the activation score's channel profile is kept.
For GDN the value heads of a key-head group are scaled so that the group's norm follows the group's own cost.
The raw costs are written beside them as `layers.i.mamba_heads_loo`, `lin_v_heads_loo`, `lin_k_heads_loo`.

The default criterion (`measured_scores`, `--method activation_measured`) measures only the units a kind names
as few (LayerKind.measured_units: GDN key-head groups) over the loss batches, the rest stays activation; the
streaming scorer (compress/streaming.py) measures the same units from the same branches, layer by layer.
"""
from __future__ import annotations

import torch
from tqdm import tqdm

from remodel.models.errors import RemodelError
from remodel.models.kinds import layer_kinds
from remodel.models.trunk import finish, one_pass, start, walk

from .importance import head_weight, lm_loss_sums, mean_loss
from .state_store import StateStore

MARGIN = 1e-3  # of a layer's cost range (1e-9 at least): the lowest-cost head still scores above zero


def loo_units(cfg, measured: bool = False) -> list[tuple[int, str, list[torch.Tensor]]]:
    """(layer, score name, one channel index per unit) of every unit LOO scores, in layer order: each kind's own
    (LayerKind.head_units: Mamba heads; GDN value heads and key-head groups); measured: only those the default
    criterion measures (LayerKind.measured_units: GDN key-head groups)."""
    return [(i, name, chans) for i, k in enumerate(layer_kinds(cfg))
            for name, chans in (k.measured_units(cfg) if measured else k.head_units(cfg))]


class HeadMask:
    """Removes the channels of one layer (one unit, or several: a set) while attached, as the layer's kind says
    (LayerKind.remove_channels: the Mamba norm over the kept channels, the GDN out_proj's input zeroed);
    remove() detaches it, as leaving a `with HeadMask(...)` block does."""

    def __init__(self, block, channels: torch.Tensor):
        self.fired = 0
        keep = torch.ones(block.mixer.out_proj.weight.shape[1], dtype=torch.bool)
        keep[channels] = False
        self.handle = block.spec.remove_channels(block.mixer, keep, self._fire)

    def _fire(self):
        self.fired += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    def remove(self):
        self.handle.remove()
        if not self.fired:
            raise RemodelError("--method loo: the Mamba gated norm ran inside a fused GPU kernel, where a head cannot "
                               "be removed; score with --method loo on the CPU")


def loss_from(model, i: int, store, batches, masks) -> float:
    """Mean LM loss of the batches run from layer i on (store[b]: the residual stream entering layer i)."""
    W, dev, sums = head_weight(model), head_weight(model).device, []
    for b, ids in enumerate(batches):
        mask = None if masks is None or masks[b] is None else masks[b].to(dev)
        x = walk(len(model.layers) - i, lambda j: model.layers[i + j], {"x": store[b].to(dev)}, one_pass(("x",)),
                 lambda key: (mask,))["x"]
        sums.append(finish(model.cfg, model.norm_f, x, lambda h: lm_loss_sums(h, W, ids, mask)))
    return mean_loss(sums)


@torch.no_grad()
def head_costs(model, batches, masks=None, max_memory_bytes=None, spill_dir=None, progress=False,
               measured=False):
    """{`layers.i.<unit>_loo`: the loss increase of every unit removed alone} and the base loss -> (costs, base).
    See the module docstring for how each unit is removed and what this costs; measured: the measured_units only."""
    units = loo_units(model.cfg, measured)
    if not units:
        raise RemodelError("--method loo scores Mamba and Gated DeltaNet heads; the model has no such layers "
                           f"(pattern {model.cfg.pattern})")
    dev = head_weight(model).device
    store, costs = StateStore(max_memory_bytes, spill_dir), {}
    try:
        for b, ids in enumerate(batches):
            store[b] = start(model.cfg, model.embed(ids.to(dev)))
        base = loss_from(model, 0, store, batches, masks)
        done = 0
        bar = tqdm(total=sum(len(c) for _, _, c in units), desc="loo", disable=not progress)
        for i, name, chans in units:
            for j in range(done, i):  # advance the kept residual stream to layer i's input
                _advance(model, j, store, batches, masks, dev)
            done = i
            out = []
            for c in chans:
                with HeadMask(model.layers[i], c):
                    out.append(loss_from(model, i, store, batches, masks) - base)
                bar.update()
            costs[f"layers.{i}.{name}"] = torch.tensor(out, dtype=torch.float32)
        bar.close()
    finally:
        store.close()
    return costs, base


def _advance(model, j, store, batches, masks, dev):
    for b in range(len(batches)):
        mask = None if masks is None or masks[b] is None else masks[b].to(dev)
        store[b] = model.layers[j](store[b].to(dev), mask)


def _order(cost: torch.Tensor) -> torch.Tensor:
    """Positive values in the order of `cost`: cost - min + a margin."""
    lo = cost.min()
    return cost - lo + max(MARGIN * float(cost.max() - lo), 1e-9)


def _profile(a: torch.Tensor) -> torch.Tensor:
    """Each row of a [n, d] scaled to unit L2 norm (a row of zeros: uniform)."""
    n = a.norm(dim=1, keepdim=True)
    flat = torch.full_like(a, a.shape[1] ** -0.5)
    return torch.where(n > 0, a / n.clamp(min=1e-30), flat)


def _regroup(v: torch.Tensor, cost: torch.Tensor) -> torch.Tensor:
    """Value-head scores v [hv, dv] with their key-head groups (hv / len(cost) heads each) reordered by `cost`: the
    group of the k-th lowest cost takes the k-th lowest activation group norm (a hair above the one below, so the
    order is strict), each group's heads scaled together (their order inside it kept). The norms' distribution is
    activation's, so the share of importance a cut removes -- what plan's estimate reads -- is what it was."""
    rows = v.reshape(len(cost), -1)
    g = rows.norm(dim=1)
    rank = torch.empty_like(cost, dtype=torch.long)
    rank[cost.argsort(stable=True)] = torch.arange(len(cost))
    target = g.sort().values[rank] + (rank + 1) * 1e-6 * max(float(g.max()), 1e-30)
    return (_profile(rows) * target[:, None]).reshape(v.shape)  # a group of zeros: spread evenly


def loo_scores(cfg, scores: dict, costs: dict) -> dict:
    """`scores` (an activation run's) with the head tensors ranked by the LOO `costs` (module docstring)."""
    out = {**scores, **costs}
    for i in range(cfg.num_layers):  # by the costs a layer's kind measured (LayerKind.head_units' names)
        p = f"layers.{i}."
        if p + "mamba_heads_loo" in costs:
            out[p + "mamba_x"] = _profile(scores[p + "mamba_x"].float()) * _order(costs[p + "mamba_heads_loo"])[:, None]
        elif p + "lin_k_heads_loo" in costs and p + "lin_v_heads_loo" not in costs:  # groups measured alone
            out[p + "lin_v"] = _regroup(scores[p + "lin_v"].float(), costs[p + "lin_k_heads_loo"])
        elif p + "lin_v_heads_loo" in costs:
            hk = cfg.gated_deltanet.linear_num_key_heads
            v = costs[p + "lin_v_heads_loo"].view(hk, -1)
            w = torch.stack([_order(row) for row in v])  # within a group, by the value head's cost
            w = w / w.norm(dim=1, keepdim=True) * _order(costs[p + "lin_k_heads_loo"])[:, None]  # group norm: its cost
            out[p + "lin_v"] = _profile(scores[p + "lin_v"].float()) * w.reshape(-1)[:, None]
    return out


def measured_scores(model, scores: dict, batches, masks=None, loss_batches: int = 4, max_memory_bytes=None,
                    spill_dir=None, progress=False) -> dict:
    """The default criterion (`score --method activation_measured`): activation `scores` with each kind's
    measured_units (GDN key-head groups) ranked by their LOO cost over the first `loss_batches` batches."""
    if not loo_units(model.cfg, measured=True):
        return scores
    k = min(loss_batches, len(batches))
    costs, _ = head_costs(model, batches[:k], None if masks is None else masks[:k], max_memory_bytes, spill_dir,
                          progress, measured=True)
    return loo_scores(model.cfg, scores, costs)
