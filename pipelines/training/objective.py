"""The training objective of one micro-batch, shared by `remodel train` and `remodel distill`.

Loss = kl_weight * KL(teacher||student) + lm_loss_weight * CE + hidden_loss_weight * (1 - cos)
       + lb_coeff * load balancing (student MoE layers) + z_coeff * router z-loss.
With teacher forcing (w["forced"]: layer indices; attention transfer) the hidden loss alone: each forced student
layer reads the teacher's residual stream at its input, its contribution compared with the teacher layer's
(losses.forced_layer_losses); no router loss then (it would couple the layers through the MoE layers after them).
The vocabulary losses come from the logits, or fused from the final hidden states in token chunks
(pipelines.training.fused_loss) so that no [tokens, vocab] logits exist.
"""
from __future__ import annotations

import torch

from .losses import forced_layer_losses, hidden_cosine_loss, kl_div, lm_loss, load_balancing_loss, topk_kl, z_loss

LOSS_FNS = {"kl_div": kl_div, "topk_kl": topk_kl, "lm_loss": lm_loss, "load_balancing_loss": load_balancing_loss}


def compute_losses(student, teacher, ids, w: dict, layer_map=None, projections=None, autocast=None, fns=None):
    """-> (total loss tensor, {name: float}) for one batch of token ids [B, L].
    w: weights {kl, lm, hidden, lb, z, temperature, topk; forced: the teacher-forced layers or None}. The teacher
    runs under no_grad.
    fns: replacements for the loss functions {kl_div, topk_kl, lm_loss, load_balancing_loss} (same
    signatures; a parallelized run passes vocab_parallel.parallel_loss_fns)."""
    fns = {**LOSS_FNS, **(fns or {})}
    autocast = autocast or torch.autocast("cpu", enabled=False)
    need_states = teacher is not None and w["hidden"] > 0
    if w.get("forced"):
        s_states, t_states = teacher_forced(student, teacher, ids, w["forced"], autocast)
        total, parts = s_states[-1].new_zeros((), dtype=torch.float32), {}
    elif w.get("fused"):
        total, parts, s_states, t_states = _fused_losses(student, teacher, ids, w, autocast, need_states)
    else:
        total, parts, s_states, t_states = _logit_losses(student, teacher, ids, w, autocast, fns, need_states)
    states = (s_states, t_states, layer_map, projections) if need_states else None
    return _other_losses(student, w, fns, total, parts, states, autocast)


def _logit_losses(student, teacher, ids, w, autocast, fns, need_states):
    """compute_losses' forwards and vocabulary losses (KL, CE) from the logits. -> (total, parts, the
    student's residual stream, the teacher's) (streams None without need_states)."""
    t_states = None
    with autocast:
        s_logits, s_states = _forward(student, ids, need_states)
        if teacher is not None:
            with torch.no_grad():
                t_logits, t_states = _forward(teacher, ids, need_states)
    total = s_logits.new_zeros((), dtype=torch.float32)
    parts = {}
    if teacher is not None:
        kl = (fns["topk_kl"](s_logits, t_logits, w["topk"], w["temperature"]) if w["topk"]
              else fns["kl_div"](s_logits, t_logits, w["temperature"]))
        total = total + w["kl"] * kl
        parts["kl"] = kl.item()
    lm = fns["lm_loss"](s_logits[:, :-1] if w["lm"] > 0 else s_logits[:, :-1].detach(), ids[:, 1:])
    if w["lm"] > 0:
        total = total + w["lm"] * lm
    parts["lm"] = lm.item()
    return total, parts, s_states, t_states


