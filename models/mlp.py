"""The dense MLP layer kind ('-'): relu2 or SwiGLU, its module and its spec (MLP_KIND)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .recompute import maybe_checkpoint
from .section import MAX_WIDTH, Section, ints, plain, vector
from .spec import LayerKind, Site, Width, mlp_params, sq, top


@dataclass(frozen=True)
class MLPConfig(Section):
    """The dense MLP kind's fields: its width, activation, gating and biases; mlp_multipliers scale the
    gate_proj and down_proj outputs (Falcon-H1; 1 elsewhere)."""
    intermediate_size: int = ints(0, 0, MAX_WIDTH, raw={"intermediate_size": 1})
    mlp_act: str = plain("relu2")
    mlp_gated: bool = plain(False, "SwiGLU-style: down(act(gate(x)) * up(x))")
    mlp_bias: bool = plain(False)
    mlp_multipliers: tuple = vector((1.0, 1.0), variant="projections")


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
ACTIVATIONS = ("relu2", "silu", "gelu", "gelu_tanh", "relu")


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

    def __init__(self, hidden: int, ffn: int, act: str, gated: bool, bias: bool = False, multipliers=(1.0, 1.0)):
        super().__init__()
        self.act = ACT[act]
        self.gate_multiplier, self.down_multiplier = multipliers  # MLPConfig.mlp_multipliers (1: off)
        self.up_proj = nn.Linear(hidden, ffn, bias=bias)
        self.gate_proj = nn.Linear(hidden, ffn, bias=bias) if gated else None
        self.down_proj = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x):
        h = self.up_proj(x)
        if self.gate_proj is None:
            return maybe_checkpoint(self, self._act_down, h)
        gate = self.gate_proj(x)
        return maybe_checkpoint(self, self._act_down, h, gate if self.gate_multiplier == 1 else gate * self.gate_multiplier)

    def _act_down(self, h, gate=None):
        """down(act(gate) * h), or down(act(h)) (times the down multiplier): what selective recomputation replays."""
        y = self.down_proj(gated_act(self.act, h, gate))
        return y if self.down_multiplier == 1 else y * self.down_multiplier




def ffn_magnitude(site: str, local: str, t: torch.Tensor) -> list:
    """Squared-norm terms of an MLP's tensor (leaf `local`) on its `site` units: up/gate rows, down columns."""
    if local.endswith(("up_proj.weight", "gate_proj.weight", "up_proj.bias", "gate_proj.bias")):
        return [(site, sq(t, 0))]
    if local.endswith("down_proj.weight"):
        return [(site, sq(t, 1))]
    return []


class MLPKind(LayerKind):
    def build(self, cfg):
        return MLP(cfg.hidden_size, cfg.mlp.intermediate_size, cfg.mlp.mlp_act, cfg.mlp.mlp_gated, cfg.mlp.mlp_bias, cfg.mlp.mlp_multipliers)

    def validate(self, cfg, need):
        need(cfg.mlp.intermediate_size > 0, "MLP layers need intermediate_size > 0")
        need(cfg.mlp.mlp_act in ACTIVATIONS, f"unknown activation {cfg.mlp.mlp_act!r}")

    def summary(self, cfg):
        return {"intermediate_size": cfg.mlp.intermediate_size, "mlp_act": cfg.mlp.mlp_act, "mlp_gated": cfg.mlp.mlp_gated}

    def sites(self, cfg):
        return (Site("ffn", "down_proj", "input", norm_of="down_proj.weight"),)

    def keep(self, cfg, score, t, p):
        if "ffn_size" not in t:
            return {}
        return {p + "ffn": top(score(p + "ffn", (cfg.mlp.intermediate_size,), "--ffn-size"), t["ffn_size"])}

    def magnitude(self, cfg, local, t):
        return ffn_magnitude("ffn", local, t)

    def check_tp(self, cfg, tp, need):
        need(cfg.mlp.intermediate_size % tp == 0, f"tensor parallelism: intermediate_size={cfg.mlp.intermediate_size} "
             f"is not divisible by tp={tp}")


MLP_KIND = MLPKind("-", "mlp", mlp_params("", "ffn", ("mlp_bias",)), units={"ffn": "intermediate_size"},
                   sizes={"ffn": lambda cfg, w: w["ffn_size"]},
                   scored={"ffn": ("ffn",)}, widths=("ffn_size",),
                   declares=(Width("ffn_size", "intermediate_size", None, "ffn", 512, "ffn", "dense MLP intermediate size"),), tp_axes=("ffn",), color="tab:green",
                   tp_plan={"up_proj": "colwise", "gate_proj": "colwise", "down_proj": "rowwise"}, upcycles_to="E",
                   config=MLPConfig)
