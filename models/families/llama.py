"""The Llama family (transformers' `llama`, `mistral`, `qwen2`, `qwen3`): decoder layer j is our pair of
layers 2j (attention, RoPE) and 2j+1 (SwiGLU MLP); its two norms are the pair's pre-norms. The MoE
members (Mixtral, Qwen-MoE) are in models/families/llama_moe.py and share this module's pieces."""
from __future__ import annotations

from dataclasses import dataclass

from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError

from .family import Family, gqa_attention
from .width_rules import HIDDEN_DIVIDES_HEADS

_QKV = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
ATTN = _QKV + ("o_proj.weight", "o_proj.bias")  # attention_bias covers o_proj too
QWEN2_ATTN = _QKV + ("o_proj.weight",)  # q/k/v bias, never an o_proj bias
QWEN3_ATTN = ATTN + ("q_norm.weight", "k_norm.weight")
DENSE, SPARSE = "*-", "*E"  # our two layers of one decoder layer (attention, then MLP or MoE)


def key_map(attn: tuple, mlp: str, router: str = "", experts: dict | None = None, shared: bool = False) -> dict:
    """A Llama-family map: our layers 2j (attention) and 2j+1 (MLP or MoE) are HF decoder layer j, their
    norms its input_layernorm and post_attention_layernorm. `attn`: the attention tensors the family
    has; `mlp`: the MLP / MoE module; `experts`: our fused expert -> HF per-expert leaf (MoE only)."""
    hf_a, hf_m = "model.layers.{a}.", f"model.layers.{{m}}.{mlp}."
    out = {"embeddings.weight": "model.embed_tokens.weight",
           "layers.{a}.norm.weight": hf_a + "input_layernorm.weight",
           "layers.{m}.norm.weight": "model.layers.{m}.post_attention_layernorm.weight"}
    out.update({f"layers.{{a}}.mixer.{t}": f"{hf_a}self_attn.{t}" for t in attn})
    if experts is None:
        out.update({f"layers.{{m}}.mixer.{p}.weight": f"{hf_m}{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")})
    else:
        out["layers.{m}.mixer.gate.weight"] = f"{hf_m}{router}.weight"
        out.update({f"layers.{{m}}.mixer.experts.{p}": f"{hf_m}experts.{{e}}.{leaf}.weight" for p, leaf in experts.items()})
    if shared:
        out.update({f"layers.{{m}}.mixer.shared_experts.{p}.weight": f"{hf_m}shared_expert.{p}.weight"
                    for p in ("gate_proj", "up_proj", "down_proj")})
        out["layers.{m}.mixer.shared_expert_gate.weight"] = f"{hf_m}shared_expert_gate.weight"
    out.update({"norm_f.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"})
    return out


def mtp_key_map(trunk: dict) -> dict:
    """DeepSeek / GLM MTP layers: our MTP blocks 2j / 2j+1 are HF decoder layer L + j, named as the trunk's
    decoder layers (`trunk`: a key_map's entries), plus the fusion (enorm, hnorm, eh_proj) and the final norm
    `shared_head.norm`, as vLLM's deepseek_mtp / glm4_moe_mtp read them."""
    out = {}
    for ours, hf in trunk.items():
        for a, s in (("{a}", "{s}"), ("{m}", "{t}")):
            if ours.startswith(f"layers.{a}.") and isinstance(hf, str):
                out["mtp." + ours.replace(a, s)] = hf.replace(a, s)
    out.update({f"mtp.layers.{{s}}.{n}.weight": f"model.layers.{{s}}.{n}.weight" for n in ("enorm", "hnorm", "eh_proj")})
    out["mtp.layers.{t}.final_layernorm.weight"] = "model.layers.{t}.shared_head.norm.weight"
    return out


