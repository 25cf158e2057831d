"""IBM Granite (transformers' `granite`, GraniteForCausalLM, e.g. Granite 3.x): a Llama (models/families/llama.py:
decoder layer j is our attention 2j and SwiGLU MLP 2j+1) whose embeddings are multiplied by
embedding_multiplier, attention scores scaled by attention_multiplier (not 1/sqrt(head_dim)), residual
branches multiplied by residual_multiplier and logits divided by logits_scaling: ModelConfig's scalar
multipliers, as granitemoehybrid's. attention_bias covers q/k/v/o; mlp_bias the three MLP projections.
A dense Granite upcycles into granitemoehybrid's attention + MoE layers (which always keep a shared MLP)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .family import cfg_float
from .llama import ATTN, TINY, LlamaFamily, key_map

# HF field -> ModelConfig field, and the bounds transformers' model needs
SCALARS = {"embedding_multiplier": ("embedding_multiplier", None), "residual_multiplier": ("residual_multiplier", None),
           "logits_scaling": ("logits_scaling", 0)}


@dataclass(frozen=True)
class GraniteDense(LlamaFamily):
    upcycle_help: str = "granitemoehybrid (with --shared-expert-size > 0: its MoE layers keep a shared MLP)"

    def from_hf(self, h, extra):
        cfg = super().from_hf(h, extra)
        att = cfg_float(h, "attention_multiplier", 1.0)
        return cfg.replace(attention_scale=None if att == 1 / math.sqrt(cfg.attention.head_dim) else att,
                           **{ours: cfg_float(h, k, 1.0, lo=lo) for k, (ours, lo) in SCALARS.items()})

    def check(self, cfg, need):
        super().check(cfg.replace(mlp_bias=False), need)  # Llama's rules but for the MLP bias, which granite has

    def to_hf(self, cfg):
        scale = cfg.attention.attention_scale if cfg.attention.attention_scale is not None else 1 / math.sqrt(cfg.attention.head_dim)
        return {**super().to_hf(cfg), "mlp_bias": cfg.mlp.mlp_bias, "attention_multiplier": scale,
                **{k: cfg.get(ours) for k, (ours, _) in SCALARS.items()}}

    def key_map(self):
        out = key_map(ATTN, "mlp")
        out.update({f"layers.{{m}}.mixer.{p}.bias": f"model.layers.{{m}}.mlp.{p}.bias"
                    for p in ("gate_proj", "up_proj", "down_proj")})
        return out

    def claims(self, cfg):
        return False  # a Llama-shaped model with multipliers exports as granitemoehybrid unless --to granite

    def upcycle_into(self, cfg, router, shared):
        return "granitemoehybrid"


_SCALED = dict(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=2.5)
GRANITE_DENSE = GraniteDense(
    "granite", "GraniteForCausalLM", multipliers=True, padding_idx=True,
    # every multiplier away from 1; every bias, tied embeddings, RoPE theta, other multipliers
    tiny={"scaled": dict(TINY, **_SCALED),
          "biased_tied": dict(TINY, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, embedding_multiplier=1.5,
                              residual_multiplier=0.7, attention_multiplier=0.5, logits_scaling=0.5)})

REGISTER = (GRANITE_DENSE,)  # the families this module adds to models.families.FAMILIES, in order