def _fused_losses(student, teacher, ids, w, autocast, need_states):
    """compute_losses' forwards and vocabulary losses, fused (pipelines.training.fused_loss): CE and KL from the
    final hidden states in token chunks, so no [tokens, vocab] logits exist for the student or the teacher.
    -> as `_logit_losses`."""
    from .fused_loss import fused_kl_div, fused_lm_loss, lm_head_weight
    g, t_states = w.get("vocab_group"), None
    with autocast:  # through forward: FSDP's root hooks gather the lm_head read below (and reduce its grad)
        s_h, s_states = _forward(student, ids, need_states, return_hidden=True)
        if teacher is not None:
            with torch.no_grad():
                t_h, t_states = _forward(teacher, ids, need_states, return_hidden=True)
    flat = s_h.reshape(-1, s_h.shape[-1])
    total, parts = s_h.new_zeros((), dtype=torch.float32), {}
    if teacher is not None:
        with autocast:  # the matmuls in the autocast dtype, as the logits path's F.linear
            kl = fused_kl_div(flat, lm_head_weight(student), t_h.reshape(-1, t_h.shape[-1]), lm_head_weight(teacher),
                              w["temperature"], group=g)
        total = total + w["kl"] * kl
        parts["kl"] = kl.item()
    with torch.set_grad_enabled(torch.is_grad_enabled() and w["lm"] > 0), autocast:
        lm = fused_lm_loss(s_h[:, :-1].reshape(-1, s_h.shape[-1]), lm_head_weight(student), ids[:, 1:].reshape(-1),
                           group=g)
    if w["lm"] > 0:
        total = total + w["lm"] * lm
    parts["lm"] = lm.item()
    return total, parts, s_states, t_states


def teacher_forced(student, teacher, ids, layers, autocast=None):
    """-> (the student's residual stream, the teacher's) with each student layer of `layers` fed the teacher's
    input to that layer instead of the stream before it (forward pre-hooks: the trunk's walk untouched), so that
    its output depends on its own weights alone and errors do not compound. The teacher runs first, no_grad."""
    autocast = autocast or torch.autocast("cpu", enabled=False)
    with autocast, torch.no_grad():
        _, t_states = _forward(teacher, ids, True, return_hidden=True)

    def feed(i):
        return lambda module, args: (t_states[i].to(args[0].dtype), *args[1:])

    hooks = [student.layers[i].register_forward_pre_hook(feed(i)) for i in layers]
    try:
        with autocast:
            _, s_states = _forward(student, ids, True, return_hidden=True)
    finally:
        for h in hooks:
            h.remove()
    return s_states, t_states


def _forward(model, ids, need_states, return_hidden=False):
    """-> (logits, or the final hidden states with return_hidden; the residual stream or None), always
    through model.__call__, never model.hidden: under FSDP2 only the root's forward hooks unshard the
    embeddings, norm_f and lm_head (the root keeps them unsharded after the forward, so the fused loss's
    lm_head_weight(model) is then the full weight, and the backward's final callback reduce-scatters
    the gradient it gives it)."""
    out = model(ids, output_hidden_states=need_states, return_hidden=return_hidden)
    return out if need_states else (out, None)


def _other_losses(student, w, fns, total, parts, states, autocast):
    """Adds the hidden-state cosine loss (states: (student's, teacher's, layer_map, projections) or None)
    and the MoE load-balancing and z losses of the student's last forward; -> (total, parts)."""
    if states is not None:
        with autocast:
            hid = (forced_layer_losses(*states[:2], w["forced"]).mean() if w.get("forced")
                   else hidden_cosine_loss(*states))
        total = total + w["hidden"] * hid
        parts["hidden"] = hid.item()
    moe = [] if w.get("forced") else student.moe_layers()  # forced layers fitted alone: no router loss joins them
    if moe and (w["lb"] > 0 or w["z"] > 0):
        cfg = student.cfg
        logits = [m.router_logits for m in moe]
        if w["lb"] > 0:
            lb = fns["load_balancing_loss"](logits, cfg.moe.num_experts_per_tok, cfg.moe.n_routed_experts, cfg.moe.router)
            total = total + w["lb"] * lb
            parts["lb"] = lb.item()
        if w["z"] > 0:
            z = z_loss(logits)
            total = total + w["z"] * z
            parts["z"] = z.item()
    parts["loss"] = total.item()
    return total, parts
