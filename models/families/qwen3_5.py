"""Qwen3.5, the text model (transformers' `qwen3_5_text`, Qwen3_5ForCausalLM): decoder layer j is our pair
of layers 2j (a Gated DeltaNet 'D' or gated attention '*' mixer, HF's `linear_attn` / `self_attn`, its norm
input_layernorm) and 2j+1 (a SwiGLU MLP '-', post_attention_layernorm), so the pattern is e.g. "D-D-D-*-".
Every RMSNorm is zero-centred (scales by 1 + w); the attention's q_proj yields each head's query and a sigmoid
output gate, with per-head q/k norms and RoPE on the first partial_rotary_factor of each head (the text
model's multimodal RoPE sections see one position per token: plain RoPE)."""
from __future__ import annotations

from remodel.models.attention import ATTENTION
from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.gated_deltanet import GATED_DELTANET
from remodel.models.kinds import used

from .family import Family, Part, gqa_attention

BLOCK_TYPES = {"linear_attention": "D", "full_attention": "*"}  # HF layer type -> our mixer layer
MLP_LAYER = "-"
_HF_MIXER = ((GATED_DELTANET, "linear_attn"), (ATTENTION, "self_attn"))  # our mixer kind, the HF module
_LINEAR = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
           "linear_conv_kernel_dim")


