"""Qwen3-Next (transformers' `qwen3_next`, Qwen3NextForCausalLM): Qwen3.5's text decoder layer (our 2j: a
Gated DeltaNet 'D' or gated attention '*', the same numerics) whose MLP is our 2j+1: a softmax-routed MoE 'E'
with a sigmoid-gated shared expert, or a SwiGLU MLP '-' for the layers mlp_only_layers / decoder_sparse_step
keep dense. The Gated DeltaNet stores q, k, v, z interleaved per key head in in_proj_qkvz (per key head:
q dk, k dk, v r*dv, z r*dv rows, r value heads per key head) and b, a in in_proj_ba (per key head: b r, a r)."""
from __future__ import annotations

from remodel.models.config import MAX_LAYERS, ModelConfig
from remodel.models.errors import RemodelError

from .family import Part
from .llama_moe import QWEN2_MOE
from .qwen3_5 import BLOCK_TYPES, MLP_LAYER, TINY, Qwen35

_MOE = "E"
_SWIGLU = ("gate_proj", "up_proj", "down_proj")
_BLOCKS = "linear_num_key_heads"  # in_proj_qkvz / in_proj_ba hold one block of every part per key head


def _sparse(h) -> list[bool]:
    """Whether each HF decoder layer is MoE (transformers' rule: not in mlp_only_layers, (j + 1) % step == 0)."""
    dense, step, n = h.mlp_only_layers or [], h.decoder_sparse_step, h.num_hidden_layers
    if not isinstance(dense, list) or not all(type(j) is int and 0 <= j < n for j in dense):
        raise RemodelError(f"'mlp_only_layers' must be a list of decoder layer indices in [0, {n}), got {dense!r}")
    return [j not in dense and (j + 1) % step == 0 for j in range(n)]


