"""IBM Bamba (transformers' `bamba`): decoder layer j is our pair of layers 2j (a Mamba-2 'M' or attention
'*' mixer, its norm HF's input_layernorm) and 2j+1 (a SwiGLU MLP '-', its norm HF's pre_ff_layernorm),
so the pattern is e.g. "M-M-*-". Its Mamba mixer computes as nemotron_h's (the Mamba spec's in_proj segments,
gate before the group RMSNorm, dt clamped to time_step_limit); its attention rotates the first half of
each head's channels (transformers hardcodes partial_rotary_factor 0.5); every norm uses rms_norm_eps."""
from __future__ import annotations

from remodel.models.attention import ATTENTION
from remodel.models.config import MAX_SMALL, ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.kinds import used
from remodel.models.mamba import MAMBA

from .family import Family, feed_forward_keys, read_rope, time_step_limit
from .width_rules import MAMBA_WIDTH_FROM_HIDDEN

BLOCK_TYPES = {"linear_attention": "M", "full_attention": "*"}  # HF layer type -> our mixer layer
ROTARY = 0.5  # transformers' BambaConfig sets partial_rotary_factor=0.5 whatever config.json says
_MLP = "-"
_HF_MIXER = ((MAMBA, "mamba"), (ATTENTION, "self_attn"))  # our mixer kind, the HF decoder layer's module


