"""NVIDIA Nemotron-H / Nemotron 3 (transformers' `nemotron_h`): one HF layer per pattern character, no
RoPE, squared-ReLU MLPs and experts, the sigmoid router, LatentMoE and MTP layers."""
from __future__ import annotations

from remodel.models.attention import ATTENTION
from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.kinds import KINDS, layer_kinds, routed, used
from remodel.models.layout import BLOCK_NORM, MTP_FIRST, MTP_LAST

from .family import Family, time_step_limit

BLOCK_TYPES = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}  # HF layer type -> ours
_TYPE = {v: k for k, v in BLOCK_TYPES.items()}
# Fields that set the shapes, per layer type present (transformers would fill in defaults); alternatives in a tuple
_NEED = {"linear_attention": (("mamba_num_heads",), ("mamba_head_dim",)), "full_attention": (("num_attention_heads",),),
         "mlp": (("intermediate_size",),), "moe": (("n_routed_experts",), ("moe_intermediate_size",),
                                                   ("num_experts_per_tok",))}


class NemotronH(Family):
    def required(self, h):
        need = [("layers_block_type", "hybrid_override_pattern")]
        for t in dict.fromkeys(h.layers_block_type):
            need += _NEED.get(t, ())
        return need

    def from_hf(self, h, extra):
        if getattr(h, "mamba_hidden_act", "silu") != "silu":
            raise RemodelError(f"unsupported mamba_hidden_act {h.mamba_hidden_act!r} (only silu)")
        mtp = int(getattr(h, "num_nextn_predict_layers", 0) or 0)
        if getattr(h, "num_nextn_predict_layers_dropped", 0):  # declared, but the checkpoint has no mtp.*
            extra["num_nextn_predict_layers_dropped"] = h.num_nextn_predict_layers_dropped
        mtp_pattern = "".join(BLOCK_TYPES[t] for t in h.mtp_layers_block_type) if mtp else ""
        lo, hi = time_step_limit(h)  # dt's clamp (transformers >= 5.25; time_step_min/max only initialise dt_bias)
        if h.mlp_bias and "moe" in h.layers_block_type:
            raise RemodelError("nemotron_h with mlp_bias=true and MoE layers is not supported (biased experts)")
        shared = h.moe_shared_expert_intermediate_size or h.intermediate_size  # transformers' fallback
        return ModelConfig(
            vocab_size=h.vocab_size, hidden_size=h.hidden_size,
            pattern="".join(BLOCK_TYPES[t] for t in h.layers_block_type), norm_eps=h.layer_norm_epsilon,
            tie_word_embeddings=bool(h.tie_word_embeddings),
            num_attention_heads=h.num_attention_heads, num_key_value_heads=h.num_key_value_heads,
            head_dim=h.head_dim, rope_theta=None,
            intermediate_size=h.intermediate_size, mlp_act=h.mlp_hidden_act, mlp_gated=False, mlp_bias=h.mlp_bias,
            mamba_num_heads=h.mamba_num_heads, mamba_head_dim=h.mamba_head_dim, n_groups=h.n_groups,
            **{"mamba.d_state": h.ssm_state_size}, conv_kernel=h.conv_kernel, chunk_size=h.chunk_size,
            use_conv_bias=h.use_conv_bias, mamba_proj_bias=h.use_bias, time_step_min=lo, time_step_max=hi,
            n_routed_experts=h.n_routed_experts, num_experts_per_tok=h.num_experts_per_tok,
            moe_intermediate_size=h.moe_intermediate_size, moe_shared_expert_intermediate_size=shared,
            moe_latent_size=h.moe_latent_size, router="sigmoid", norm_topk_prob=h.norm_topk_prob,
            routed_scaling_factor=float(h.routed_scaling_factor), n_group=h.n_group, topk_group=h.topk_group,
            mtp_layers=mtp, mtp_pattern=mtp_pattern, extra=extra)

    def check(self, cfg, need):
        odd = sorted(set(cfg.pattern + cfg.mtp_pattern) - set(_TYPE))
        need(not odd, f"nemotron_h has no layers of kind {', '.join(odd)} (it holds {' '.join(_TYPE)})")
        need(cfg.attention.rope_theta is None or ATTENTION not in used(cfg), "nemotron_h attention has no RoPE")
        need(not (cfg.attention.attention_bias or cfg.attention.attention_out_bias or cfg.attention.qk_norm), "nemotron_h attention has no bias or q/k norm")
        need(not cfg.mlp.mlp_gated, "nemotron_h MLPs and experts are not gated (SwiGLU models go to llama/mixtral/qwen)")
        need(cfg.attention.sliding_window is None, "nemotron_h has no sliding-window attention")
        need(not (cfg.mlp.mlp_bias and routed(cfg)), "nemotron_h MoE layers with MLP bias are not supported")
        need(not routed(cfg) or (cfg.moe.router == "sigmoid" and not cfg.moe.shared_expert_gate),
             "nemotron_h MoE uses the sigmoid router without a shared-expert gate")

    def to_hf(self, cfg):
        d = dict(layers_block_type=[_TYPE[c] for c in cfg.pattern], layer_norm_epsilon=cfg.norm_eps,
                 num_attention_heads=cfg.attention.num_attention_heads or 1, num_key_value_heads=cfg.attention.num_key_value_heads or 1,
                 head_dim=cfg.attention.head_dim or 1, intermediate_size=cfg.mlp.intermediate_size or 1,
                 mlp_hidden_act=cfg.mlp.mlp_act, mlp_bias=cfg.mlp.mlp_bias,
                 mamba_num_heads=cfg.mamba.mamba_num_heads or 1, mamba_head_dim=cfg.mamba.mamba_head_dim or 1,
                 n_groups=cfg.mamba.n_groups, ssm_state_size=cfg.mamba.d_state or 1, conv_kernel=cfg.mamba.conv_kernel,
                 chunk_size=cfg.mamba.chunk_size, use_conv_bias=cfg.mamba.use_conv_bias, use_bias=cfg.mamba.mamba_proj_bias,
                 time_step_limit=[float(cfg.mamba.time_step_min), float(cfg.mamba.time_step_max)])
        if routed(cfg):
            d.update(n_routed_experts=cfg.moe.n_routed_experts, num_experts_per_tok=cfg.moe.num_experts_per_tok,
                     moe_intermediate_size=cfg.moe.moe_intermediate_size,
                     moe_shared_expert_intermediate_size=cfg.moe.moe_shared_expert_intermediate_size or 1,
                     moe_latent_size=cfg.moe.moe_latent_size, norm_topk_prob=cfg.moe.norm_topk_prob,
                     routed_scaling_factor=cfg.moe.routed_scaling_factor, n_group=cfg.moe.n_group, topk_group=cfg.moe.topk_group)
        if cfg.mtp_layers:
            d.update(num_nextn_predict_layers=cfg.mtp_layers, mtp_layers_block_type=[_TYPE[c] for c in cfg.mtp_pattern])
        return d

    def key_map(self):
        """Our names are Nemotron-H's: `backbone.` in front of the trunk; MTP tensors unprefixed, as vLLM
        reads them; routed experts split per expert. Every layer parameter of every kind."""
        leaves = [BLOCK_NORM.leaf] + ["mixer." + p.leaf for k in KINDS.values() for p in k.params]
        out = {"embeddings.weight": "backbone.embeddings.weight", "norm_f.weight": "backbone.norm_f.weight",
               "lm_head.weight": "lm_head.weight"}
        for top, hf_top in (("layers.{i}.", "backbone.layers.{i}."), ("mtp.layers.{i}.", "mtp.layers.{i}.")):
            for leaf in dict.fromkeys(leaves):
                if leaf.startswith("mixer.experts."):
                    out[top + leaf] = f"{hf_top}mixer.experts.{{e}}.{leaf.rsplit('.', 1)[1]}.weight"
                else:
                    out[top + leaf] = hf_top + leaf
        for p in MTP_FIRST + MTP_LAST:
            out["mtp.layers.{i}." + p.leaf] = "mtp.layers.{i}." + p.leaf
        return out

    def extra_tensors(self, cfg):
        """transformers always builds a shared expert: a size-1 zero one stands for 'none'."""
        if cfg.moe.moe_shared_expert_intermediate_size:
            return {}
        H = cfg.hidden_size
        return {f"layers.{i}.mixer.shared_experts.{leaf}": shape for i, k in enumerate(layer_kinds(cfg)) if k.routed
                for leaf, shape in (("up_proj.weight", (1, H)), ("down_proj.weight", (H, 1)))}

    def claims(self, cfg):
        return True  # the default for every model no Llama-family layout holds (asked last)

    def upcycle_router(self):
        return "sigmoid"

    def upcycle_into(self, cfg, router, shared):
        return self.name

    def upcycle_check(self, cfg, router):
        if router not in self.routers:
            return (f"router {router} cannot be exported to nemotron_h: transformers' nemotron_h MoE only "
                    f"has the sigmoid router, renormalised or not (use --router sigmoid or sigmoid-raw)")
        return None


_DENSE = dict(vocab_size=96, hidden_size=32, head_dim=8, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48, mamba_num_heads=8, mamba_head_dim=4, n_groups=2, ssm_state_size=8, chunk_size=16)
_TINY = dict(_DENSE, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
             moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1, routed_scaling_factor=2.5)
NEMOTRON_H = NemotronH("nemotron_h", "NemotronHForCausalLM", depth=1, moe=True, mtp=True, routers=("sigmoid", "sigmoid-raw"),
                       block_types=BLOCK_TYPES, upcycle_help="nemotron_h",
                       padding_idx=False,  # transformers' nemotron_h embedding has no padding_idx: every row trains
                       ties_head=False,  # transformers' NemotronHForCausalLM never ties (its _tied_weights_keys is {})
                       tiny={"hybrid": dict(_TINY, hybrid_override_pattern="M*M-EM"),
                             "latent": dict(_TINY, hybrid_override_pattern="ME*E", moe_latent_size=20, n_group=1),
                             "dense": dict(_DENSE, hybrid_override_pattern="M*-M-")})  # an upcycling source

REGISTER = (NEMOTRON_H,)  # the families this module adds to models.families.FAMILIES, in order
