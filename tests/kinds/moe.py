"""Mixture of experts: a router that never selects a dropped expert, dropped expert / shared-expert neurons
writing nothing through their down_proj, and (LatentMoE) dropped latent channels read as zero by the experts
and not projected back."""
import torch
import torch.nn.functional as F

from remodel.models.moe import wide
from tests.kinds import dropped

AXES = {"experts", "expert_ffn", "shared_ffn", "latent"}


def outputs(m):
    """What writes to the residual stream: the experts (through the latent's up-projection) and the shared ones."""
    routed = m.fc2_latent_proj if m.cfg.moe.moe_latent_size else m.experts.down_proj
    biases = [m.experts.down_proj_bias] if m.cfg.moe.expert_bias else []  # gpt-oss: [E, H], added after down_proj
    return [routed] + biases + ([m.shared_experts.down_proj] if m.shared_experts is not None else [])


def masked_softmax_router(gate, drop):
    """Softmax router that can never select a dropped expert: its logit is -inf, so the softmax runs
    over the kept experts only -- what slicing the router rows computes."""
    cfg = gate.cfg

    def forward(x):
        logits = F.linear(wide(x), wide(gate.weight), None if gate.bias is None else wide(gate.bias))  # (as the router)
        logits[:, drop] = float("-inf")
        w, idx = logits.softmax(-1).topk(cfg.moe.num_experts_per_tok, dim=-1)
        if cfg.moe.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return logits, w * cfg.moe.routed_scaling_factor, idx
    gate.forward = forward


def _mask_experts(cfg, m, drop):
    if cfg.moe.router == "softmax":
        masked_softmax_router(m.gate, drop)
    else:
        # the router must never select a dropped expert: selection runs on score + correction bias, so a
        # -inf bias masks the selection logit (sigmoid(-inf logit) alone would leave the bias selectable);
        # kept experts' weights use the unbiased scores, as when sliced
        m.gate.e_score_correction_bias[drop] = float("-inf")


def mask(cfg, m, keep, p):
    E = cfg.moe.n_routed_experts
    if p + "latent" in keep:
        d = dropped(keep[p + "latent"], cfg.moe.moe_latent_size)
        m.fc1_latent_proj.weight[d] = 0  # the experts read zero on d ...
        m.fc2_latent_proj.weight[:, d] = 0  # ... and what they write on d is not read back
    experts = keep.get(p + "experts", torch.arange(E))
    if p + "experts" in keep:
        _mask_experts(cfg, m, dropped(experts, E))
    if p + "expert_ffn" in keep:
        for row, e in enumerate(experts.tolist()):
            m.experts.down_proj[e][:, dropped(keep[p + "expert_ffn"][row], cfg.moe.moe_intermediate_size)] = 0
    if p + "shared_ffn" in keep:
        S = cfg.moe.moe_shared_expert_intermediate_size
        m.shared_experts.down_proj.weight[:, dropped(keep[p + "shared_ffn"], S)] = 0
