"""DeepSeek-V3 / V3.1 and Kimi-K2 (transformers' `deepseek_v3`): decoder layer j is our pair 2j (multi-head latent
attention, the 'L' kind) and 2j+1 (its feed-forward); the first `first_k_dense_replace` feed-forwards are dense
SwiGLU MLPs, the rest DeepSeek-routed MoE (sigmoid scores, selection on score + e_score_correction_bias within the
top `topk_group` of `n_group` expert groups, optional renormalisation, routed_scaling_factor) plus `n_shared_experts`
shared experts fused into one of n_shared_experts * moe_intermediate_size. RoPE: the default type or YaRN (its
mscale_all_dim on the softmax scale, as transformers applies it). The checkpoints' MTP layer (model.layers.{num_hidden_layers}) is not read, as
transformers does not read it."""
from __future__ import annotations

from dataclasses import dataclass

from remodel.models.config import MAX_LAYERS, ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.kinds import routed
from remodel.models.mla import MLA

from .family import Family, read_rope
from .llama import LlamaFamily, key_map
from .width_rules import SHARED_FROM_EXPERT

_MLA = tuple(p.leaf for p in MLA.params)
_SWIGLU = {p: p for p in ("gate_proj", "up_proj", "down_proj")}


def mla_pattern(layers: int, dense: int) -> str:
    """first_k_dense_replace MLA + MLP pairs, then MLA + MoE pairs."""
    return "L-" * dense + "LE" * (layers - dense)


@dataclass(frozen=True)
class DeepseekV3(LlamaFamily):
    attn: tuple = _MLA
    moe: bool = True
    routers: tuple = ("sigmoid", "sigmoid-raw")
    upcycle_help: str = "none (already MoE)"

    def required(self, h):
        return [("num_hidden_layers",), ("num_attention_heads",), ("n_routed_experts",), ("num_experts_per_tok",),
                ("moe_intermediate_size",), ("kv_lora_rank",), ("qk_rope_head_dim",), ("v_head_dim",),
                ("qk_nope_head_dim",)]

    def from_hf(self, h, extra):
        if getattr(h, "hidden_act", "silu") != "silu":
            raise RemodelError(f"unsupported hidden_act {h.hidden_act!r} for {self.name} (only silu)")
        if not h.n_shared_experts:
            raise RemodelError(f"{self.name} with n_shared_experts=0 is not supported")
        theta, rp, _ = read_rope(h, self.name, types=("default", "yarn"))
        L = h.num_hidden_layers
        return ModelConfig(
            vocab_size=h.vocab_size, hidden_size=h.hidden_size, pattern=mla_pattern(L, min(h.first_k_dense_replace, L)),
            norm_eps=h.rms_norm_eps, tie_word_embeddings=bool(h.tie_word_embeddings), extra=extra,
            mla=dict(mla_num_heads=h.num_attention_heads, q_lora_rank=h.q_lora_rank, kv_lora_rank=h.kv_lora_rank,
                     qk_nope_head_dim=h.qk_nope_head_dim, qk_rope_head_dim=h.qk_rope_head_dim, v_head_dim=h.v_head_dim,
                     mla_rope_theta=theta, mla_rope_scaling=rp if rp.get("rope_type") == "yarn" else None,
                     rope_interleave=bool(getattr(h, "rope_interleave", True)),
                     mla_bias=bool(getattr(h, "attention_bias", False))),
            mlp=dict(intermediate_size=h.intermediate_size, mlp_act="silu", mlp_gated=True),
            moe=dict(n_routed_experts=h.n_routed_experts, num_experts_per_tok=h.num_experts_per_tok,
                     moe_intermediate_size=h.moe_intermediate_size,
                     moe_shared_expert_intermediate_size=h.n_shared_experts * h.moe_intermediate_size,
                     router="sigmoid", norm_topk_prob=bool(h.norm_topk_prob),
                     routed_scaling_factor=float(h.routed_scaling_factor), n_group=h.n_group, topk_group=h.topk_group))

    def check(self, cfg, need):
        need(not cfg.mtp_layers, "MTP layers are nemotron_h only")
        L, k = cfg.num_layers // 2, self.dense_layers(cfg)
        need(cfg.num_layers % 2 == 0 and cfg.pattern == mla_pattern(L, k),
             f"needs dense layers 'L-' then MoE layers 'LE' (first_k_dense_replace), got {cfg.pattern!r}")
        need(cfg.mlp.mlp_gated and cfg.mlp.mlp_act == "silu" and not cfg.mlp.mlp_bias, "needs SwiGLU MLPs without bias")
        if routed(cfg):
            m = cfg.moe
            need(m.router == "sigmoid" and not m.shared_expert_gate and m.moe_latent_size is None,
                 f"{self.name} MoE uses the sigmoid router, no shared-expert gate and no latent")
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
        c, m = cfg.mla, cfg.moe
        shared = m.moe_shared_expert_intermediate_size or m.moe_intermediate_size
        return dict(num_hidden_layers=cfg.num_layers // 2, first_k_dense_replace=self.dense_layers(cfg),
                    rms_norm_eps=cfg.norm_eps, num_attention_heads=c.mla_num_heads, num_key_value_heads=c.mla_num_heads,
                    q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                    qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, hidden_act="silu",
                    rope_parameters=dict(c.mla_rope_scaling or {"rope_theta": c.mla_rope_theta, "rope_type": "default"}),
                    rope_interleave=c.rope_interleave, attention_bias=c.mla_bias,
                    intermediate_size=cfg.mlp.intermediate_size or 1,
                    n_routed_experts=m.n_routed_experts or 1, num_experts_per_tok=m.num_experts_per_tok,
                    moe_intermediate_size=m.moe_intermediate_size or 1,
                    n_shared_experts=shared // (m.moe_intermediate_size or 1),
                    norm_topk_prob=m.norm_topk_prob, routed_scaling_factor=m.routed_scaling_factor,
                    n_group=m.n_group, topk_group=m.topk_group)

    def key_map(self):
        out = {**key_map(self.attn, "mlp"), **key_map(self.attn, "mlp", "gate", _SWIGLU)}
        hf_m = "model.layers.{m}.mlp."
        out["layers.{m}.mixer.gate.e_score_correction_bias"] = hf_m + "gate.e_score_correction_bias"
        out.update({f"layers.{{m}}.mixer.shared_experts.{p}.weight": f"{hf_m}shared_experts.{p}.weight" for p in _SWIGLU})
        return out

    def claims(self, cfg):
        """MLA + (dense then sigmoid-routed MoE) decoder layers: no other family holds the MLA kind."""
        L = cfg.num_layers // 2
        return cfg.num_layers % 2 == 0 and cfg.pattern == mla_pattern(L, self.dense_layers(cfg))

    def upcycle_into(self, cfg, router, shared):
        return Family.upcycle_into(self, cfg, router, shared)  # already MoE: --to names a target

    def upcycle_check(self, cfg, router):
        if router not in self.routers:
            return f"{self.name} routers are sigmoid (DeepSeek-style): use --router sigmoid or sigmoid-raw, not {router}"
        return None


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
