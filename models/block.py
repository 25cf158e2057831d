"""One residual layer: x + mixer(norm(x)), the mixer chosen by the pattern character (M * - E)."""
from __future__ import annotations

from torch import nn

from .attention import Attention
from .config import ModelConfig
from .mamba import Mamba2Mixer
from .mlp import MLP, MoE
from .norm import RMSNorm


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if kind == "M":
            self.mixer = Mamba2Mixer(cfg)
        elif kind == "*":
            self.mixer = Attention(cfg)
        elif kind == "-":
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_act, cfg.mlp_gated, cfg.mlp_bias)
        else:
            self.mixer = MoE(cfg)

    def forward(self, x, attention_mask=None, position_ids=None):
        h = self.norm(x)
        if self.kind == "M":
            h = self.mixer(h, attention_mask)
        elif self.kind == "*":
            h = self.mixer(h, attention_mask, position_ids)
        else:
            h = self.mixer(h)
        return x + h
