"""TII Falcon-H1 (transformers' `falcon_h1`): decoder layer j is our pair of layers 2j (the parallel mixer 'P':
attention and Mamba-2 on the same normalised input, their outputs summed; its norm HF's input_layernorm) and
2j+1 (a SwiGLU MLP '-', its norm HF's pre_ff_layernorm), so the pattern is "P-" * L. The Mamba width is
mamba_d_ssm (= mamba_n_heads * mamba_d_head, not tied to the hidden size); the Mamba norm is optional
(mamba_rms_norm; without it y * silu(z)) and may normalise before the gate (mamba_norm_before_gate). Its
multipliers are ModelConfig fields applied in forward: embedding_multiplier, lm_head_multiplier, key_multiplier,
attention_in/out_multiplier, ssm_in/out_multiplier, ssm_multipliers (one per in_proj segment, in the Mamba
spec's order: transformers' mup_vector) and mlp_multipliers (gate_proj and down_proj outputs). RoPE on whole
heads."""
from __future__ import annotations

import math
import numbers

from remodel.models.attention import ATTENTION
from remodel.models.config import MAX_SMALL, MAX_WIDTH, ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.mamba import MAMBA
from remodel.models.mlp import MLP_KIND
from remodel.models.parallel_mixer import PARALLEL

from .family import Family, feed_forward_keys, read_rope, time_step_limit

BLOCK_TYPES = {"hybrid": PARALLEL.char}  # HF layer type -> our mixer layer
_PAIR = PARALLEL.char + MLP_KIND.char
_HF_MIXER = (("attn.", ATTENTION, "self_attn"), ("mamba.", MAMBA, "mamba"))  # our submodule, its kind, HF's module
_SCALARS = ("embedding_multiplier", "lm_head_multiplier", "key_multiplier", "attention_in_multiplier",
            "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier")


def _rope_theta(h) -> float:
    return read_rope(h, "falcon_h1")[0]


def _multipliers(h) -> dict:
    """The multipliers as ModelConfig fields (one-line error for a non-number)."""
    out = {}
    for k in _SCALARS:
        v = getattr(h, k)
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise RemodelError(f"{k} must be a number, got {v!r}")
        out[k] = float(v)
    for k, n in (("ssm_multipliers", 5), ("mlp_multipliers", 2)):  # (in_proj's 5 parts, gate and down)
        v = getattr(h, k)
        if not isinstance(v, (list, tuple)) or len(v) != n or any(
                isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) for x in v):
            raise RemodelError(f"{k} must be {n} finite numbers (a list), got {v!r}")
        out[k] = tuple(float(x) for x in v)
    return out


