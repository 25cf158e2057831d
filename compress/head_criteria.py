"""Cheap head criteria for the recurrent mixers (issue 55): what a Mamba head, a Gated DeltaNet value head or a
GDN key-head group is worth, from one forward and one backward per calibration batch.

Every unit a kind's LayerKind.head_units names (the channels of out_proj's input it owns) gets, from a gate g = 1
on each of those channels (a pre-hook on out_proj; a unit's gate is the sum of its channels' gradients):
  taylor      -dL/dg summed over batches: the first-order loss increase of the unit removed (Molchanov et al.)
  taylor_abs  |dL/dg| per batch, summed
  out_act     mean |y| per channel over the sequence at out_proj's input (the gated norm's output), L2 over
              samples, then over the unit's channels
  out_act_w   out_act per channel x that channel's out_proj column norm (Wanda), L2 over the unit's channels
The values are named as compress/head_loo.py names its measured costs (`layers.i.mamba_heads_loo`,
`lin_v_heads_loo`, `lin_k_heads_loo`), so `head_loo.loo_scores` ranks a SCORES dict by any of them.
"""
from __future__ import annotations

import torch

from .head_loo import loo_units
from .importance import head_weight, lm_loss_sums, seq_mean_abs

CRITERIA = ("taylor", "taylor_abs", "out_act", "out_act_w")


def _gates(model, layers, acc, mask_of):
    """A gate of ones per out_proj input channel of each layer, applied by a pre-hook that also accumulates the
    squared sequence-mean |y| per channel into acc[i] -> ({layer: gate}, hook handles)."""
    gates, handles = {}, []
    for i in layers:
        proj = model.layers[i].mixer.out_proj
        gates[i] = torch.ones(proj.weight.shape[1], requires_grad=True, device=proj.weight.device)

        def pre(module, args, i=i):
            y = args[0]
            a = seq_mean_abs(y.detach().float().flatten(2), mask_of()).square().sum(0)
            acc[i] = acc.get(i, 0) + a
            return (y * gates[i].to(y.dtype).view_as(y[0, 0]),) + tuple(args[1:])
        handles.append(proj.register_forward_pre_hook(pre))
    return gates, handles


def gate_criteria(model, batches, masks=None) -> dict:
    """{criterion: {`layers.i.<unit>_loo`: value per unit}} for every criterion of CRITERIA (module docstring);
    one forward and one backward per batch, the weights frozen meanwhile (their requires_grad restored)."""
    units = loo_units(model.cfg)
    layers = sorted({i for i, _, _ in units})
    W, dev = head_weight(model), head_weight(model).device
    acc, grads, state = {}, [], {"mask": None}
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    gates, handles = _gates(model, layers, acc, lambda: state["mask"])
    try:
        for b, ids in enumerate(batches):
            mask = None if masks is None or masks[b] is None else masks[b].to(dev)
            state["mask"] = mask
            with torch.enable_grad():
                h, _ = model.hidden(ids.to(dev), mask)
                s, n = lm_loss_sums(h, W, ids, mask)
                (s / max(n, 1)).backward()
            grads.append({i: g.grad.detach().float().cpu().clone() for i, g in gates.items()})
            for g in gates.values():
                g.grad = None
    finally:
        for hnd in handles:
            hnd.remove()
        for p, req in frozen:
            p.requires_grad_(req)
    return _per_unit(model, units, acc, grads)


def _per_unit(model, units, acc, grads) -> dict:
    out = {c: {} for c in CRITERIA}
    for i, name, chans in units:
        act = acc[i].sqrt().cpu()
        col = model.layers[i].mixer.out_proj.weight.detach().float().norm(dim=0).cpu()
        per_batch = torch.stack([torch.stack([g[i][c].sum() for c in chans]) for g in grads])  # [batches, units]
        key = f"layers.{i}.{name}"
        out["taylor"][key] = -per_batch.sum(0)
        out["taylor_abs"][key] = per_batch.abs().sum(0)
        out["out_act"][key] = torch.stack([act[c].norm() for c in chans])
        out["out_act_w"][key] = torch.stack([(act[c] * col[c]).norm() for c in chans])
    return out


SCORED = {"mamba_heads_loo": "mamba_x", "lin_v_heads_loo": "lin_v", "lin_k_heads_loo": "lin_v"}  # as loo_scores


def unit_values(cfg, scores: dict) -> dict:
    """{`layers.i.<unit>_loo`: each unit's value as prune ranks it}: the L2 norm of its channels in the scored
    head tensor (`mamba_x` [nh, hd], `lin_v` [hv, dv]: channels in out_proj's input order)."""
    return {f"layers.{i}.{name}": torch.stack([scores[f"layers.{i}.{SCORED[name]}"].float().flatten()[c].norm()
                                                for c in chans]) for i, name, chans in loo_units(cfg)}


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two 1-D tensors (ties broken by position)."""
    ra, rb = (t.argsort().argsort().double() for t in (a, b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp(min=1e-30))


def rank_correlation(values: dict, costs: dict) -> dict:
    """{`layers.i.<unit>_loo`: Spearman of a criterion's per-unit values with the measured LOO costs}."""
    return {k: spearman(values[k].float().cpu(), costs[k].float().cpu()) for k in costs if k in values}
