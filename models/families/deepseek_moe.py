"""The DeepSeek-style MoE decoder both glm4_moe and deepseek_v3 store: decoder layer j is our pair 2j (the family's
attention kind) and 2j+1 (its feed-forward); the first `first_k_dense_replace` feed-forwards are dense SwiGLU MLPs,
the rest MoE with the MoE kind's DeepSeek router (sigmoid scores, selection on score + e_score_correction_bias within
the top `topk_group` of `n_group` expert groups, optional renormalisation, routed_scaling_factor) and
`n_shared_experts` shared experts fused into one of n_shared_experts * moe_intermediate_size. The checkpoints' MTP
layers (model.layers.{num_hidden_layers}...) are read by a family with `mtp` (glm4_moe, as our MTP head), else not:
transformers reads neither."""
from __future__ import annotations

from dataclasses import dataclass

from remodel.models.errors import RemodelError
from remodel.models.kinds import routed

from .family import Family
from .llama import LlamaFamily, key_map

SWIGLU = {p: p for p in ("gate_proj", "up_proj", "down_proj")}


@dataclass(frozen=True)
class DeepSeekMoEFamily(LlamaFamily):
    """mixer: the pattern character of its attention layers."""
    mixer: str = "*"
    moe: bool = True
    routers: tuple = ("sigmoid", "sigmoid-raw")
    upcycle_help: str = "none (already MoE)"

    def pattern(self, layers: int, dense: int) -> str:
        """first_k_dense_replace attention + MLP pairs, then attention + MoE pairs."""
        return f"{self.mixer}-" * dense + f"{self.mixer}E" * (layers - dense)

    def mtp_from_hf(self, h) -> dict:
        """An MTP family's MTP layers: num_nextn_predict_layers decoder layers after the trunk, each MoE (dense
        when the trunk has fewer than first_k_dense_replace layers), as vLLM's deepseek / glm4_moe MTP builds them."""
        n = int(getattr(h, "num_nextn_predict_layers", 0) or 0) if self.mtp else 0
        dense = h.first_k_dense_replace > h.num_hidden_layers
        return dict(mtp_layers=n, mtp_pattern=(self.mixer + ("-" if dense else "E")) if n else "")

    def mtp_pattern(self, cfg) -> str:
        """Our two blocks of one MTP decoder layer (attention, then the feed-forward its index gets)."""
        return self.mixer + ("E" if "E" in cfg.pattern else "-")

    @staticmethod
    def dense_layers(cfg) -> int:
        """first_k_dense_replace: the decoder layers before the first MoE one."""
        first = cfg.pattern.find("E")
        return cfg.num_layers // 2 if first < 0 else first // 2

    def ffn_from_hf(self, h) -> dict:
        """The pattern and the mlp / moe sections of config `h` (the attention is the family's)."""
        if getattr(h, "hidden_act", "silu") != "silu":
            raise RemodelError(f"unsupported hidden_act {h.hidden_act!r} for {self.name} (only silu)")
        if not h.n_shared_experts:
            raise RemodelError(f"{self.name} with n_shared_experts=0 is not supported (its releases all have them)")
        return dict(pattern=self.hf_pattern(h),
                    mlp=dict(intermediate_size=h.intermediate_size, mlp_act="silu", mlp_gated=True),
                    moe=dict(n_routed_experts=h.n_routed_experts, num_experts_per_tok=h.num_experts_per_tok,
                             moe_intermediate_size=h.moe_intermediate_size,
                             moe_shared_expert_intermediate_size=h.n_shared_experts * h.moe_intermediate_size,
                             router="sigmoid", norm_topk_prob=bool(h.norm_topk_prob),
                             routed_scaling_factor=float(h.routed_scaling_factor), n_group=h.n_group,
                             topk_group=h.topk_group))

    def hf_pattern(self, h) -> str:
        """Our layer pattern from HF config `h`: first_k_dense_replace dense layers, then MoE ones."""
        return self.pattern(h.num_hidden_layers, min(h.first_k_dense_replace, h.num_hidden_layers))

    def hf_layers(self, cfg) -> dict:
        """The HF fields saying which decoder layers are dense (the inverse of hf_pattern)."""
        return dict(first_k_dense_replace=self.dense_layers(cfg))

    def check(self, cfg, need):
        need(not cfg.mtp_layers or (self.mtp and cfg.mtp_pattern == self.mtp_pattern(cfg)),
             f"{self.name} stores no MTP layers" if not self.mtp else
             f"{self.name} MTP layers are one decoder layer each, '{self.mtp_pattern(cfg)}', not {cfg.mtp_pattern!r}")
        m = cfg.moe
        need(self.holds_pattern(cfg), f"needs dense layers '{self.mixer}-' then MoE layers '{self.mixer}E' "
             f"(first_k_dense_replace), got {cfg.pattern!r}")
        self.check_ffn(cfg, need)

    def check_ffn(self, cfg, need):
        """SwiGLU MLPs without bias; MoE layers with DeepSeek's router and n_shared_experts whole shared experts."""
        need(cfg.mlp.mlp_gated and cfg.mlp.mlp_act == "silu" and not cfg.mlp.mlp_bias, "needs SwiGLU MLPs without bias")
        if routed(cfg):
            m = cfg.moe
            need(m.router == "sigmoid" and not m.shared_expert_gate and m.moe_latent_size is None,
                 f"{self.name} MoE uses the sigmoid router, no shared-expert gate and no latent")
            s = m.moe_shared_expert_intermediate_size or 0
            need(s > 0 and s % m.moe_intermediate_size == 0,
                 f"the shared experts ({s}) must be n_shared_experts >= 1 times moe_intermediate_size "
                 f"({m.moe_intermediate_size})")

    def ffn_to_hf(self, cfg) -> dict:
        m = cfg.moe
        shared = m.moe_shared_expert_intermediate_size or m.moe_intermediate_size
        return dict(num_hidden_layers=cfg.num_layers // 2, **self.hf_layers(cfg),
                    rms_norm_eps=cfg.norm_eps, hidden_act="silu", intermediate_size=cfg.mlp.intermediate_size or 1,
                    n_routed_experts=m.n_routed_experts or 1, num_experts_per_tok=m.num_experts_per_tok,
                    moe_intermediate_size=m.moe_intermediate_size or 1,
                    n_shared_experts=shared // (m.moe_intermediate_size or 1), norm_topk_prob=m.norm_topk_prob,
                    routed_scaling_factor=m.routed_scaling_factor, n_group=m.n_group, topk_group=m.topk_group)

    def key_map(self):
        out = {**key_map(self.attn, "mlp"), **key_map(self.attn, "mlp", "gate", SWIGLU)}
        hf_m = "model.layers.{m}.mlp."
        out["layers.{m}.mixer.gate.e_score_correction_bias"] = hf_m + "gate.e_score_correction_bias"
        out.update({f"layers.{{m}}.mixer.shared_experts.{p}.weight": f"{hf_m}shared_experts.{p}.weight" for p in SWIGLU})
        return out

    def holds_pattern(self, cfg) -> bool:
        return cfg.num_layers % 2 == 0 and cfg.pattern == self.pattern(cfg.num_layers // 2, self.dense_layers(cfg))

    def upcycle_into(self, cfg, router, shared):
        return Family.upcycle_into(self, cfg, router, shared)  # already MoE: --to names a target

    def upcycle_check(self, cfg, router):
        if router not in self.routers:
            return f"{self.name} routers are sigmoid (DeepSeek-style): use --router sigmoid or sigmoid-raw, not {router}"
        return None
