"""Kimi Linear (transformers' `kimi_linear`, KimiLinearForCausalLM): decoder layer j is our pair 2j (Kimi Delta
Attention 'K' on "linear_attention" layers, multi-head latent attention 'L' without RoPE on "full_attention"
ones) and 2j+1 (a SwiGLU MLP '-' on "dense" mlp_layer_types, else the DeepSeek-style MoE 'E': sigmoid router with
e_score_correction_bias, expert groups, routed_scaling_factor and n_shared_experts shared experts). Both mixers
sit under `self_attn`; the checkpoints store the feed-forward of every layer under `block_sparse_moe` (what
transformers' save_pretrained writes), experts as w1 (gate), w3 (up), w2 (down)."""
from __future__ import annotations

from dataclasses import dataclass

from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.kda import KDA
from remodel.models.kinds import kind, routed
from remodel.models.mla import MLA

from .deepseek_moe import DeepSeekMoEFamily
from .llama import key_map
from .width_rules import SHARED_FROM_EXPERT

BLOCK_TYPES = {"linear_attention": "K", "full_attention": "L"}
MLP_TYPES = {"dense": "-", "sparse": "E"}
_FFN = "block_sparse_moe"
_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_SWIGLU = ("gate_proj", "up_proj", "down_proj")
_ATTN = tuple(dict.fromkeys(p.leaf for k in (KDA, MLA) for p in k.params))


def _types(h, key: str, known: dict) -> str:
    """The pattern characters of config list `key` (one per decoder layer, each a known type)."""
    types = getattr(h, key)
    if not isinstance(types, list) or len(types) != h.num_hidden_layers or not set(types) <= set(known):
        raise RemodelError(f"'{key}' must list one of {', '.join(known)} per decoder layer, got {types!r}")
    return "".join(known[t] for t in types)


