"""Liquid AI's LFM2-MoE (transformers' `lfm2_moe`, Lfm2MoeForCausalLM; LFM2-8B-A1B): LFM2's decoder layers
(models/families/lfm2.py: a short convolution 'C' or attention '*', then the feed-forward) whose first
`num_dense_layers` feed-forwards are SwiGLU MLPs '-' (intermediate_size, no auto-adjust) and the rest MoE 'E':
sigmoid scores, selection on score + expert_bias, the kept weights renormalised with eps 1e-6 (the MoE kind's
topk_norm_eps variant), routed_scaling_factor; experts w1 / w3 / w2 as stored."""
from __future__ import annotations

from dataclasses import dataclass

from remodel.models.config import MAX_LAYERS, ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.kinds import routed

from .family import Family
from .lfm2 import BLOCK_TYPES, LFM2, Lfm2

_FFN = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
NORM_EPS = 1e-6  # Lfm2MoeTopKRouter: weights / (sum + 1e-6)


@dataclass(frozen=True)
class Lfm2Moe(Lfm2):
    moe: bool = True
    routers: tuple = ("sigmoid", "sigmoid-raw")
    variants: tuple = ("topk_norm_eps",)
    upcycle_help: str = "none (already MoE)"

    def required(self, h):
        return super().required(h) + [("num_experts",), ("num_experts_per_tok",), ("moe_intermediate_size",)]

    def from_hf(self, h, extra):
        if not getattr(h, "use_expert_bias", True):
            raise RemodelError("lfm2_moe with use_expert_bias=false is not supported (LFM2-MoE routes with it)")
        k = min(h.num_dense_layers, h.num_hidden_layers)
        base = super().from_hf(h, extra, ffn=h.intermediate_size)
        return base.replace(pattern="".join(m + ("-" if j < k else "E") for j, m in enumerate(base.pattern[0::2])),
                            moe=dict(n_routed_experts=h.num_experts, num_experts_per_tok=h.num_experts_per_tok,
                                     moe_intermediate_size=h.moe_intermediate_size, router="sigmoid",
                                     norm_topk_prob=bool(h.norm_topk_prob), topk_norm_eps=NORM_EPS,
                                     routed_scaling_factor=float(h.routed_scaling_factor)))

    def ffn_layers(self, cfg) -> tuple:
        return ("-", "E")

    def check(self, cfg, need):
        super().check(cfg, need)
        ffn = cfg.pattern[1::2]
        need(ffn == "-" * ffn.count("-") + "E" * ffn.count("E"), f"{self.name} has its dense MLP layers first")
        if routed(cfg):
            m = cfg.moe
            need(m.router == "sigmoid" and m.n_group == 1 and not m.moe_shared_expert_intermediate_size
                 and m.moe_latent_size is None and not m.shared_expert_gate,
                 f"{self.name} routes by sigmoid with an expert bias, no groups, no shared expert")
            need(m.topk_norm_eps == NORM_EPS, f"{self.name} renormalises the top-k weights with eps {NORM_EPS}")

    def to_hf(self, cfg):
        m = cfg.moe
        d = {k: v for k, v in super().to_hf(cfg).items() if k != "block_auto_adjust_ff_dim"}  # no such field here
        return {**d, "intermediate_size": cfg.mlp.intermediate_size or 1, "num_dense_layers": cfg.pattern[1::2].count("-"),
                "num_experts": m.n_routed_experts or 1, "num_experts_per_tok": m.num_experts_per_tok or 1,
                "moe_intermediate_size": m.moe_intermediate_size or 1, "use_expert_bias": True,
                "norm_topk_prob": m.norm_topk_prob, "routed_scaling_factor": m.routed_scaling_factor}

    def key_map(self):
        out = super().key_map()
        hf_m = "model.layers.{m}.feed_forward."
        out.update({"layers.{m}.mixer.gate.weight": hf_m + "gate.weight",
                    "layers.{m}.mixer.gate.e_score_correction_bias": hf_m + "expert_bias"})
        out.update({f"layers.{{m}}.mixer.experts.{p}": f"{hf_m}experts.{{e}}.{w}.weight" for p, w in _FFN.items()})
        return out

    def upcycle_into(self, cfg, router, shared):
        return Family.upcycle_into(self, cfg, router, shared)  # already MoE: --to names a target

    def upcycle_router(self):
        return Family.upcycle_router(self)  # (as a source: already MoE)

    def upcycled(self, cfg):
        return cfg.replace(**{"moe.topk_norm_eps": NORM_EPS})


_TINY = {**LFM2.tiny["plain"], "moe_intermediate_size": 16, "num_experts": 6, "num_experts_per_tok": 2}
_TINY.pop("block_auto_adjust_ff_dim")
LFM2_MOE = Lfm2Moe("lfm2_moe", "Lfm2MoeForCausalLM", depth=2, block_types=BLOCK_TYPES, padding_idx=True,
                   raw={"num_dense_layers": (0, MAX_LAYERS)},
                   tiny={"plain": dict(_TINY, num_dense_layers=1, routed_scaling_factor=2.0),
                         "all_moe_unnormalised": dict(_TINY, num_dense_layers=0, norm_topk_prob=False, conv_bias=True,
                                                      tie_word_embeddings=False,
                                                      layer_types=["full_attention", "conv", "conv", "full_attention"])})

REGISTER = (LFM2_MOE,)  # the families this module adds to models.families.FAMILIES, in order
