"""MiniMax-M2 (transformers' `minimax_m2`): decoder layer j is our pair 2j (attention) and 2j+1 (MoE). The
attention is grouped-query with RMSNorms over the whole q and k projections (qk_norm_full: they shrink with the
heads), RoPE on the first partial_rotary_factor of each head (the released `rotary_dim`), no bias; every
feed-forward is MoE: sigmoid scores, selection on score + e_score_correction_bias, the kept weights always
renormalised, no expert groups, no routed scaling, no shared expert; experts w1 (gate) / w3 (up) / w2 (down)
under `block_sparse_moe` as stored."""
from __future__ import annotations

from dataclasses import dataclass

from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError

from .family import Family, gqa_attention, gqa_to_hf
from .llama import SPARSE, TINY, LlamaFamily, key_map

_ATTN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_norm.weight", "k_norm.weight")
_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


@dataclass(frozen=True)
class MiniMaxM2(LlamaFamily):
    attn: tuple = _ATTN
    layer: str = SPARSE
    moe: bool = True
    routers: tuple = ("sigmoid",)
    variants: tuple = ("qk_norm_full",)
    upcycle_help: str = "none (already MoE)"

    def required(self, h):
        return [("num_hidden_layers",), ("num_attention_heads",), ("num_local_experts",), ("num_experts_per_tok",),
                ("intermediate_size",)]

    def from_hf(self, h, extra):
        if getattr(h, "hidden_act", "silu") != "silu":
            raise RemodelError(f"unsupported hidden_act {h.hidden_act!r} for minimax_m2 (only silu)")
        return ModelConfig(
            vocab_size=h.vocab_size, hidden_size=h.hidden_size, pattern=SPARSE * h.num_hidden_layers,
            norm_eps=h.rms_norm_eps, tie_word_embeddings=bool(h.tie_word_embeddings), extra=extra,
            attention=gqa_attention(h, self.name, qk_norm_full=True),
            mlp=dict(mlp_act="silu", mlp_gated=True),
            moe=dict(n_routed_experts=h.num_local_experts, num_experts_per_tok=h.num_experts_per_tok,
                     moe_intermediate_size=h.intermediate_size, router="sigmoid", norm_topk_prob=True))

    def check(self, cfg, need):
        need(not cfg.mtp_layers, "MTP layers are nemotron_h only")
        need(cfg.num_layers % 2 == 0 and cfg.pattern == SPARSE * (cfg.num_layers // 2),
             f"needs the layer pattern {SPARSE!r} * N, got {cfg.pattern!r}")
        a, m = cfg.attention, cfg.moe
        need(a.rope_theta is not None and a.sliding_window is None, "needs RoPE attention without a sliding window")
        need(a.qk_norm_full and not a.qk_norm, "minimax_m2 normalises the whole q and k projections")
        need(not (a.attention_bias or a.attention_out_bias), "minimax_m2 attention has no bias")
        need(cfg.mlp.mlp_gated and cfg.mlp.mlp_act == "silu" and not cfg.mlp.mlp_bias, "needs SwiGLU experts without bias")
        need(m.router == "sigmoid" and m.norm_topk_prob and m.routed_scaling_factor == 1 and m.n_group == 1,
             "minimax_m2 routes by sigmoid with renormalised top-k weights, no groups and no routed scaling")
        need(not m.moe_shared_expert_intermediate_size and m.moe_latent_size is None,
             "minimax_m2 has no shared expert and no latent")

    def to_hf(self, cfg):
        a, m = cfg.attention, cfg.moe
        return dict(num_hidden_layers=cfg.num_layers // 2, rms_norm_eps=cfg.norm_eps, hidden_act="silu", **gqa_to_hf(a),
                    rotary_dim=round(a.head_dim * a.partial_rotary_factor),  # the released configs' spelling
                    num_local_experts=m.n_routed_experts, num_experts_per_tok=m.num_experts_per_tok,
                    intermediate_size=m.moe_intermediate_size)

    def key_map(self):
        out = key_map(self.attn, "block_sparse_moe", "gate", _EXPERTS)
        out["layers.{m}.mixer.gate.e_score_correction_bias"] = "model.layers.{m}.block_sparse_moe.e_score_correction_bias"
        return out

    def claims(self, cfg):
        """Sigmoid-routed MoE under attention that normalises whole q and k projections."""
        return (cfg.attention.qk_norm_full and cfg.moe.router == "sigmoid" and not cfg.moe.moe_shared_expert_intermediate_size
                and cfg.num_layers % 2 == 0 and cfg.pattern == SPARSE * (cfg.num_layers // 2))

    def upcycle_into(self, cfg, router, shared):
        return Family.upcycle_into(self, cfg, router, shared)  # already MoE: --to names a target


_TINY = {**{k: v for k, v in TINY.items() if k != "intermediate_size"}, "intermediate_size": 16,
         "num_local_experts": 6, "num_experts_per_tok": 2, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2}
MINIMAX_M2 = MiniMaxM2("minimax_m2", "MiniMaxM2ForCausalLM", padding_idx=True,
                       tiny={"plain": dict(_TINY, rotary_dim=4),
                             "tied_full_rope": dict(_TINY, tie_word_embeddings=True,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                                     "partial_rotary_factor": 1.0})})

REGISTER = (MINIMAX_M2,)  # the families this module adds to models.families.FAMILIES, in order
