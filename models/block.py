"""One residual layer: x + mixer(norm(x)) (x + norm(mixer(x)) for a post_norm kind) (the mixer's output times cfg.scales.residual_multiplier), the mixer built
by the layer kind of its pattern character."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig
from .kinds import KINDS
from .norm import trunk_norm


class Block(nn.Module):
    recompute = False  # models.recompute "full": the block runs under checkpoint and is recomputed in backward

    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        self.kind, self.spec = kind, KINDS[kind]
        self.add_module(self.spec.norm_name, trunk_norm(cfg))  # 'post_norm' after the mixer
        self.mixer = self.spec.build(cfg.view(self.spec))  # the trunk and its own sections only
        self.residual_multiplier = cfg.scales.residual_multiplier  # the mixer's output joins the stream scaled

    @property
    def norm(self):
        """The block's RMSNorm, before or after the mixer as its kind says."""
        m = self._modules.get(self.spec.norm_name) if "_modules" in self.__dict__ else None
        if m is None:  # before __init__ registers it (nn.Module.add_module asks hasattr)
            raise AttributeError("norm")
        return m

    def forward(self, x, attention_mask=None, position_ids=None):
        """Hooks on the Block (FSDP2's, per layer) stay outside the checkpointed region."""
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, x, attention_mask, position_ids, use_reentrant=False)
        return self._forward(x, attention_mask, position_ids)

    def _forward(self, x, attention_mask, position_ids):
        given = {"attention_mask": attention_mask, "position_ids": position_ids}
        if self.spec.post_norm:  # the kind's norm placement: after the mixer (OLMo 2)
            return self.join(x, self.norm(self.mixer(x, *(given[a] for a in self.spec.inputs))))
        return self.join(x, self.mixer(self.norm(x), *(given[a] for a in self.spec.inputs)))

    def join(self, x, y):
        """The residual update: x + the mixer's output y (times cfg.scales.residual_multiplier); forward and the
        streaming checks that run the mixer themselves both call it."""
        return x + (y if self.residual_multiplier == 1 else y * self.residual_multiplier)
