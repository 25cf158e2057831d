"""Liquid AI's LFM2 (transformers' `lfm2`, Lfm2ForCausalLM): decoder layer j is our pair of layers 2j (a gated
short convolution 'C', HF's `conv`, or attention '*', HF's `self_attn`; its norm HF's operator_norm) and 2j+1 (a
SwiGLU MLP '-', HF's feed_forward w1 = gate, w3 = up, w2 = down; its norm ffn_norm), so the pattern is e.g.
"C-C-*-". The attention is GQA with per-head q/k RMSNorms (q_layernorm / k_layernorm: our qk_norm, as Qwen3's),
RoPE on whole heads and no bias; its output projection is `out_proj`. The final norm is model.embedding_norm.
The MLP size: with block_auto_adjust_ff_dim transformers builds int(2 * I / 3), times block_ffn_dim_multiplier,
rounded up to block_multiple_of; we read that size and write it exactly (block_auto_adjust_ff_dim false)."""
from __future__ import annotations

from remodel.models.attention import ATTENTION
from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.kinds import used
from remodel.models.short_conv import SHORT_CONV

from .family import Family, gqa_attention

BLOCK_TYPES = {"conv": "C", "full_attention": "*"}  # HF layer type -> our mixer layer
_MLP = "-"
_ATTN = {"q_proj.weight": "q_proj.weight", "k_proj.weight": "k_proj.weight", "v_proj.weight": "v_proj.weight",
         "o_proj.weight": "out_proj.weight", "q_norm.weight": "q_layernorm.weight", "k_norm.weight": "k_layernorm.weight"}
_FFN = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def ffn_size(h) -> int:
    """The MLP size transformers' Lfm2MLP builds from the config."""
    size = h.intermediate_size
    if not getattr(h, "block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    mult, of = getattr(h, "block_ffn_dim_multiplier", 1.0), getattr(h, "block_multiple_of", 256)
    if mult is not None:
        size = of * ((int(mult * size) + of - 1) // of)
    return size


class Lfm2(Family):
    def required(self, h):
        need = [("num_hidden_layers",), ("intermediate_size", "block_ff_dim")]
        return need + ([("num_attention_heads",)] if "full_attention" in h.layer_types else [])

    def from_hf(self, h, extra, ffn: int | None = None):
        """ffn: the dense MLPs' size when the config states it exactly (LFM2-MoE), else ffn_size(h)."""
        unknown = sorted(set(h.layer_types) - set(BLOCK_TYPES))
        if unknown:
            raise RemodelError(f"'layer_types' has unknown types {unknown} (known: {', '.join(BLOCK_TYPES)})")
        return ModelConfig(
            vocab_size=h.vocab_size, hidden_size=h.hidden_size, norm_eps=h.norm_eps,
            pattern="".join(BLOCK_TYPES[t] + _MLP for t in h.layer_types),
            tie_word_embeddings=bool(h.tie_word_embeddings),
            attention=gqa_attention(h, self.name, types=("default",), partial=False, qk_norm=True),
            intermediate_size=ffn_size(h) if ffn is None else ffn, mlp_act="silu", mlp_gated=True,
            short_conv_kernel=h.conv_L_cache, short_conv_bias=bool(h.conv_bias), extra=extra)

    def check(self, cfg, need):
        need(not cfg.mtp_layers, f"MTP layers are not stored by {self.name}")
        mixers, mlps = cfg.pattern[0::2], cfg.pattern[1::2]
        need(cfg.num_layers % 2 == 0 and set(mixers) <= set(BLOCK_TYPES.values()) and set(mlps) <= set(self.ffn_layers(cfg)),
             f"needs the layer pattern of (short conv 'C' or attention '*') + MLP '-' pairs, got {cfg.pattern!r}")
        need(cfg.norm_offset == 0, f"{self.name}'s RMSNorms scale by w (norm_offset 0)")
        need(cfg.mlp.mlp_gated and cfg.mlp.mlp_act == "silu" and not cfg.mlp.mlp_bias, "needs SwiGLU MLPs without bias")
        if ATTENTION in used(cfg):
            a = cfg.attention
            need(a.qk_norm and not a.qk_norm_full and not a.attn_output_gate,
                 f"{self.name} attention has per-head q/k norms and no output gate")
            need(a.rope_theta is not None and a.rope_scaling is None and a.partial_rotary_factor == 1,
                 f"{self.name} attention uses default RoPE on whole heads")
            need(not a.attention_bias and not a.attention_out_bias, f"{self.name} attention has no bias")
            need(a.sliding_window is None, f"{self.name} has no sliding-window attention")

    def to_hf(self, cfg):
        attn = ATTENTION in used(cfg)
        return dict(
            num_hidden_layers=cfg.num_layers // 2, norm_eps=cfg.norm_eps,
            layer_types=[next(t for t, c in BLOCK_TYPES.items() if c == m) for m in cfg.pattern[0::2]],
            num_attention_heads=cfg.attention.num_attention_heads if attn else 1,
            num_key_value_heads=cfg.attention.num_key_value_heads if attn else 1,
            head_dim=cfg.attention.head_dim or cfg.hidden_size,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.attention.rope_theta or 1000000.0},
            intermediate_size=cfg.mlp.intermediate_size, block_auto_adjust_ff_dim=False,
            conv_L_cache=cfg.short_conv.short_conv_kernel, conv_bias=cfg.short_conv.short_conv_bias)

    def key_map(self):
        """Our layer 2j's mixer is HF layer j's `conv` or `self_attn`, 2j+1's MLP its `feed_forward`."""
        out = {"embeddings.weight": "model.embed_tokens.weight",
               "layers.{a}.norm.weight": "model.layers.{a}.operator_norm.weight",
               "layers.{m}.norm.weight": "model.layers.{m}.ffn_norm.weight"}
        out.update({f"layers.{{a}}.mixer.{p.leaf}": f"model.layers.{{a}}.conv.{p.leaf}" for p in SHORT_CONV.params})
        out.update({f"layers.{{a}}.mixer.{ours}": f"model.layers.{{a}}.self_attn.{hf}" for ours, hf in _ATTN.items()})
        out.update({f"layers.{{m}}.mixer.{ours}.weight": f"model.layers.{{m}}.feed_forward.{hf}.weight"
                    for ours, hf in _FFN.items()})
        out.update({"norm_f.weight": "model.embedding_norm.weight", "lm_head.weight": "lm_head.weight"})
        return out

    def upcycle_router(self):
        return "sigmoid"

    def upcycle_into(self, cfg, router, shared):
        return "lfm2_moe"

    def ffn_layers(self, cfg) -> tuple:
        """The feed-forward layer kinds its decoder layers hold (LFM2: the dense MLP)."""
        return (_MLP,)

    def claims(self, cfg):
        return self.holds(cfg)


TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, intermediate_size=40, block_auto_adjust_ff_dim=False,
            num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3,
            layer_types=["conv", "full_attention", "conv", "conv"])
LFM2 = Lfm2("lfm2", "Lfm2ForCausalLM", depth=2, block_types=BLOCK_TYPES, padding_idx=True, upcycle_help="lfm2_moe",
            # tied, no bias (LFM2's release); then attention first, every conv bias, untied, a longer kernel
            tiny={"plain": TINY,
                  "biased_untied": dict(TINY, conv_bias=True, tie_word_embeddings=False, conv_L_cache=4,
                                        layer_types=["full_attention", "conv", "conv", "full_attention"],
                                        intermediate_size=56,
                                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0})})

REGISTER = (LFM2,)  # the families this module adds to models.families.FAMILIES, in order