class Qwen3Next(Qwen35):
    def required(self, h):
        return [*super().required(h), ("num_experts",), ("num_experts_per_tok",), ("moe_intermediate_size",)]

    def from_hf(self, h, extra):
        f = self.fields(h, extra)
        if not any(_sparse(h)):
            raise RemodelError(f"{self.name} without MoE layers (every layer dense by mlp_only_layers / "
                               "decoder_sparse_step) is not supported")
        f["pattern"] = "".join(m + (_MOE if s else MLP_LAYER) for m, s in zip(f["pattern"][0::2], _sparse(h)))
        return ModelConfig(**f, n_routed_experts=h.num_experts, num_experts_per_tok=h.num_experts_per_tok,
                           moe_intermediate_size=h.moe_intermediate_size,
                           moe_shared_expert_intermediate_size=h.shared_expert_intermediate_size or 0,
                           shared_expert_gate=True, router="softmax", norm_topk_prob=bool(h.norm_topk_prob))

    def check(self, cfg, need):
        need(not cfg.mtp_layers, f"MTP layers are not stored by {self.name}")
        mixers, mlps = cfg.pattern[0::2], cfg.pattern[1::2]
        need(cfg.num_layers % 2 == 0 and set(mixers) <= set(BLOCK_TYPES.values()) and set(mlps) <= {_MOE, MLP_LAYER}
             and _MOE in mlps, "needs the layer pattern of (Gated DeltaNet 'D' or attention '*') + (MoE 'E' or "
             f"MLP '-') pairs with at least one MoE, got {cfg.pattern!r}")
        need(cfg.norm_offset == 1, "every Qwen3-Next RMSNorm is zero-centred (norm_offset 1)")
        need(cfg.mlp.mlp_gated and cfg.mlp.mlp_act == "silu" and not cfg.mlp.mlp_bias, "needs SwiGLU MLPs / experts without bias")
        need(cfg.moe.router == "softmax" and cfg.moe.n_group == 1, "needs a softmax router without expert groups")
        need(cfg.moe.routed_scaling_factor == 1.0, "routed_scaling_factor must be 1")
        need(cfg.moe.moe_latent_size is None, "latent MoE projections are nemotron_h only")
        need(cfg.moe.shared_expert_gate or not cfg.moe.moe_shared_expert_intermediate_size,
             f"{self.name}'s shared expert is sigmoid-gated (shared_expert_gate)")
        self.check_mixers(cfg, need)

    def to_hf(self, cfg):
        mlps = cfg.pattern[1::2]
        return {**super().to_hf(cfg), "num_experts": cfg.moe.n_routed_experts,
                "num_experts_per_tok": cfg.moe.num_experts_per_tok, "moe_intermediate_size": cfg.moe.moe_intermediate_size,
                "norm_topk_prob": cfg.moe.norm_topk_prob,
                "shared_expert_intermediate_size": cfg.moe.moe_shared_expert_intermediate_size or 1,
                "decoder_sparse_step": 1, "mlp_only_layers": [j for j, m in enumerate(mlps) if m == MLP_LAYER],
                "intermediate_size": cfg.mlp.intermediate_size or cfg.moe.moe_intermediate_size}

    def key_map(self):
        """Qwen3.5's map with the fused Gated DeltaNet projections and the MoE (router `gate`, per-expert
        SwiGLUs, `shared_expert` and its `shared_expert_gate`) in HF layer j's `mlp`."""
        out = {k: v for k, v in super().key_map().items() if ".in_proj_" not in k}  # the conv as Qwen3.5's
        qkvz, ba = "model.layers.{a}.linear_attn.in_proj_qkvz.weight", "model.layers.{a}.linear_attn.in_proj_ba.weight"
        out.update({f"layers.{{a}}.mixer.in_proj_{x}.weight": Part(qkvz, 0, i, 4, sized=True, blocks=_BLOCKS)
                    for i, x in enumerate("qkvz")})
        out.update({f"layers.{{a}}.mixer.in_proj_{x}.weight": Part(ba, 0, i, 2, blocks=_BLOCKS)
                    for i, x in enumerate("ba")})
        hf = "model.layers.{m}.mlp."
        out["layers.{m}.mixer.gate.weight"] = hf + "gate.weight"
        out.update({f"layers.{{m}}.mixer.experts.{p}": f"{hf}experts.{{e}}.{p}.weight" for p in _SWIGLU})
        out.update({f"layers.{{m}}.mixer.shared_experts.{p}.weight": f"{hf}shared_expert.{p}.weight" for p in _SWIGLU})
        out["layers.{m}.mixer.shared_expert_gate.weight"] = hf + "shared_expert_gate.weight"
        return out

    def extra_tensors(self, cfg):
        """transformers always builds the shared expert and its gate: as for qwen2_moe, size-1 zeros stand for 'none'."""
        return QWEN2_MOE.extra_tensors(cfg)

    def upcycle_check(self, cfg, router):
        return f"upcycling into {self.name} is not supported yet"


_MOE_TINY = dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                 shared_expert_intermediate_size=20)
QWEN3_NEXT = Qwen3Next("qwen3_next", "Qwen3NextForCausalLM", depth=2, moe=True, shared_expert_gate=True,
                       block_types=BLOCK_TYPES, variants=("attention_gate", "zero_centred_norm"), padding_idx=True,
                       upcycle_help="none (already MoE)", raw={"decoder_sparse_step": (1, MAX_LAYERS)},
                       # three value heads per key head, attention first, top-k weights not renormalised, decoder
                       # layer 1 dense, attention bias, tied, half the head rotated
                       tiny={"plain": _MOE_TINY,
                             "grouped_dense_layer": dict(_MOE_TINY, linear_num_value_heads=6, linear_conv_kernel_dim=3,
                                                         norm_topk_prob=False, mlp_only_layers=[1], attention_bias=True,
                                                         tie_word_embeddings=True,
                                                         layer_types=["full_attention", "linear_attention"] * 2,
                                                         rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                                          "partial_rotary_factor": 0.5})})

REGISTER = (QWEN3_NEXT,)  # the families this module adds to models.families.FAMILIES, in order
