"""gpt-oss (transformers' `gpt_oss`): decoder layer j is our pair 2j (attention) and 2j+1 (MoE). The attention is
grouped-query with q/k/v/o biases, one learned sink logit per head (attention_sinks) and RoPE (YaRN in the released
configs); `layer_types` alternates sliding-window layers (our '*', the section's sliding_window) with full ones
(our 'F', the same kind without the window). Every feed-forward is MoE: a router with a bias, top-k of its logits
softmaxed (= softmax, top-k, renormalised), experts with biases and the clamped SwiGLU (swiglu_alpha,
swiglu_limit). The experts are stored fused and transposed: gate_up_proj [E, hidden, 2 * ffn] with gate and up
interleaved column by column, down_proj [E, ffn, hidden]. Released checkpoints store those two in MXFP4
(models/mxfp4.py reads them); remodel writes them in bf16 / fp32."""
from __future__ import annotations

import re
from dataclasses import dataclass

from remodel.models.attention import ATTENTION, FULL_ATTENTION
from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.moe import MOE

from .family import Family, Part, gqa_attention
from .llama import ATTN, TINY, LlamaFamily, key_map

BLOCK_TYPES = {"sliding_attention": ATTENTION.char, "full_attention": FULL_ATTENTION.char}  # HF layer type -> ours
_PATTERN = re.compile(f"([{re.escape(ATTENTION.char + FULL_ATTENTION.char)}]{MOE.char})+")
_FFN = "moe.moe_intermediate_size"  # gate_up_proj interleaves gate and up: one block of each per FFN row


