"""GLM-4.5 / 4.6 / 4.7 (transformers' `glm4_moe`): decoder layer j is our pair 2j (attention) and 2j+1 (its
feed-forward); the first `first_k_dense_replace` feed-forwards are dense SwiGLU MLPs, the rest DeepSeek-routed
MoE (sigmoid scores, selection on score + e_score_correction_bias within the top `topk_group` of `n_group`
expert groups, optional renormalisation, routed_scaling_factor) plus `n_shared_experts` shared experts fused
into one of n_shared_experts * moe_intermediate_size. Attention: grouped-query, RoPE on the first
partial_rotary_factor of each head, optional per-head q/k RMSNorm (use_qk_norm), q/k/v bias (attention_bias)
and never an o_proj bias. The checkpoints' MTP layer (model.layers.{num_hidden_layers}) is not read, as
transformers does not read it."""
from __future__ import annotations

from dataclasses import dataclass

from remodel.models.config import MAX_LAYERS, ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.kinds import routed

from .family import Family, gqa_attention, gqa_to_hf
from .llama import QWEN3_ATTN, TINY, LlamaFamily, key_map
from .width_rules import SHARED_FROM_EXPERT

_ATTN = tuple(t for t in QWEN3_ATTN if t != "o_proj.bias")  # q/k/v bias, q/k norm, never an o_proj bias
_SWIGLU = {p: p for p in ("gate_proj", "up_proj", "down_proj")}


def _pattern(layers: int, dense: int) -> str:
    return "*-" * dense + "*E" * (layers - dense)


