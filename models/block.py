"""One residual layer: x + mixer(norm(x)), the mixer built by the layer kind of its pattern character."""
from __future__ import annotations

from torch import nn

from .config import ModelConfig
from .kinds import KINDS
from .norm import RMSNorm


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        self.kind, self.spec = kind, KINDS[kind]
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mixer = self.spec.build(cfg)

    def forward(self, x, attention_mask=None, position_ids=None):
        given = {"attention_mask": attention_mask, "position_ids": position_ids}
        return x + self.mixer(self.norm(x), *(given[a] for a in self.spec.inputs))
