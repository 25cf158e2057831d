"""DeepSeek-V3 / V3.1 and Kimi-K2 (transformers' `deepseek_v3`): the DeepSeek-style MoE decoder
(models/families/deepseek_moe.py: dense first_k_dense_replace layers, then sigmoid-routed grouped experts with shared
experts) under multi-head latent attention (the 'L' kind). RoPE: the default type or YaRN (its mscale_all_dim on the
softmax scale, as transformers applies it)."""
from __future__ import annotations

from dataclasses import dataclass

from remodel.models.config import MAX_LAYERS, ModelConfig
from remodel.models.mla import MLA

from .deepseek_moe import DeepSeekMoEFamily
from .family import read_rope
from .width_rules import SHARED_FROM_EXPERT

_MLA = tuple(p.leaf for p in MLA.params)


@dataclass(frozen=True)
class DeepseekV3(DeepSeekMoEFamily):
    attn: tuple = _MLA
    mixer: str = "L"

    def required(self, h):
        return [("num_hidden_layers",), ("num_attention_heads",), ("n_routed_experts",), ("num_experts_per_tok",),
                ("moe_intermediate_size",), ("kv_lora_rank",), ("qk_rope_head_dim",), ("v_head_dim",),
                ("qk_nope_head_dim",)]

    def from_hf(self, h, extra):
        theta, rp, _ = read_rope(h, self.name, types=("default", "yarn"))
        return ModelConfig(
            vocab_size=h.vocab_size, hidden_size=h.hidden_size, norm_eps=h.rms_norm_eps,
            tie_word_embeddings=bool(h.tie_word_embeddings), extra=extra, **self.ffn_from_hf(h),
            mla=dict(mla_num_heads=h.num_attention_heads, q_lora_rank=h.q_lora_rank, kv_lora_rank=h.kv_lora_rank,
                     qk_nope_head_dim=h.qk_nope_head_dim, qk_rope_head_dim=h.qk_rope_head_dim, v_head_dim=h.v_head_dim,
                     mla_rope_theta=theta, mla_rope_scaling=rp if rp.get("rope_type") == "yarn" else None,
                     rope_interleave=bool(getattr(h, "rope_interleave", True)),
                     mla_bias=bool(getattr(h, "attention_bias", False))))

    def to_hf(self, cfg):
        c = cfg.mla
        return dict(**self.ffn_to_hf(cfg), num_attention_heads=c.mla_num_heads, num_key_value_heads=c.mla_num_heads,
                    q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                    qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                    rope_parameters=dict(c.mla_rope_scaling or {"rope_theta": c.mla_rope_theta, "rope_type": "default"}),
                    rope_interleave=c.rope_interleave, attention_bias=c.mla_bias)

    def claims(self, cfg):
        """MLA + (dense then sigmoid-routed MoE) decoder layers: no other family holds the MLA kind."""
        return self.holds_pattern(cfg)


_TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=4,
             kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, moe_intermediate_size=16,
             n_routed_experts=8, num_experts_per_tok=2)
DEEPSEEK_V3 = DeepseekV3(
    "deepseek_v3", "DeepseekV3ForCausalLM", padding_idx=True, width_rules=(SHARED_FROM_EXPERT,),
    raw={"first_k_dense_replace": (0, MAX_LAYERS), "n_shared_experts": (0, 1024)},
    tiny={"q_lora_grouped": dict(_TINY, num_hidden_layers=3, first_k_dense_replace=1, n_shared_experts=2, q_lora_rank=10,
                                 n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                 rope_interleave=True, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
          "direct_q_tied": dict(_TINY, num_hidden_layers=2, first_k_dense_replace=0, n_shared_experts=1, q_lora_rank=None,
                                n_group=1, topk_group=1, norm_topk_prob=False, rope_interleave=False,
                                attention_bias=True, tie_word_embeddings=True),
          "yarn": dict(_TINY, num_hidden_layers=2, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=8,
                       n_group=1, topk_group=1, norm_topk_prob=True,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 4, "mscale": 1.0, "mscale_all_dim": 0.8,
                                        "beta_fast": 32.0, "beta_slow": 1.0})})

REGISTER = (DEEPSEEK_V3,)  # the families this module adds to models.families.FAMILIES, in order