@dataclass(frozen=True)
class LlamaFamily(Family):
    """attn: the attention tensors its checkpoints hold; qkv_bias: None when attention_bias covers q/k/v
    and o_proj together, else q/k/v only (True: always, a string: the config field that says so);
    qk_norm: per-head q/k RMSNorm (Qwen3); window: sliding-window attention (Mistral); qwen_window: the
    config has use_sliding_window (Qwen), which must be off."""
    depth: int = 2
    attn: tuple = ATTN
    qkv_bias: bool | str | None = None
    qk_norm: bool = False
    window: bool = False
    qwen_window: bool = False
    layer: str = DENSE
    upcycle_help: str = "qwen3_moe with q/k norm, qwen2_moe with a shared expert or softmax-topk, else mixtral"

    def required(self, h):
        return [("num_hidden_layers",), ("num_attention_heads",), ("intermediate_size",)]

    def common(self, h, extra: dict) -> dict:
        """The ModelConfig fields every Llama-family member reads alike (attention, norms, SwiGLU)."""
        mt = self.name
        if self.qwen_window and getattr(h, "use_sliding_window", False):
            raise RemodelError(f"{mt} with use_sliding_window=true is not supported (per-layer windows)")
        if getattr(h, "hidden_act", "silu") != "silu":
            raise RemodelError(f"unsupported hidden_act {h.hidden_act!r} for {mt} (only silu)")
        if self.qkv_bias is None:
            bias = out_bias = bool(getattr(h, "attention_bias", False))
        else:
            bias, out_bias = self.qkv_bias is True or bool(getattr(h, self.qkv_bias, True)), False
        return dict(vocab_size=h.vocab_size, hidden_size=h.hidden_size, norm_eps=h.rms_norm_eps,
                    tie_word_embeddings=bool(h.tie_word_embeddings),
                    attention=gqa_attention(h, mt, partial=False, attention_bias=bias, attention_out_bias=out_bias,
                                            qk_norm=self.qk_norm,
                                            sliding_window=getattr(h, "sliding_window", None) if self.window else None),
                    mlp_act="silu", mlp_gated=True, mlp_bias=bool(getattr(h, "mlp_bias", False)), extra=extra)

    def from_hf(self, h, extra):
        return ModelConfig(pattern=self.layer * h.num_hidden_layers, intermediate_size=h.intermediate_size,
                           **self.common(h, extra))

    def check(self, cfg, need):
        need(not cfg.mtp_layers, "MTP layers are nemotron_h only")
        L = cfg.num_layers // 2
        need(cfg.num_layers % 2 == 0 and cfg.pattern == self.layer * L,
             f"needs the layer pattern {self.layer!r} * N, got {cfg.pattern!r}")
        need(cfg.attention.rope_theta is not None and cfg.attention.partial_rotary_factor == 1, "needs RoPE attention on whole heads")
        need(cfg.attention.sliding_window is None or self.window, "sliding-window attention is mistral/mixtral only")
        need(cfg.mlp.mlp_gated and cfg.mlp.mlp_act == "silu", "needs SwiGLU MLPs")
        need(cfg.attention.qk_norm == self.qk_norm, "q/k norm must match (only qwen3 families have it)")
        if self.qkv_bias is True:
            need(cfg.attention.attention_bias and not cfg.attention.attention_out_bias, f"{self.name} has q/k/v bias and no o_proj bias")
        elif self.qkv_bias:
            need(not cfg.attention.attention_out_bias, f"{self.name} has no o_proj bias")
        else:
            need(cfg.attention.attention_bias == cfg.attention.attention_out_bias, "q/k/v and o_proj bias must match")
        need(not cfg.mlp.mlp_bias, "MLP bias is not supported by this family")

    def to_hf(self, cfg):
        rope = {"rope_theta": cfg.attention.rope_theta, "rope_type": "default"} if cfg.attention.rope_scaling is None else dict(cfg.attention.rope_scaling)
        d = dict(num_hidden_layers=cfg.num_layers // 2, rms_norm_eps=cfg.norm_eps,
                 num_attention_heads=cfg.attention.num_attention_heads, num_key_value_heads=cfg.attention.num_key_value_heads,
                 head_dim=cfg.attention.head_dim, rope_parameters=rope, hidden_act="silu")
        if self.qkv_bias is None:
            d["attention_bias"] = cfg.attention.attention_bias
        elif isinstance(self.qkv_bias, str):
            d[self.qkv_bias] = cfg.attention.attention_bias
        if self.window:
            d["sliding_window"] = cfg.attention.sliding_window
        if self.qwen_window:
            d["use_sliding_window"] = False
        return {**d, **self.ffn_to_hf(cfg)}

    def ffn_to_hf(self, cfg) -> dict:
        return {"intermediate_size": cfg.mlp.intermediate_size}

    def key_map(self):
        return key_map(self.attn, "mlp")

    def claims(self, cfg):
        L = cfg.num_layers // 2
        return (cfg.attention.rope_theta is not None and cfg.attention.partial_rotary_factor == 1 and cfg.mlp.mlp_gated
                and cfg.pattern == self.layer * L and cfg.attention.qk_norm == self.qk_norm)

    def upcycle_into(self, cfg, router, shared):
        if cfg.attention.qk_norm:
            return "qwen3_moe"
        return "qwen2_moe" if shared or router == "softmax-topk" else "mixtral"


# the conformance suite's tiny models (Family.tiny): TINY is every member's, MoE members add their experts
TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, intermediate_size=40, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
LLAMA = LlamaFamily("llama", "LlamaForCausalLM", width_rules=(HIDDEN_DIVIDES_HEADS,), padding_idx=True,
                    tiny={"tied": dict(TINY, tie_word_embeddings=True), "llama3_rope": dict(TINY, rope_parameters=LLAMA3_ROPE)})
MISTRAL = LlamaFamily("mistral", "MistralForCausalLM", window=True, padding_idx=True,
                      tiny={"plain": dict(TINY, sliding_window=None)})
QWEN2 = LlamaFamily("qwen2", "Qwen2ForCausalLM", attn=QWEN2_ATTN, qkv_bias=True, qwen_window=True, padding_idx=True,
                    tiny={"plain": TINY})
QWEN3 = LlamaFamily("qwen3", "Qwen3ForCausalLM", attn=QWEN3_ATTN, qk_norm=True, qwen_window=True, padding_idx=True,
                    tiny={"plain": TINY})

REGISTER = (LLAMA, MISTRAL, QWEN2, QWEN3)  # the families this module adds to models.families.FAMILIES, in order