@dataclass(frozen=True)
class KimiLinear(DeepSeekMoEFamily):
    attn: tuple = _ATTN
    mixer: str = "K"

    def required(self, h):
        return [("num_hidden_layers",), ("num_attention_heads",), ("moe_intermediate_size",), ("kv_lora_rank",),
                ("qk_rope_head_dim",), ("v_head_dim",), ("qk_nope_head_dim",)]

    def from_hf(self, h, extra):
        if getattr(h, "hidden_act", "silu") != "silu":
            raise RemodelError(f"unsupported hidden_act {h.hidden_act!r} for {self.name} (only silu)")
        if not h.n_shared_experts:
            raise RemodelError(f"{self.name} with n_shared_experts=0 is not supported (transformers builds them)")
        if h.num_key_value_heads != h.num_attention_heads:
            raise RemodelError(f"{self.name}'s latent attention needs num_key_value_heads == num_attention_heads, got "
                               f"{h.num_key_value_heads} and {h.num_attention_heads}")
        mixers, ffns = _types(h, "layer_types", BLOCK_TYPES), _types(h, "mlp_layer_types", MLP_TYPES)
        return ModelConfig(
            vocab_size=h.vocab_size, hidden_size=h.hidden_size, norm_eps=h.rms_norm_eps,
            tie_word_embeddings=bool(h.tie_word_embeddings), extra=extra,
            pattern="".join(a + m for a, m in zip(mixers, ffns)),
            mlp=dict(intermediate_size=h.intermediate_size, mlp_act="silu", mlp_gated=True),
            moe=dict(n_routed_experts=h.num_local_experts, num_experts_per_tok=h.num_experts_per_tok,
                     moe_intermediate_size=h.moe_intermediate_size,
                     moe_shared_expert_intermediate_size=h.n_shared_experts * h.moe_intermediate_size,
                     router="sigmoid", norm_topk_prob=bool(h.norm_topk_prob),
                     routed_scaling_factor=float(h.routed_scaling_factor), n_group=h.n_group, topk_group=h.topk_group),
            mla=dict(mla_num_heads=h.num_attention_heads, q_lora_rank=h.q_lora_rank, kv_lora_rank=h.kv_lora_rank,
                     qk_nope_head_dim=h.qk_nope_head_dim, qk_rope_head_dim=h.qk_rope_head_dim, v_head_dim=h.v_head_dim,
                     mla_rope=False, mla_bias=bool(getattr(h, "attention_bias", False))),
            kda=dict(kda_num_heads=h.linear_num_heads, kda_head_dim=h.linear_head_dim,
                     kda_conv_kernel=h.linear_conv_kernel_dim))

    def check(self, cfg, need):
        need(not cfg.mtp_layers, "MTP layers are nemotron_h only")
        mixers, ffns = cfg.pattern[0::2], cfg.pattern[1::2]
        other = sorted(set(mixers) - set(BLOCK_TYPES.values()) - {"-", "E"})
        need(not other, "its mixers are KDA and multi-head latent attention only: no place for the "
             f"{', '.join(kind(c).name for c in other)} layers (a kept grouped-query attention layer is not latent "
             "attention: replace every one)")
        need(cfg.num_layers % 2 == 0 and set(mixers) <= set(BLOCK_TYPES.values()) and set(ffns) <= {"-", "E"},
             f"needs (KDA 'K' or MLA 'L') + (MLP '-' or MoE 'E') layer pairs, got {cfg.pattern!r}")
        if "L" in mixers:
            need(not cfg.mla.mla_rope, f"{self.name}'s latent attention has no RoPE (mla_rope False)")
        if "K" in mixers:
            need(cfg.kda.kda_norm_eps in (None, cfg.norm_eps), "the KDA output norm's eps is rms_norm_eps")
        self.check_ffn(cfg, need)

    def to_hf(self, cfg):
        m, a, k = cfg.moe, cfg.mla, cfg.kda
        shared = m.moe_shared_expert_intermediate_size or m.moe_intermediate_size
        heads = a.mla_num_heads if "L" in cfg.pattern else 1
        return dict(num_hidden_layers=cfg.num_layers // 2, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
                    layer_types=[next(t for t, c in BLOCK_TYPES.items() if c == x) for x in cfg.pattern[0::2]],
                    mlp_layer_types=[next(t for t, c in MLP_TYPES.items() if c == x) for x in cfg.pattern[1::2]],
                    intermediate_size=cfg.mlp.intermediate_size or 1, num_local_experts=m.n_routed_experts or 1,
                    num_experts_per_tok=m.num_experts_per_tok or 1, moe_intermediate_size=m.moe_intermediate_size or 1,
                    n_shared_experts=shared // (m.moe_intermediate_size or 1) or 1, norm_topk_prob=m.norm_topk_prob,
                    routed_scaling_factor=m.routed_scaling_factor, n_group=m.n_group, topk_group=m.topk_group,
                    num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=a.q_lora_rank,
                    kv_lora_rank=a.kv_lora_rank or 1, qk_nope_head_dim=a.qk_nope_head_dim,
                    qk_rope_head_dim=a.qk_rope_head_dim or 1, v_head_dim=a.v_head_dim or 1, attention_bias=a.mla_bias,
                    linear_num_heads=k.kda_num_heads or 1, linear_head_dim=k.kda_head_dim or 1,
                    linear_conv_kernel_dim=k.kda_conv_kernel)

    def key_map(self):
        out = {**key_map(self.attn, _FFN), **key_map(self.attn, _FFN, "gate", _EXPERTS)}
        hf_m = f"model.layers.{{m}}.{_FFN}."
        out["layers.{m}.mixer.gate.e_score_correction_bias"] = hf_m + "gate.e_score_correction_bias"
        out.update({f"layers.{{m}}.mixer.shared_experts.{p}.weight": f"{hf_m}shared_experts.{p}.weight" for p in _SWIGLU})
        return out

    def other_spelling(self, hf_name):
        """The released checkpoints keep a dense layer's MLP under `mlp.` (transformers writes `block_sparse_moe.`
        and reads both)."""
        for p in _SWIGLU:
            if hf_name.endswith(f".{_FFN}.{p}.weight"):
                return hf_name.replace(f".{_FFN}.", ".mlp.")
        return None

    def holds_pattern(self, cfg) -> bool:
        mixers, ffns = cfg.pattern[0::2], cfg.pattern[1::2]
        return (cfg.num_layers % 2 == 0 and "K" in mixers and set(mixers) <= set(BLOCK_TYPES.values())
                and set(ffns) <= {"-", "E"})

    def claims(self, cfg):
        """KDA (+ MLA) + (MLP or MoE) decoder layers: no other family holds the KDA kind."""
        return self.holds_pattern(cfg)


_TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=4,
             kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, moe_intermediate_size=16,
             num_local_experts=8, num_experts_per_tok=2, linear_num_heads=3, linear_head_dim=8,
             linear_conv_kernel_dim=3, pad_token_id=0, bos_token_id=1, eos_token_id=2)
KIMI_LINEAR = KimiLinear(
    "kimi_linear", "KimiLinearForCausalLM", padding_idx=True, width_rules=(SHARED_FROM_EXPERT,), block_types=BLOCK_TYPES,
    ties_head=False,  # transformers' KimiLinearForCausalLM never ties (its _tied_weights_keys is {})
    tiny={"kda_mla_moe": dict(_TINY, num_hidden_layers=4, n_shared_experts=2, linear_num_heads=4, q_lora_rank=None, n_group=2,
                              topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                              layer_types=["linear_attention", "linear_attention", "full_attention",
                                           "linear_attention"],
                              mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
          "q_lora_dense_last": dict(_TINY, num_hidden_layers=2, n_shared_experts=1, q_lora_rank=10, n_group=1,
                                      topk_group=1, norm_topk_prob=False, linear_conv_kernel_dim=4,
                                      layer_types=["full_attention", "linear_attention"],
                                      mlp_layer_types=["sparse", "dense"])})

REGISTER = (KIMI_LINEAR,)  # the families this module adds to models.families.FAMILIES, in order
