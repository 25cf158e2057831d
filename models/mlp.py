"""Dense MLP (relu2 or SwiGLU) and the mixture-of-experts layer with its routers.

Experts are stored fused, [E, F, L] per projection, and dispatched dropless: tokens are sorted by
expert and each expert runs once on exactly the tokens routed to it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .recompute import maybe_checkpoint


class _Relu2(torch.autograd.Function):
    """relu(x)^2 keeping only relu(x) for backward (grad * 2 relu(x)): two passes instead of autograd's five."""

    @staticmethod
    def forward(ctx, x):
        r = torch.relu(x)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    def backward(ctx, g):
        (r,) = ctx.saved_tensors
        return torch.mul(g, r).mul_(2)


ACT = {
    "relu2": _Relu2.apply,
    "relu": torch.relu,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def gated_act(act, h, gate=None):
    """act(gate) * h for a gated (SwiGLU-style) FFN, act(h) otherwise."""
    return act(gate) * h if gate is not None else act(h)


def ffn(x, up, gate, down, act, linear=F.linear):
    """One expert's arithmetic, down(gated_act(up x, gate x)), with weights given as tensors (a fused
    expert's slice, a shard); returns (the activation entering down, the output) for scorers."""
    h = gated_act(act, linear(x, up), None if gate is None else linear(x, gate))
    return h, linear(h, down)


class MLP(nn.Module):
    recompute_core = False  # models.recompute "selective": activation + down_proj recomputed in backward

    def __init__(self, hidden: int, ffn: int, act: str, gated: bool, bias: bool = False):
        super().__init__()
        self.act = ACT[act]
        self.up_proj = nn.Linear(hidden, ffn, bias=bias)
        self.gate_proj = nn.Linear(hidden, ffn, bias=bias) if gated else None
        self.down_proj = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x):
        h = self.up_proj(x)
        if self.gate_proj is None:
            return maybe_checkpoint(self, self._act_down, h)
        return maybe_checkpoint(self, self._act_down, h, self.gate_proj(x))

    def _act_down(self, h, gate=None):
        """down(act(gate) * h), or down(act(h)): what selective recomputation replays."""
        return self.down_proj(gated_act(self.act, h, gate))


class Router(nn.Module):
    """sigmoid: Nemotron-H / DeepSeek-V3 (select on score + correction bias, optional expert groups,
    weight with the unbiased score). softmax: Mixtral / Qwen (softmax over all, keep top-k).
    Both: optional renormalisation of the kept weights, then routed_scaling_factor."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if cfg.router == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x):
        """x [T, H] -> (logits [T, E] fp32, weights [T, k] fp32, indices [T, k])."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float())
        k = cfg.num_experts_per_tok
        if cfg.router == "sigmoid":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            if cfg.n_group > 1:
                E, G = cfg.n_routed_experts, cfg.n_group
                group = choice.view(choice.shape[0], G, E // G).topk(2, dim=-1)[0].sum(-1)
                top_groups = group.topk(cfg.topk_group, dim=-1, sorted=False)[1]
                gmask = torch.zeros_like(group).scatter_(1, top_groups, 1.0).bool()
                choice = choice.masked_fill(~gmask.repeat_interleave(E // G, dim=1), float("-inf"))
            idx = choice.topk(k, dim=-1, sorted=False)[1]
            w = scores.gather(1, idx)
            if cfg.norm_topk_prob:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
        else:
            probs = logits.softmax(-1)
            w, idx = probs.topk(k, dim=-1)
            if cfg.norm_topk_prob:
                w = w / w.sum(-1, keepdim=True)
        return logits, w * cfg.routed_scaling_factor, idx


class Experts(nn.Module):
    recompute_core = False  # models.recompute "selective": each expert's activation + down recomputed

    def __init__(self, cfg):
        super().__init__()
        E, Fm, L = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_input_size
        self.act = ACT[cfg.mlp_act]
        self.up_proj = nn.Parameter(torch.empty(E, Fm, L))
        self.gate_proj = nn.Parameter(torch.empty(E, Fm, L)) if cfg.mlp_gated else None
        self.down_proj = nn.Parameter(torch.empty(E, L, Fm))

    def expert(self, e: int, x):
        h = F.linear(x, self.up_proj[e])
        if self.gate_proj is None:
            return maybe_checkpoint(self, self._act_down, e, h)
        return maybe_checkpoint(self, self._act_down, e, h, F.linear(x, self.gate_proj[e]))

    def _act_down(self, e: int, h, gate=None):
        return F.linear(gated_act(self.act, h, gate), self.down_proj[e])

    def forward(self, x, weights, idx):
        """x [T, L], weights/idx [T, k] -> sum_k w * expert_idx(x), dropless."""
        T, k = idx.shape
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.up_proj.shape[0]).tolist()
        token = order // k
        w = weights.reshape(-1)[order]
        out = torch.zeros(T, x.shape[-1], dtype=torch.float32, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                tok = token[start:start + n]
                y = self.expert(e, x[tok]) * w[start:start + n, None]
                out.index_add_(0, tok, y.float())
            start += n
        return out.to(x.dtype)


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        S = cfg.moe_shared_expert_intermediate_size
        self.shared_experts = MLP(cfg.hidden_size, S, cfg.mlp_act, cfg.mlp_gated) if S else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if cfg.shared_expert_gate else None
        if cfg.moe_latent_size:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, cfg.moe_latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(cfg.moe_latent_size, cfg.hidden_size, bias=False)
        self.router_logits = None  # last forward's [T, E] logits, read by the trainer's aux losses

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, w, idx = self.gate(x)
        self.router_logits = logits
        h = self.fc1_latent_proj(x) if self.cfg.moe_latent_size else x
        y = self.experts(h, w, idx)
        if self.cfg.moe_latent_size:
            y = self.fc2_latent_proj(y)
        if self.shared_experts is not None:
            s = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                s = torch.sigmoid(self.shared_expert_gate(x)) * s
            y = y + s
        return y.view(shape)
