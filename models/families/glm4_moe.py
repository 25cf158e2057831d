"""GLM-4.5 / 4.6 / 4.7 (transformers' `glm4_moe`): the DeepSeek-style MoE decoder (models/families/deepseek_moe.py:
dense first_k_dense_replace layers, then sigmoid-routed grouped experts with shared experts) under grouped-query
attention: RoPE on the first partial_rotary_factor of each head, optional per-head q/k RMSNorm (use_qk_norm), q/k/v
bias (attention_bias) and never an o_proj bias. Its MTP layers (model.layers.{num_hidden_layers}..., which transformers
skips on load) are our MTP head (models/mtp.py): `enorm` / `hnorm` / `eh_proj` fuse the next token's embedding with
the trunk's output, one decoder layer of the trunk's widths follows, `shared_head.norm` is the step's final norm; the
head reuses the trunk's embeddings and lm_head (the copies some releases also store, `embed_tokens` and
`shared_head.head`, are not read)."""
from __future__ import annotations

from dataclasses import dataclass

from remodel.models.config import MAX_LAYERS, ModelConfig
from remodel.models.kinds import routed

from .deepseek_moe import DeepSeekMoEFamily
from .family import gqa_attention, gqa_to_hf
from .llama import QWEN3_ATTN, TINY, mtp_key_map
from .width_rules import SHARED_FROM_EXPERT

_ATTN = tuple(t for t in QWEN3_ATTN if t != "o_proj.bias")  # q/k/v bias, q/k norm, never an o_proj bias


@dataclass(frozen=True)
class Glm4Moe(DeepSeekMoEFamily):
    attn: tuple = _ATTN
    qkv_bias: str = "attention_bias"

    def required(self, h):
        return [("num_hidden_layers",), ("num_attention_heads",), ("n_routed_experts",), ("num_experts_per_tok",),
                ("moe_intermediate_size",)]

    def from_hf(self, h, extra):
        return ModelConfig(vocab_size=h.vocab_size, hidden_size=h.hidden_size, norm_eps=h.rms_norm_eps,
                           tie_word_embeddings=bool(h.tie_word_embeddings), extra=extra, **self.ffn_from_hf(h),
                           **self.mtp_from_hf(h),
                           attention=gqa_attention(h, self.name, attention_bias=bool(h.attention_bias),
                                                   qk_norm=bool(h.use_qk_norm)))

    def check(self, cfg, need):
        super().check(cfg, need)
        a = cfg.attention
        need(a.rope_theta is not None and a.sliding_window is None, "needs RoPE attention without a sliding window")
        need(not a.attention_out_bias, "glm4_moe has q/k/v bias and no o_proj bias")

    def to_hf(self, cfg):
        a = cfg.attention
        return dict(**self.ffn_to_hf(cfg), **gqa_to_hf(a), attention_bias=a.attention_bias, use_qk_norm=a.qk_norm,
                    num_nextn_predict_layers=cfg.mtp_layers)

    def key_map(self):
        return {**super().key_map(), **mtp_key_map(super().key_map())}

    def claims(self, cfg):
        """Sigmoid-routed Llama-shaped MoE with partial RoPE (full RoPE stays nemotron_h's default, as before)."""
        a = cfg.attention
        return (routed(cfg) and cfg.moe.router == "sigmoid" and cfg.mlp.mlp_gated and a.rope_theta is not None
                and a.partial_rotary_factor < 1 and self.holds_pattern(cfg))


_TINY = {**{k: v for k, v in TINY.items() if k != "num_hidden_layers"}, "moe_intermediate_size": 16,
         "n_routed_experts": 8, "num_experts_per_tok": 2}
GLM4_MOE = Glm4Moe("glm4_moe", "Glm4MoeForCausalLM", padding_idx=True, mtp=True, width_rules=(SHARED_FROM_EXPERT,),
                   raw={"first_k_dense_replace": (0, MAX_LAYERS), "n_shared_experts": (0, 1024)},
                   tiny={"grouped": dict(_TINY, num_hidden_layers=3, first_k_dense_replace=1, n_shared_experts=2,
                                         n_group=2, topk_group=1, routed_scaling_factor=2.5, use_qk_norm=True,
                                         attention_bias=True, norm_topk_prob=True),
                         "plain_tied": dict(_TINY, num_hidden_layers=2, first_k_dense_replace=0, n_shared_experts=1,
                                            use_qk_norm=False, attention_bias=False, norm_topk_prob=False,
                                            tie_word_embeddings=True,
                                            rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                             "partial_rotary_factor": 0.25})})

REGISTER = (GLM4_MOE,)  # the families this module adds to models.families.FAMILIES, in order
