"""GLM-4.7-Flash (transformers' `glm4_moe_lite`): deepseek_v3's decoder (models/families/deepseek_v3.py: multi-head
latent attention, the 'L' kind, then a dense SwiGLU MLP or the sigmoid-routed grouped MoE with shared experts) with
two differences in its config: which decoder layers are dense is the list `mlp_layer_types` ("dense" / "sparse"; by
default the first dense, the rest sparse), not first_k_dense_replace, which transformers ignores for this family;
and RoPE is the default type or YaRN on qk_rope_head_dim channels as deepseek_v3's. The released checkpoint's MTP
layer (model.layers.{num_hidden_layers}) is not read, as transformers does not read it."""
from __future__ import annotations

import re
from dataclasses import dataclass

from remodel.models.errors import RemodelError
from remodel.models.mla import MLA
from remodel.models.moe import MOE

from .deepseek_v3 import DeepseekV3
from .width_rules import SHARED_FROM_EXPERT

TYPES = {"dense": "-", "sparse": MOE.char}  # HF mlp_layer_types entry -> our feed-forward character
_PAIRS = re.compile(f"({re.escape(MLA.char)}[{re.escape(''.join(TYPES.values()))}])+")


@dataclass(frozen=True)
class Glm4MoeLite(DeepseekV3):
    """MLA + (dense or MoE) decoder layers in any order, as mlp_layer_types lists them."""

    def hf_pattern(self, h) -> str:
        types = list(getattr(h, "mlp_layer_types", None) or [])
        unknown = sorted(set(types) - set(TYPES))
        if unknown or len(types) != h.num_hidden_layers:
            raise RemodelError(f"'mlp_layer_types' must name {h.num_hidden_layers} layers of {', '.join(TYPES)}, "
                               f"got {types!r}")
        return "".join(self.mixer + TYPES[t] for t in types)

    def hf_layers(self, cfg) -> dict:
        inverse = {v: k for k, v in TYPES.items()}
        return dict(mlp_layer_types=[inverse[c] for c in cfg.pattern[1::2]])

    def holds_pattern(self, cfg) -> bool:
        return _PAIRS.fullmatch(cfg.pattern) is not None

    def check(self, cfg, need):
        need(self.holds_pattern(cfg), f"needs the layer pattern '{self.mixer}' then '-' (dense) or '{MOE.char}' "
             f"(MoE) per decoder layer (mlp_layer_types), got {cfg.pattern!r}")
        super().check(cfg, need)


_TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=4,
             kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, moe_intermediate_size=16,
             n_routed_experts=8, num_experts_per_tok=2)
GLM4_MOE_LITE = Glm4MoeLite(
    "glm4_moe_lite", "Glm4MoeLiteForCausalLM", padding_idx=True, width_rules=(SHARED_FROM_EXPERT,),
    raw={"n_shared_experts": (0, 1024)},
    # rms_norm_eps 1e-3: the latent norms keep RMSNorm's default 1e-6 in transformers (MLA's LATENT_EPS), visibly
    tiny={"flash": dict(_TINY, num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"], n_shared_experts=2,
                        q_lora_rank=10, n_group=2, topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True,
                        rms_norm_eps=1e-3, pad_token_id=94, rope_interleave=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
          "dense_between": dict(_TINY, num_hidden_layers=3, mlp_layer_types=["sparse", "dense", "sparse"],
                                n_shared_experts=1, q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False,
                                rope_interleave=False, attention_bias=True, tie_word_embeddings=True)})

REGISTER = (GLM4_MOE_LITE,)  # the families this module adds to models.families.FAMILIES, in order