@dataclass(frozen=True)
class Glm4Moe(LlamaFamily):
    attn: tuple = _ATTN
    qkv_bias: str = "attention_bias"
    moe: bool = True
    routers: tuple = ("sigmoid", "sigmoid-raw")
    upcycle_help: str = "none (already MoE)"

    def required(self, h):
        return [("num_hidden_layers",), ("num_attention_heads",), ("n_routed_experts",), ("num_experts_per_tok",),
                ("moe_intermediate_size",)]

    def from_hf(self, h, extra):
        if getattr(h, "hidden_act", "silu") != "silu":
            raise RemodelError(f"unsupported hidden_act {h.hidden_act!r} for glm4_moe (only silu)")
        if not h.n_shared_experts:
            raise RemodelError("glm4_moe with n_shared_experts=0 is not supported (every GLM MoE has shared experts)")
        L = h.num_hidden_layers
        return ModelConfig(
            vocab_size=h.vocab_size, hidden_size=h.hidden_size, pattern=_pattern(L, min(h.first_k_dense_replace, L)),
            norm_eps=h.rms_norm_eps, tie_word_embeddings=bool(h.tie_word_embeddings), extra=extra,
            attention=gqa_attention(h, self.name, attention_bias=bool(h.attention_bias), qk_norm=bool(h.use_qk_norm)),
            mlp=dict(intermediate_size=h.intermediate_size, mlp_act="silu", mlp_gated=True),
            moe=dict(n_routed_experts=h.n_routed_experts, num_experts_per_tok=h.num_experts_per_tok,
                     moe_intermediate_size=h.moe_intermediate_size,
                     moe_shared_expert_intermediate_size=h.n_shared_experts * h.moe_intermediate_size,
                     router="sigmoid", norm_topk_prob=bool(h.norm_topk_prob),
                     routed_scaling_factor=float(h.routed_scaling_factor), n_group=h.n_group, topk_group=h.topk_group))

    def check(self, cfg, need):
        need(not cfg.mtp_layers, "MTP layers are nemotron_h only")
        L, k = cfg.num_layers // 2, self.dense_layers(cfg)
        need(cfg.num_layers % 2 == 0 and cfg.pattern == _pattern(L, k),
             f"needs dense layers '*-' then MoE layers '*E' (first_k_dense_replace), got {cfg.pattern!r}")
        a, m = cfg.attention, cfg.moe
        need(a.rope_theta is not None and a.sliding_window is None, "needs RoPE attention without a sliding window")
        need(not a.attention_out_bias, "glm4_moe has q/k/v bias and no o_proj bias")
        need(cfg.mlp.mlp_gated and cfg.mlp.mlp_act == "silu" and not cfg.mlp.mlp_bias, "needs SwiGLU MLPs without bias")
        if routed(cfg):
            need(m.router == "sigmoid" and not m.shared_expert_gate and m.moe_latent_size is None,
                 "glm4_moe MoE uses the sigmoid router, no shared-expert gate and no latent")
            s = m.moe_shared_expert_intermediate_size or 0
            need(s > 0 and s % m.moe_intermediate_size == 0,
                 f"the shared experts ({s}) must be n_shared_experts >= 1 times moe_intermediate_size "
                 f"({m.moe_intermediate_size})")

    @staticmethod
    def dense_layers(cfg) -> int:
        """first_k_dense_replace: the decoder layers before the first MoE one."""
        first = cfg.pattern.find("E")
        return cfg.num_layers // 2 if first < 0 else first // 2

    def to_hf(self, cfg):
        a, m = cfg.attention, cfg.moe
        shared = m.moe_shared_expert_intermediate_size or m.moe_intermediate_size
        return dict(num_hidden_layers=cfg.num_layers // 2, first_k_dense_replace=self.dense_layers(cfg),
                    rms_norm_eps=cfg.norm_eps, hidden_act="silu", **gqa_to_hf(a),
                    attention_bias=a.attention_bias, use_qk_norm=a.qk_norm,
                    intermediate_size=cfg.mlp.intermediate_size or 1,
                    n_routed_experts=m.n_routed_experts or 1, num_experts_per_tok=m.num_experts_per_tok,
                    moe_intermediate_size=m.moe_intermediate_size or 1, n_shared_experts=shared // (m.moe_intermediate_size or 1),
                    norm_topk_prob=m.norm_topk_prob, routed_scaling_factor=m.routed_scaling_factor,
                    n_group=m.n_group, topk_group=m.topk_group, num_nextn_predict_layers=0)  # no MTP weights written

    def key_map(self):
        out = {**key_map(self.attn, "mlp"), **key_map(self.attn, "mlp", "gate", _SWIGLU)}
        hf_m = "model.layers.{m}.mlp."
        out["layers.{m}.mixer.gate.e_score_correction_bias"] = hf_m + "gate.e_score_correction_bias"
        out.update({f"layers.{{m}}.mixer.shared_experts.{p}.weight": f"{hf_m}shared_experts.{p}.weight" for p in _SWIGLU})
        return out

    def claims(self, cfg):
        """Sigmoid-routed Llama-shaped MoE with partial RoPE (full RoPE stays nemotron_h's default, as before)."""
        a, L = cfg.attention, cfg.num_layers // 2
        return (routed(cfg) and cfg.moe.router == "sigmoid" and cfg.mlp.mlp_gated and a.rope_theta is not None
                and a.partial_rotary_factor < 1 and cfg.num_layers % 2 == 0 and cfg.pattern == _pattern(L, self.dense_layers(cfg)))

    def upcycle_into(self, cfg, router, shared):
        return Family.upcycle_into(self, cfg, router, shared)  # already MoE: --to names a target

    def upcycle_check(self, cfg, router):
        if router not in self.routers:
            return f"glm4_moe routers are sigmoid (DeepSeek-style): use --router sigmoid or sigmoid-raw, not {router}"
        return None


_TINY = {**{k: v for k, v in TINY.items() if k != "num_hidden_layers"}, "moe_intermediate_size": 16,
         "n_routed_experts": 8, "num_experts_per_tok": 2}
GLM4_MOE = Glm4Moe("glm4_moe", "Glm4MoeForCausalLM", padding_idx=True, width_rules=(SHARED_FROM_EXPERT,),
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