class Qwen35(Family):
    """FFN: our layer kind of every odd layer (the dense member's MLP; the MoE member's in qwen3_5_moe.py)."""
    FFN = MLP_LAYER

    def required(self, h):
        return [("num_hidden_layers",), ("intermediate_size",), ("layer_types",)]

    def fields(self, h, extra) -> dict:
        """The ModelConfig fields of the HF config `h` (the MoE members add their expert fields to these)."""
        return {**self.common(h, extra), "intermediate_size": h.intermediate_size}

    def common(self, h, extra: dict) -> dict:
        """The ModelConfig fields every member reads alike: every field but the FFN sizes."""
        if h.hidden_act != "silu":
            raise RemodelError(f"unsupported hidden_act {h.hidden_act!r} for {self.name} (only silu)")
        unknown = sorted(set(h.layer_types) - set(BLOCK_TYPES))
        if unknown:
            raise RemodelError(f"'layer_types' has unknown types {unknown} (known: {', '.join(BLOCK_TYPES)})")
        return dict(
            vocab_size=h.vocab_size, hidden_size=h.hidden_size, norm_eps=h.rms_norm_eps, norm_offset=1.0,
            pattern="".join(BLOCK_TYPES[t] + self.FFN for t in h.layer_types),
            tie_word_embeddings=bool(h.tie_word_embeddings),
            attention=gqa_attention(h, self.name, types=("default",), qk_norm=True, attn_output_gate=True,
                                    attention_bias=bool(h.attention_bias), attention_out_bias=bool(h.attention_bias)),
            mlp_act="silu", mlp_gated=True, **{k: getattr(h, k) for k in _LINEAR}, extra=extra)

    def from_hf(self, h, extra):
        return ModelConfig(**self.fields(h, extra))

    def check(self, cfg, need):
        need(not cfg.mtp_layers, f"MTP layers are not stored by {self.name}")
        mixers, mlps = cfg.pattern[0::2], cfg.pattern[1::2]
        need(cfg.num_layers % 2 == 0 and set(mixers) <= set(BLOCK_TYPES.values()) and set(mlps) == {self.FFN},
             f"needs the layer pattern of (Gated DeltaNet 'D' or attention '*') + {self.FFN!r} pairs, got {cfg.pattern!r}")
        need(cfg.norm_offset == 1, "every Qwen3.5 RMSNorm is zero-centred (norm_offset 1)")
        need(cfg.mlp.mlp_gated and cfg.mlp.mlp_act == "silu" and not cfg.mlp.mlp_bias, "needs SwiGLU MLPs / experts without bias")
        self.check_mixers(cfg, need)

    def check_mixers(self, cfg, need):
        """need(ok, why) for the attention and Gated DeltaNet layers (Qwen3-Next's are the same)."""
        if ATTENTION in used(cfg):
            need(cfg.attention.attn_output_gate and cfg.attention.qk_norm, "Qwen3.5 attention has an output gate and q/k norms")
            need(cfg.attention.rope_theta is not None and cfg.attention.rope_scaling is None, f"{self.name} attention uses default RoPE")
            need(cfg.attention.attention_bias == cfg.attention.attention_out_bias, "q/k/v and o_proj bias must match")
            need(cfg.attention.sliding_window is None, f"{self.name} has no sliding-window attention")
        if GATED_DELTANET in used(cfg):
            need(not cfg.gated_deltanet.linear_conv_bias, "Qwen3.5's Gated DeltaNet conv has no bias")

    def to_hf(self, cfg):
        attn = ATTENTION in used(cfg)
        return dict(
            num_hidden_layers=cfg.num_layers // 2, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
            layer_types=[next(t for t, c in BLOCK_TYPES.items() if c == m) for m in cfg.pattern[0::2]],
            num_attention_heads=cfg.attention.num_attention_heads if attn else 1,
            num_key_value_heads=cfg.attention.num_key_value_heads if attn else 1, head_dim=cfg.attention.head_dim or 1,
            attention_bias=cfg.attention.attention_bias,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.attention.rope_theta or 10000.0,
                             "partial_rotary_factor": cfg.attention.partial_rotary_factor},
            **{k: cfg.get(k) or 1 for k in _LINEAR}, **self.ffn_to_hf(cfg))

    def ffn_to_hf(self, cfg) -> dict:
        return {"intermediate_size": cfg.mlp.intermediate_size}

    def key_map(self):
        """Our layer 2j's mixer is HF layer j's `linear_attn` or `self_attn`, 2j+1's MLP its `mlp`."""
        out = {"embeddings.weight": "model.embed_tokens.weight",
               "layers.{a}.norm.weight": "model.layers.{a}.input_layernorm.weight",
               "layers.{m}.norm.weight": "model.layers.{m}.post_attention_layernorm.weight",
               "norm_f.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
        for k, module in _HF_MIXER:
            out.update({f"layers.{{a}}.mixer.{p.leaf}": f"model.layers.{{a}}.{module}.{p.leaf}" for p in k.params})
        fused = "model.layers.{a}.linear_attn.in_proj_qkv.weight"  # our q, k, v projections, unequal parts
        out.update({f"layers.{{a}}.mixer.in_proj_{x}.weight": Part(fused, 0, i, 3, sized=True) for i, x in enumerate("qkv")})
        for leaf in ("weight", "bias"):  # our three convs, unequal parts of its one conv over [q | k | v]
            conv = f"model.layers.{{a}}.linear_attn.conv1d.{leaf}"
            out.update({f"layers.{{a}}.mixer.{x}_conv1d.{leaf}": Part(conv, 0, i, 3, sized=True)
                        for i, x in enumerate("qkv")})
        return {**out, **self.ffn_keys()}

    def ffn_keys(self) -> dict:
        """The key map of the odd layers' FFN (HF layer j's `mlp`)."""
        return {f"layers.{{m}}.mixer.{p}.weight": f"model.layers.{{m}}.mlp.{p}.weight"
                for p in ("gate_proj", "up_proj", "down_proj")}

    def claims(self, cfg):
        return self.holds(cfg)

    def upcycle_into(self, cfg, router, shared):
        return "qwen3_5_moe_text"

TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, intermediate_size=40, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=6, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
QWEN3_5_TEXT = Qwen35("qwen3_5_text", "Qwen3_5ForCausalLM", depth=2, block_types=BLOCK_TYPES,
                      variants=("attention_gate", "zero_centred_norm"), padding_idx=True,
                      upcycle_help="qwen3_5_moe_text (its shared expert is gated)",
                      # three value heads per key head, attention first with every bias, tied, half the head rotated
                      tiny={"plain": TINY,
                            "grouped_biased_tied": dict(TINY, linear_num_value_heads=6, linear_conv_kernel_dim=3,
                                                        attention_bias=True, tie_word_embeddings=True,
                                                        layer_types=["full_attention", "linear_attention"] * 2,
                                                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                                         "partial_rotary_factor": 0.5})})

REGISTER = (QWEN3_5_TEXT,)  # the families this module adds to models.families.FAMILIES, in order
