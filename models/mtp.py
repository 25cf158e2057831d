"""Multi-token prediction (MTP) head of Nemotron 3 Super, in the layout vLLM's `nemotron_h_mtp.py` reads.

The checkpoint holds `cfg.mtp_layers` steps of the `cfg.mtp_pattern` blocks (Super: one step of "*E"),
numbered flat as `mtp.layers.{j}`. The first block of a step fuses the token embedding with the previous
hidden state, `eh_proj(cat[enorm(embed(t+1)), hnorm(h_t)])`; every block is a pre-norm residual block of
the trunk's kind (`norm`, `mixer`); the last block of a step ends with `final_layernorm`. Embeddings and
lm_head are the trunk's. transformers ignores these tensors; the trunk's logits never depend on them.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .block import Block
from .norm import trunk_norm


def mtp_block_roles(cfg: ModelConfig, j: int) -> tuple[bool, bool]:
    """(starts a step: has enorm/hnorm/eh_proj, ends a step: has final_layernorm) of MTP block j."""
    P = len(cfg.mtp_pattern)
    return j % P == 0, j % P == P - 1


class MTPBlock(Block):
    """One MTP block: the trunk's Block (norm + mixer) with the step's fusion in front / final norm after."""

    def __init__(self, cfg: ModelConfig, kind: str, start: bool, end: bool):
        super().__init__(cfg, kind)
        H = cfg.hidden_size
        if start:
            self.enorm, self.hnorm = trunk_norm(cfg), trunk_norm(cfg)
            self.eh_proj = nn.Linear(2 * H, H, bias=False)
        if end:
            self.final_layernorm = trunk_norm(cfg)

    def forward(self, x, emb=None, attention_mask=None, position_ids=None):
        if hasattr(self, "eh_proj"):
            x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(x)], dim=-1))
        x = super().forward(x, attention_mask, position_ids)
        return self.final_layernorm(x) if hasattr(self, "final_layernorm") else x


class MTP(nn.Module):
    """The MTP blocks of every step, flat as in the checkpoint (`mtp.layers.{j}`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(MTPBlock(cfg, c, *mtp_block_roles(cfg, j))
                                    for j, c in enumerate(cfg.mtp_full_pattern))

    def step(self, k: int, h, emb, attention_mask=None, position_ids=None):
        """Step k: h [b, l, H] (trunk output after norm_f, or step k-1's output) fused with the
        embeddings of the tokens one further on, emb [b, l, H] -> [b, l, H] (before lm_head)."""
        P = len(self.cfg.mtp_pattern)
        for layer in self.layers[k * P:(k + 1) * P]:
            h = layer(h, emb, attention_mask, position_ids)
        return h