class FalconH1(Family):
    def required(self, h):
        return [("num_hidden_layers",), ("intermediate_size",), ("num_attention_heads",), ("mamba_n_heads",),
                ("mamba_d_state",), ("mamba_d_ssm", "mamba_expand")]

    def from_hf(self, h, extra):
        if h.hidden_act != "silu":
            raise RemodelError(f"unsupported hidden_act {h.hidden_act!r} for falcon_h1 (only silu)")
        if bool(h.mamba_proj_bias) != bool(h.projectors_bias):
            raise RemodelError("falcon_h1 with mamba_proj_bias != projectors_bias is not supported (one bias flag "
                               "serves the Mamba in_proj and out_proj)")
        lo, hi = time_step_limit(h)
        return ModelConfig(
            vocab_size=h.vocab_size, hidden_size=h.hidden_size, norm_eps=h.rms_norm_eps,
            pattern=_PAIR * h.num_hidden_layers, tie_word_embeddings=bool(h.tie_word_embeddings),
            num_attention_heads=h.num_attention_heads, num_key_value_heads=h.num_key_value_heads,
            head_dim=getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads, rope_theta=_rope_theta(h),
            attention_bias=bool(h.attention_bias), attention_out_bias=bool(h.attention_bias),
            intermediate_size=h.intermediate_size, mlp_act="silu", mlp_gated=True, mlp_bias=bool(h.mlp_bias),
            mamba_num_heads=h.mamba_n_heads, mamba_head_dim=h.mamba_d_head, n_groups=h.mamba_n_groups,
            **{"mamba.d_state": h.mamba_d_state}, conv_kernel=h.mamba_d_conv, chunk_size=h.mamba_chunk_size,
            use_conv_bias=bool(h.mamba_conv_bias), mamba_proj_bias=bool(h.mamba_proj_bias),
            mamba_rms_norm=bool(h.mamba_rms_norm), mamba_norm_before_gate=bool(h.mamba_norm_before_gate),
            time_step_min=lo, time_step_max=hi, extra=extra, **_multipliers(h))

    def check(self, cfg, need):
        need(not cfg.mtp_layers, "MTP layers are nemotron_h only")
        need(cfg.num_layers % 2 == 0 and cfg.pattern == _PAIR * (cfg.num_layers // 2),
             f"needs the layer pattern {_PAIR!r} * N (parallel attention + Mamba mixer, then an MLP), got {cfg.pattern!r}")
        need(cfg.mlp.mlp_gated and cfg.mlp.mlp_act == "silu", "needs SwiGLU MLPs")
        need(cfg.scales.residual_multiplier == 1 and cfg.scales.logits_scaling == 1,
             "falcon_h1 has no residual_multiplier or logits_scaling (its lm_head_multiplier scales the logits)")
        need(cfg.attention.attention_scale is None or cfg.attention.attention_scale == 1 / math.sqrt(cfg.attention.head_dim),
             "falcon_h1 scales attention scores by 1/sqrt(head_dim) (its key_multiplier scales the keys)")
        need(cfg.attention.rope_theta is not None and cfg.attention.rope_scaling is None and cfg.attention.partial_rotary_factor == 1.0,
             "falcon_h1 attention has default RoPE on whole heads")
        need(cfg.attention.attention_bias == cfg.attention.attention_out_bias, "q/k/v and o_proj bias must match")
        need(not cfg.attention.qk_norm, "falcon_h1 attention has no q/k norm")
        need(cfg.attention.sliding_window is None, "falcon_h1 has no sliding-window attention")

    def to_hf(self, cfg):
        return dict(
            num_hidden_layers=cfg.num_layers // 2, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
            num_attention_heads=cfg.attention.num_attention_heads, num_key_value_heads=cfg.attention.num_key_value_heads,
            head_dim=cfg.attention.head_dim, attention_bias=cfg.attention.attention_bias,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.attention.rope_theta},
            intermediate_size=cfg.mlp.intermediate_size, mlp_bias=cfg.mlp.mlp_bias,
            mamba_d_ssm=cfg.mamba_inner, mamba_n_heads=cfg.mamba.mamba_num_heads, mamba_d_head=cfg.mamba.mamba_head_dim,
            mamba_n_groups=cfg.mamba.n_groups, mamba_d_state=cfg.mamba.d_state, mamba_d_conv=cfg.mamba.conv_kernel,
            mamba_chunk_size=cfg.mamba.chunk_size, mamba_conv_bias=cfg.mamba.use_conv_bias, mamba_proj_bias=cfg.mamba.mamba_proj_bias,
            projectors_bias=cfg.mamba.mamba_proj_bias, mamba_rms_norm=cfg.mamba.mamba_rms_norm,
            mamba_norm_before_gate=cfg.mamba.mamba_norm_before_gate,
            time_step_limit=[float(cfg.mamba.time_step_min), float(cfg.mamba.time_step_max)],
            **{k: cfg.get(k) for k in _SCALARS},
            ssm_multipliers=list(cfg.mamba.ssm_multipliers), mlp_multipliers=list(cfg.mlp.mlp_multipliers))

    def key_map(self):
        """Our layer 2j's parallel mixer is HF layer j's `self_attn` and `mamba`, 2j+1's MLP its `feed_forward`."""
        out = feed_forward_keys()
        for ours, k, module in _HF_MIXER:
            out.update({f"layers.{{a}}.mixer.{ours}{p.leaf}": f"model.layers.{{a}}.{module}.{p.leaf}"
                        for p in k.params if "qk_norm" not in p.when})
        return out

    def claims(self, cfg):
        """The default export of every model falcon_h1 holds exactly (the only family of parallel mixers)."""
        return self.holds(cfg)

    def upcycle_into(self, cfg, router, shared):
        raise RemodelError("falcon_h1 has no upcycling target: no supported MoE family holds parallel "
                           "attention + Mamba mixers")


# head_dim 12 (not hidden / heads), a Mamba width mamba_d_ssm 48 (not mamba_expand * hidden), every multiplier != 1
_TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=12, intermediate_size=48, mamba_d_ssm=48, mamba_n_heads=6, mamba_d_head=8, mamba_n_groups=2,
             mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16, embedding_multiplier=3.0, lm_head_multiplier=0.4,
             key_multiplier=0.6, attention_in_multiplier=1.3, attention_out_multiplier=0.7, ssm_in_multiplier=1.4,
             ssm_out_multiplier=0.8, ssm_multipliers=[0.5, 1.5, 0.7, 1.2, 0.9], mlp_multipliers=[1.6, 0.6])
FALCON_H1 = FalconH1("falcon_h1", "FalconH1ForCausalLM", depth=2, block_types=BLOCK_TYPES, multipliers=True,
                     raw={"mamba_expand": (1, MAX_SMALL), "mamba_d_ssm": (1, MAX_WIDTH)},
                     projections=True, padding_idx=True,
                     upcycle_help="none (no MoE family holds parallel attention + Mamba mixers)",
                     # no Mamba norm (transformers' default); gate then norm, multipliers the loss feels; norm then
                     # gate with every bias, tied embeddings, a dt clamp
                     tiny={"scaled": _TINY,
                           "rms_norm": dict(_TINY, mamba_rms_norm=True, mamba_norm_before_gate=False,
                                            lm_head_multiplier=4.0, key_multiplier=2.5, ssm_out_multiplier=3.0),
                           "norm_before_gate_biased_tied": dict(
                               _TINY, mamba_rms_norm=True, mamba_norm_before_gate=True, attention_bias=True,
                               mlp_bias=True, mamba_proj_bias=True, projectors_bias=True, mamba_conv_bias=False,
                               tie_word_embeddings=True, time_step_limit=(0.01, 5.0), key_multiplier=1.7,
                               rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                               ssm_multipliers=[1.2, 0.8, 1.1, 0.6, 1.3])})

REGISTER = (FALCON_H1,)  # the families this module adds to models.families.FAMILIES, in order
