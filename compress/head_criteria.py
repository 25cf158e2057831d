"""Cheap head criteria for the recurrent mixers (issue 55): what a Mamba head, a Gated DeltaNet value head or a
GDN key-head group is worth, from one forward and one backward per calibration batch.

Every unit a kind's LayerKind.head_units names (the channels of out_proj's input it owns) gets, from a gate g = 1
on each of those channels (a pre-hook on out_proj; a unit's gate is the sum of its channels' gradients):
  taylor      -dL/dg summed over batches: the first-order loss increase of the unit removed (Molchanov et al.)
  taylor_abs  |dL/dg| per batch, summed
  out_act     mean |y| per channel over the sequence at out_proj's input (the gated norm's output), L2 over
              samples, then over the unit's channels
  out_act_w   out_act per channel x that channel's out_proj column norm (Wanda), L2 over the unit's channels
  fisher      sum over calibration sequences of (dL_s/dg)^2, L_s a sequence's own mean loss (Kwon et al. 2022: the
              empirical Fisher of a head mask, a second-order estimate of the loss increase of removing it); the
              gate has one entry per sequence, so a single backward gives every sequence's gradient
  taylor2     -mean_s dL_s/dg + mean_s (dL_s/dg)^2 / 2: the first- plus second-order Taylor estimate of removing
              the unit (gate 1 -> 0), the Fisher standing in for the Hessian: the quantity loo measures
  fisher_act  sqrt(fisher) x out_act: gradient and activation evidence multiplied (both per unit, both >= 0)
The values are named as compress/head_loo.py names its measured costs (`layers.i.mamba_heads_loo`,
`lin_v_heads_loo`, `lin_k_heads_loo`), so `head_loo.loo_scores` ranks a SCORES dict by any of them.
"""
from __future__ import annotations

import torch

from .head_loo import loo_units
from .importance import head_weight, lm_loss_sums, seq_mean_abs

CRITERIA = ("taylor", "taylor_abs", "out_act", "out_act_w", "fisher", "taylor2", "fisher_act")


def _gates(model, layers, acc, state):
    """A gate of ones per sequence and out_proj input channel of each layer (state["gates"][i]: [b, C], made per
    batch), applied by a pre-hook that also accumulates the squared sequence-mean |y| per channel into acc[i]
    -> hook handles."""
    handles = []
    for i in layers:
        def pre(module, args, i=i):
            y = args[0]
            a = seq_mean_abs(y.detach().float().flatten(2), state["mask"]).square().sum(0)
            acc[i] = acc.get(i, 0) + a
            g = state["gates"][i]
            return (y * g.to(y.dtype).view(y.shape[0], 1, *y.shape[2:]),) + tuple(args[1:])
        handles.append(model.layers[i].mixer.out_proj.register_forward_pre_hook(pre))
    return handles


def _counts(ids, mask) -> torch.Tensor:
    """Predicted tokens per sequence, as lm_loss_sums counts them -> [b] float."""
    if mask is None:
        return torch.full((ids.shape[0],), float(ids.shape[1] - 1))
    m = mask.bool().cpu()
    return (m[:, 1:] & m[:, :-1]).sum(1).float()


def gate_criteria(model, batches, masks=None) -> dict:
    """{criterion: {`layers.i.<unit>_loo`: value per unit}} for every criterion of CRITERIA (module docstring);
    one forward and one backward per batch, the weights frozen meanwhile (their requires_grad restored)."""
    units = loo_units(model.cfg)
    layers = sorted({i for i, _, _ in units})
    W, dev = head_weight(model), head_weight(model).device
    width = {i: model.layers[i].mixer.out_proj.weight.shape[1] for i in layers}
    acc, grads, state = {}, [], {"mask": None, "gates": {}}
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    handles = _gates(model, layers, acc, state)
    try:
        for b, ids in enumerate(batches):
            mask = None if masks is None or masks[b] is None else masks[b].to(dev)
            state["mask"] = mask
            state["gates"] = {i: torch.ones(ids.shape[0], width[i], requires_grad=True, device=dev) for i in layers}
            with torch.enable_grad():
                h, _ = model.hidden(ids.to(dev), mask)
                s, n = lm_loss_sums(h, W, ids, mask)
                s.backward()  # gates[i][q]: d(sequence q's loss sum)/dg
            grads.append(({i: g.grad.detach().float().cpu() for i, g in state["gates"].items()}, n,
                          _counts(ids, mask)))
    finally:
        for hnd in handles:
            hnd.remove()
        for p, req in frozen:
            p.requires_grad_(req)
    return _per_unit(model, units, acc, grads)


def _per_unit(model, units, acc, grads) -> dict:
    """Every criterion per unit from the accumulated activations and the per-sequence gate gradients `grads`
    ([({layer: [b, C] gradient of loss sums}, batch token count, [b] tokens per sequence)])."""
    out = {c: {} for c in CRITERIA}
    for i, name, chans in units:
        act = acc[i].sqrt().cpu()
        col = model.layers[i].mixer.out_proj.weight.detach().float().norm(dim=0).cpu()
        seq = [torch.stack([g[i][:, c].sum(1) for c in chans], 1) for g, _, _ in grads]  # [b, units] loss sums
        per_batch = torch.stack([q.sum(0) / max(n, 1) for q, (_, n, _) in zip(seq, grads)])  # [batches, units]
        per_seq = torch.cat([q / k.clamp(min=1)[:, None] for q, (_, _, k) in zip(seq, grads)])  # dL_s/dg
        key = f"layers.{i}.{name}"
        out["taylor"][key] = -per_batch.sum(0)
        out["taylor_abs"][key] = per_batch.abs().sum(0)
        out["out_act"][key] = torch.stack([act[c].norm() for c in chans])
        out["out_act_w"][key] = torch.stack([(act[c] * col[c]).norm() for c in chans])
        out["fisher"][key] = per_seq.square().sum(0)
        out["taylor2"][key] = -per_seq.mean(0) + per_seq.square().mean(0) / 2
        out["fisher_act"][key] = out["fisher"][key].sqrt() * out["out_act"][key]
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
