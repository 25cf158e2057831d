"""Qwen3.5-MoE, the text model (transformers' `qwen3_5_moe_text`, Qwen3_5MoeForCausalLM): Qwen3.5's decoder
layer (models/families/qwen3_5.py: layer 2j a Gated DeltaNet 'D' or gated attention '*') whose FFN, our
layer 2j+1, is an MoE 'E': a softmax router that always renormalises its top-k weights (the config has no
norm_topk_prob), SwiGLU experts and a shared expert scaled by sigmoid(shared_expert_gate), stored as
qwen2_moe stores them (transformers fuses the experts in memory and saves one tensor per expert)."""
from __future__ import annotations

from remodel.models.config import ModelConfig
from remodel.models.moe import MOE

from .llama import key_map
from .llama_moe import QWEN2_MOE
from .qwen3_5 import TINY, BLOCK_TYPES, Qwen35

_SWIGLU = {p: p for p in ("gate_proj", "up_proj", "down_proj")}


class Qwen35Moe(Qwen35):
    FFN = MOE.char

    def required(self, h):
        return [("num_hidden_layers",), ("layer_types",), ("num_experts",), ("num_experts_per_tok",),
                ("moe_intermediate_size",)]

    def from_hf(self, h, extra):
        shared = getattr(h, "shared_expert_intermediate_size", 0) or 0
        return ModelConfig(
            **self.common(h, extra), n_routed_experts=h.num_experts, num_experts_per_tok=h.num_experts_per_tok,
            moe_intermediate_size=h.moe_intermediate_size, moe_shared_expert_intermediate_size=shared,
            shared_expert_gate=True, router="softmax", norm_topk_prob=True)

    def check(self, cfg, need):
        super().check(cfg, need)
        need(cfg.moe.router == "softmax" and cfg.moe.n_group == 1, "needs a softmax router without expert groups")
        need(cfg.moe.norm_topk_prob, f"{self.name} always renormalises the top-k weights")
        need(cfg.moe.routed_scaling_factor == 1.0, "routed_scaling_factor must be 1")
        need(cfg.moe.moe_latent_size is None, "latent MoE projections are nemotron_h only")
        need(cfg.moe.shared_expert_gate or not cfg.moe.moe_shared_expert_intermediate_size,
             f"{self.name}'s shared expert is gated (shared_expert_gate)")

    def ffn_to_hf(self, cfg):
        return {"num_experts": cfg.moe.n_routed_experts, "num_experts_per_tok": cfg.moe.num_experts_per_tok,
                "moe_intermediate_size": cfg.moe.moe_intermediate_size,
                "shared_expert_intermediate_size": cfg.moe.moe_shared_expert_intermediate_size or 1}

    def ffn_keys(self):
        """qwen2_moe's MoE keys: router `mlp.gate`, experts `mlp.experts.{e}.*`, `mlp.shared_expert(_gate)`."""
        return {k: v for k, v in key_map((), "mlp", "gate", _SWIGLU, shared=True).items()
                if k.startswith("layers.{m}.mixer.")}

    def extra_tensors(self, cfg):
        """transformers always builds the shared expert and its gate: size-1 zeros stand for 'none' (qwen2_moe's)."""
        return QWEN2_MOE.extra_tensors(cfg)

    def upcycle_into(self, cfg, router, shared):
        return super(Qwen35, self).upcycle_into(cfg, router, shared)  # already MoE: no target

    def upcycle_check(self, cfg, router):
        if router not in self.routers:
            return f"{self.name} routers renormalise the softmax top-k weights: use --router topk-softmax"
        return None


_MOE = {**{k: v for k, v in TINY.items() if k != "intermediate_size"},  # (the dense MLPs' size: none here)
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24}
QWEN3_5_MOE_TEXT = Qwen35Moe(
    "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", depth=2, moe=True, routers=("topk-softmax",), shared_expert_gate=True,
    block_types=BLOCK_TYPES, variants=("attention_gate", "zero_centred_norm"), padding_idx=True,
    upcycle_help="none (already MoE)",
    # three value heads per key head, attention first with every bias, tied, one expert per token, half rotated
    tiny={"plain": _MOE,
          "grouped_biased_tied": dict(_MOE, linear_num_value_heads=6, attention_bias=True, tie_word_embeddings=True,
                                      num_experts_per_tok=1, shared_expert_intermediate_size=8,
                                      layer_types=["full_attention", "linear_attention"] * 2,
                                      rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                       "partial_rotary_factor": 0.5})})

REGISTER = (QWEN3_5_MOE_TEXT,)  # the families this module adds to models.families.FAMILIES, in order