@dataclass(frozen=True)
class GptOss(LlamaFamily):
    moe: bool = True
    routers: tuple = ("topk-softmax",)
    variants: tuple = ("attention_sinks", "router_bias", "expert_bias", "clamped_swiglu")
    upcycle_help: str = "none (already MoE)"

    def required(self, h):
        return [("num_hidden_layers",), ("num_attention_heads",), ("num_local_experts",), ("num_experts_per_tok",),
                ("intermediate_size",)]

    def from_hf(self, h, extra):
        types = list(h.layer_types or [])
        unknown = sorted(set(types) - set(BLOCK_TYPES))
        if unknown or len(types) != h.num_hidden_layers:
            raise RemodelError(f"'layer_types' must name {h.num_hidden_layers} layers of {', '.join(BLOCK_TYPES)}, "
                               f"got {types!r}")
        bias = bool(getattr(h, "attention_bias", True))
        return ModelConfig(
            vocab_size=h.vocab_size, hidden_size=h.hidden_size, pattern="".join(BLOCK_TYPES[t] + MOE.char for t in types),
            norm_eps=h.rms_norm_eps, tie_word_embeddings=bool(h.tie_word_embeddings), extra=extra,
            attention=gqa_attention(h, self.name, types=("default", "yarn"), partial=False, attention_bias=bias,
                                    attention_out_bias=bias, attention_sinks=True, sliding_window=h.sliding_window),
            mlp=dict(mlp_act="silu", mlp_gated=True),
            moe=dict(n_routed_experts=h.num_local_experts, num_experts_per_tok=h.num_experts_per_tok,
                     moe_intermediate_size=h.intermediate_size, router="softmax", norm_topk_prob=True, router_bias=True,
                     expert_bias=True, swiglu_alpha=float(h.swiglu_alpha), swiglu_limit=float(h.swiglu_limit)))

    def check(self, cfg, need):
        need(not cfg.mtp_layers, "MTP layers are nemotron_h only")
        need(_PATTERN.fullmatch(cfg.pattern) is not None, f"needs the layer pattern ('*' or 'F') 'E' per decoder layer, "
             f"got {cfg.pattern!r}")
        a, m = cfg.attention, cfg.moe
        need(a.rope_theta is not None and a.partial_rotary_factor == 1, "needs RoPE attention on whole heads")
        need(a.rope_scaling is None or a.rope_scaling.get("rope_type") == "yarn", "gpt_oss RoPE is default or yarn")
        need(a.attention_sinks and a.attention_bias and a.attention_out_bias, "gpt_oss attention has sinks and q/k/v/o biases")
        need(not (a.qk_norm or a.qk_norm_full), "gpt_oss attention has no q/k norm")
        need(a.sliding_window is not None or ATTENTION.char not in cfg.pattern, "sliding layers need a sliding_window")
        need(cfg.mlp.mlp_gated and cfg.mlp.mlp_act == "silu", "needs SwiGLU experts")
        need(m.router == "softmax" and m.norm_topk_prob and m.n_group == 1 and m.routed_scaling_factor == 1,
             "gpt_oss routes by the softmax of the top-k logits, no groups, no routed scaling")
        need(m.router_bias and m.expert_bias and m.swiglu_limit is not None,
             "gpt_oss has a router bias, expert biases and the clamped SwiGLU")
        need(not m.moe_shared_expert_intermediate_size and m.moe_latent_size is None, "gpt_oss has no shared expert or latent")

    def to_hf(self, cfg):
        a, m = cfg.attention, cfg.moe
        rope = {"rope_theta": a.rope_theta, "rope_type": "default"} if a.rope_scaling is None else dict(a.rope_scaling)
        rope.pop("partial_rotary_factor", None)
        types = {c: t for t, c in BLOCK_TYPES.items()}
        return dict(num_hidden_layers=cfg.num_layers // 2, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
                    num_attention_heads=a.num_attention_heads, num_key_value_heads=a.num_key_value_heads,
                    head_dim=a.head_dim, rope_parameters=rope, attention_bias=True,
                    sliding_window=a.sliding_window, layer_types=[types[c] for c in cfg.pattern[0::2]],
                    num_local_experts=m.n_routed_experts, num_experts_per_tok=m.num_experts_per_tok,
                    intermediate_size=m.moe_intermediate_size, swiglu_alpha=m.swiglu_alpha, swiglu_limit=m.swiglu_limit)

    def key_map(self):
        out = {k: v for k, v in key_map(ATTN + ("sinks",), "mlp").items() if ".mixer." not in k or "{a}" in k}
        hf = "model.layers.{m}.mlp."
        out.update({"layers.{m}.mixer.gate.weight": hf + "router.weight", "layers.{m}.mixer.gate.bias": hf + "router.bias",
                    "layers.{m}.mixer.experts.down_proj": Part(hf + "experts.down_proj", transposed=True),
                    "layers.{m}.mixer.experts.down_proj_bias": hf + "experts.down_proj_bias"})
        for i, p in enumerate(("gate_proj", "up_proj")):  # gate_up_proj: [gate_0, up_0, gate_1, up_1, ...]
            out[f"layers.{{m}}.mixer.experts.{p}"] = Part(hf + "experts.gate_up_proj", 1, i, 2, blocks=_FFN,
                                                          transposed=True)
            out[f"layers.{{m}}.mixer.experts.{p}_bias"] = Part(hf + "experts.gate_up_proj_bias", 1, i, 2, blocks=_FFN)
        return out

    def claims(self, cfg):
        return cfg.attention.attention_sinks and _PATTERN.fullmatch(cfg.pattern) is not None

    def upcycle_into(self, cfg, router, shared):
        return Family.upcycle_into(self, cfg, router, shared)  # already MoE: --to names a target


_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
         "truncate": False, "original_max_position_embeddings": 64}
_TINY = {**{k: v for k, v in TINY.items() if k != "intermediate_size"}, "intermediate_size": 16,
         "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 3, "swiglu_limit": 0.5,
         "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": _YARN,
         "max_position_embeddings": 256}  # = factor x original (transformers warns otherwise); lm-eval reads it as max_length
GPT_OSS = GptOss("gpt_oss", "GptOssForCausalLM", padding_idx=True,
                 tiny={"yarn": _TINY,
                       "full_first_tied": dict(_TINY, tie_word_embeddings=True, num_hidden_layers=3, swiglu_alpha=1.2,
                                               layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                                               rope_parameters={"rope_type": "default", "rope_theta": 5000.0})})

REGISTER = (GPT_OSS,)  # the families this module adds to models.families.FAMILIES, in order