def _rope(h) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) of the config; only the default RoPE type."""
    theta, _, rotary = read_rope(h, "bamba", partial=True)
    return theta, rotary


class Bamba(Family):
    def required(self, h):
        need = [("num_hidden_layers",), ("intermediate_size",)]
        types = set(h.layers_block_type)
        if "full_attention" in types:
            need += [("num_attention_heads",)]
        if "linear_attention" in types:
            need += [("mamba_n_heads",), ("mamba_d_state",), ("mamba_expand", "mamba_d_head")]
        return need

    def from_hf(self, h, extra):
        if h.hidden_act != "silu":
            raise RemodelError(f"unsupported hidden_act {h.hidden_act!r} for bamba (only silu)")
        theta, rotary = _rope(h)
        lo, hi = time_step_limit(h)
        return ModelConfig(
            vocab_size=h.vocab_size, hidden_size=h.hidden_size, norm_eps=h.rms_norm_eps,
            pattern="".join(BLOCK_TYPES[t] + _MLP for t in h.layers_block_type),
            tie_word_embeddings=bool(h.tie_word_embeddings),
            num_attention_heads=h.num_attention_heads, num_key_value_heads=h.num_key_value_heads,
            head_dim=getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads,
            rope_theta=theta, partial_rotary_factor=rotary,
            attention_bias=bool(h.attention_bias), attention_out_bias=bool(h.attention_bias),
            intermediate_size=h.intermediate_size, mlp_act="silu", mlp_gated=True, mlp_bias=bool(h.mlp_bias),
            mamba_num_heads=h.mamba_n_heads, mamba_head_dim=h.mamba_d_head, n_groups=h.mamba_n_groups,
            **{"mamba.d_state": h.mamba_d_state}, conv_kernel=h.mamba_d_conv, chunk_size=h.mamba_chunk_size,
            use_conv_bias=bool(h.mamba_conv_bias), mamba_proj_bias=bool(h.mamba_proj_bias),
            time_step_min=lo, time_step_max=hi, extra=extra)

    def check(self, cfg, need):
        need(not cfg.mtp_layers, "MTP layers are nemotron_h only")
        mixers, mlps = cfg.pattern[0::2], cfg.pattern[1::2]
        need(cfg.num_layers % 2 == 0 and set(mixers) <= set(BLOCK_TYPES.values()) and set(mlps) == {_MLP},
             f"needs the layer pattern of (Mamba 'M' or attention '*') + MLP '-' pairs, got {cfg.pattern!r}")
        need(cfg.mlp.mlp_gated and cfg.mlp.mlp_act == "silu", "needs SwiGLU MLPs")
        if ATTENTION in used(cfg):
            need(cfg.attention.rope_theta is not None and cfg.attention.rope_scaling is None, "bamba attention uses default RoPE")
            need(cfg.attention.partial_rotary_factor == ROTARY, f"bamba rotates {ROTARY} of each head's channels "
                 f"(partial_rotary_factor), got {cfg.attention.partial_rotary_factor}")
            need(cfg.attention.attention_bias == cfg.attention.attention_out_bias, "q/k/v and o_proj bias must match")
            need(not cfg.attention.qk_norm, "bamba attention has no q/k norm")
            need(cfg.attention.sliding_window is None, "bamba has no sliding-window attention")
        if MAMBA in used(cfg):
            need(cfg.mamba_inner % cfg.hidden_size == 0, f"bamba's Mamba width is mamba_expand * hidden_size: "
                 f"mamba_num_heads * mamba_head_dim = {cfg.mamba_inner} is not a multiple of {cfg.hidden_size}")

    def to_hf(self, cfg):
        mamba, H = MAMBA in used(cfg), cfg.hidden_size
        return dict(
            num_hidden_layers=cfg.num_layers // 2, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
            attn_layer_indices=[j for j, c in enumerate(cfg.pattern[0::2]) if c == ATTENTION.char],
            num_attention_heads=cfg.attention.num_attention_heads or 1, num_key_value_heads=cfg.attention.num_key_value_heads or 1,
            head_dim=cfg.attention.head_dim or 1, attention_bias=cfg.attention.attention_bias,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.attention.rope_theta or 10000.0,
                             "partial_rotary_factor": ROTARY},
            intermediate_size=cfg.mlp.intermediate_size, mlp_bias=cfg.mlp.mlp_bias,
            # without Mamba layers any consistent widths do: one head of the whole hidden size
            mamba_n_heads=cfg.mamba.mamba_num_heads if mamba else 1, mamba_d_head=cfg.mamba.mamba_head_dim if mamba else H,
            mamba_expand=cfg.mamba_inner // H if mamba else 1, mamba_n_groups=cfg.mamba.n_groups if mamba else 1,
            mamba_d_state=cfg.mamba.d_state or 1, mamba_d_conv=cfg.mamba.conv_kernel, mamba_chunk_size=cfg.mamba.chunk_size,
            mamba_conv_bias=cfg.mamba.use_conv_bias, mamba_proj_bias=cfg.mamba.mamba_proj_bias,
            time_step_limit=[float(cfg.mamba.time_step_min), float(cfg.mamba.time_step_max)])

    def key_map(self):
        """Our layer 2j's mixer is HF layer j's `mamba` or `self_attn` (their tensor names differ), 2j+1's
        MLP its `feed_forward`; every tensor the two kinds can hold in bamba (no q/k norm)."""
        out = feed_forward_keys()
        for k, module in _HF_MIXER:
            out.update({f"layers.{{a}}.mixer.{p.leaf}": f"model.layers.{{a}}.{module}.{p.leaf}"
                        for p in k.params if "qk_norm" not in p.when})
        return out

    def claims(self, cfg):
        """The default export of every model bamba holds exactly (asked before nemotron_h)."""
        return self.holds(cfg)

    def upcycle_into(self, cfg, router, shared):
        raise RemodelError("bamba has no upcycling target: granitemoehybrid holds Mamba layers with SwiGLU experts "
                           "but its RoPE spans whole heads, bamba's half (nemotron_h's experts are not gated)")


_TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, attn_layer_indices=[1], num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=96, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
             mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16)
BAMBA = Bamba("bamba", "BambaForCausalLM", depth=2, width_rules=(MAMBA_WIDTH_FROM_HIDDEN,), block_types=BLOCK_TYPES,
              raw={"mamba_expand": (1, MAX_SMALL)}, padding_idx=True, fixed_rotary=ROTARY,
              upcycle_help="none (granitemoehybrid rotates whole heads, bamba half)",
              # every bias, tied embeddings, an explicit head_dim, attention last, a dt clamp
              tiny={"plain": _TINY, "biased_tied": dict(_TINY, attn_layer_indices=[0, 3], attention_bias=True,
                                                        mlp_bias=True, mamba_proj_bias=True, mamba_conv_bias=False,
                                                        tie_word_embeddings=True, head_dim=24, time_step_limit=(0.01, 5.0),
                                                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0})})

REGISTER = (BAMBA,)  # the families this module adds to models.families.FAMILIES, in order
