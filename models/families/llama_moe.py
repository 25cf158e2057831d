"""The Llama family's MoE members (transformers' `mixtral`, `qwen2_moe`, `qwen3_moe`): decoder layer j is
our pair 2j (attention) and 2j+1 (softmax-routed MoE, Qwen2-MoE with a gated shared expert)."""
from __future__ import annotations

from dataclasses import dataclass

from remodel.models.config import MAX_LAYERS, ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.kinds import layer_kinds

from .llama import QWEN2_ATTN, QWEN3_ATTN, SPARSE, TINY, LlamaFamily, key_map

_SWIGLU = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
_SOFTMAX = ("topk-softmax", "softmax-topk")


@dataclass(frozen=True)
class MoEFamily(LlamaFamily):
    """experts_field: the config field of the expert count; expert_size_field: of the expert FFN size;
    shared: it stores a shared expert; mlp / expert_leaves: the key map's MoE module and expert leaves."""
    layer: str = SPARSE
    moe: bool = True
    routers: tuple = _SOFTMAX
    experts_field: str = "num_experts"
    expert_size_field: str = "moe_intermediate_size"
    shared: bool = False
    renormalises: bool = False  # always renormalises the top-k weights (no norm_topk_prob field)
    mlp: str = "mlp"
    expert_leaves: tuple = tuple(_SWIGLU.items())
    upcycle_help: str = "none (already MoE)"

    def required(self, h):
        return [("num_hidden_layers",), ("num_attention_heads",), (self.experts_field,), ("num_experts_per_tok",),
                (self.expert_size_field,)]

    def from_hf(self, h, extra):
        common = self.common(h, extra)
        if getattr(h, "mlp_only_layers", []) or getattr(h, "decoder_sparse_step", 1) != 1:
            raise RemodelError(f"{self.name} with dense layers (mlp_only_layers / decoder_sparse_step) is not supported")
        shared = (getattr(h, "shared_expert_intermediate_size", 0) or 0) if self.shared else 0
        return ModelConfig(pattern=self.layer * h.num_hidden_layers, n_routed_experts=getattr(h, self.experts_field),
                           num_experts_per_tok=h.num_experts_per_tok,
                           moe_intermediate_size=getattr(h, self.expert_size_field),
                           moe_shared_expert_intermediate_size=shared, shared_expert_gate=self.shared_expert_gate,
                           router="softmax", norm_topk_prob=self.renormalises or bool(getattr(h, "norm_topk_prob", True)),
                           **common)

    def check(self, cfg, need):
        super().check(cfg, need)
        need(cfg.moe.router == "softmax" and cfg.moe.n_group == 1, "needs a softmax router without expert groups")
        need(cfg.moe.routed_scaling_factor == 1.0, "routed_scaling_factor must be 1")
        need(cfg.moe.moe_latent_size is None, "latent MoE projections are nemotron_h only")
        need(cfg.moe.norm_topk_prob or not self.renormalises, f"{self.name} always renormalises the top-k weights")
        need(self.shared or not cfg.moe.moe_shared_expert_intermediate_size,
             f"{self.name} has no shared expert (use qwen2_moe)")
        need(cfg.moe.shared_expert_gate == self.shared_expert_gate or not cfg.moe.moe_shared_expert_intermediate_size,
             "shared-expert gate must match the family")

    def ffn_to_hf(self, cfg):
        d = {self.experts_field: cfg.moe.n_routed_experts, "num_experts_per_tok": cfg.moe.num_experts_per_tok,
             "intermediate_size": cfg.moe.moe_intermediate_size, self.expert_size_field: cfg.moe.moe_intermediate_size}
        if not self.renormalises:  # Qwen-MoE: norm_topk_prob, and every layer sparse
            d.update(norm_topk_prob=cfg.moe.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
        if self.shared:
            d["shared_expert_intermediate_size"] = cfg.moe.moe_shared_expert_intermediate_size or 1
        return d

    def key_map(self):
        return key_map(self.attn, self.mlp, "gate", dict(self.expert_leaves), shared=self.shared)

    def extra_tensors(self, cfg):
        """transformers always builds the shared expert and its gate: size-1 zeros stand for 'none'."""
        if not self.shared or cfg.moe.moe_shared_expert_intermediate_size:
            return {}
        H, out = cfg.hidden_size, {}
        for i, k in enumerate(layer_kinds(cfg)):
            if k.routed:
                p = f"layers.{i}.mixer."
                out.update({p + "shared_experts.gate_proj.weight": (1, H), p + "shared_experts.up_proj.weight": (1, H),
                            p + "shared_experts.down_proj.weight": (H, 1), p + "shared_expert_gate.weight": (1, H)})
        return out

    def claims(self, cfg):
        if not super().claims(cfg):
            return False
        return self.qk_norm or bool(cfg.moe.moe_shared_expert_intermediate_size) == self.shared

    def upcycle_check(self, cfg, router):
        if router == "sigmoid":
            return f"{self.name} routers are softmax: use --router topk-softmax or softmax-topk"
        if self.qk_norm and not cfg.attention.qk_norm:
            return (f"cannot upcycle to {self.name} exactly: the source attention has no q/k norm "
                    "(use --to mixtral or qwen2_moe, or a qwen3 source)")
        if router not in self.routers:
            return f"{self.name} always renormalises the top-k weights ({router} needs --to qwen2_moe/qwen3_moe)"
        return None


MIXTRAL = MoEFamily("mixtral", "MixtralForCausalLM", window=True, routers=("topk-softmax",), renormalises=True,
                    padding_idx=True,
                    experts_field="num_local_experts", expert_size_field="intermediate_size", mlp="block_sparse_moe",
                    expert_leaves=(("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")),
                    tiny={"plain": dict(TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)})
_QWEN_MOE = {**{k: v for k, v in TINY.items() if k != "intermediate_size"},  # (the dense MLPs' size: none here)
             "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 12}
SPARSE_STEP = {"decoder_sparse_step": (1, MAX_LAYERS)}  # every layer must be MoE (checked by from_hf)
QWEN2_MOE = MoEFamily("qwen2_moe", "Qwen2MoeForCausalLM", attn=QWEN2_ATTN, qkv_bias="qkv_bias", qwen_window=True,
                      shared=True, shared_expert_gate=True, raw=SPARSE_STEP, padding_idx=True,
                      tiny={"plain": dict(_QWEN_MOE, shared_expert_intermediate_size=20, norm_topk_prob=False)})
QWEN3_MOE = MoEFamily("qwen3_moe", "Qwen3MoeForCausalLM", attn=QWEN3_ATTN, qk_norm=True, qwen_window=True, raw=SPARSE_STEP,
                      padding_idx=True,
                      tiny={"plain": dict(_QWEN_MOE, norm_topk_prob=True)})

REGISTER = (MIXTRAL, QWEN2_MOE, QWEN3_MOE)  # the families this module adds to models.families.FAMILIES, in order
