"""IBM Granite 4.0-H (transformers' `granitemoehybrid`): decoder layer j is our pair of layers 2j (a Mamba-2
'M' or attention '*' mixer, its norm HF's input_layernorm) and 2j+1 (its post_attention_layernorm, then the
MoE 'E' whose shared expert is HF's shared_mlp, or with num_local_experts 0 the SwiGLU MLP '-' that is the
shared_mlp alone): patterns such as "ME*E" or "M-*-". Its Mamba mixer is Bamba's; its attention has RoPE
(on every channel) only with position_embedding_type "rope" and scores scaled by attention_multiplier; the
router takes the top-k logits and softmaxes over them (our softmax router renormalised: the same weights).
The scalar multipliers are ModelConfig's (embedding, residual, attention scale, logits scaling). HF fuses
gate and up: shared_mlp.input_linear [2S, H] and the experts' input_linear [E, 2F, H] concatenate our
gate_proj and up_proj, in that order (key-map Parts); the experts are stored as whole [E, ...] tensors."""
from __future__ import annotations

import math

from remodel.models.attention import ATTENTION
from remodel.models.config import MAX_SMALL, ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.kinds import routed, used
from remodel.models.layout import BLOCK_NORM
from remodel.models.mamba import MAMBA
from remodel.models.mlp import MLP_KIND
from remodel.models.moe import MOE

from .family import Family, Part, cfg_choice, read_rope, time_step_limit
from .width_rules import MAMBA_WIDTH_FROM_HIDDEN

BLOCK_TYPES = {"linear_attention": MAMBA.char, "full_attention": ATTENTION.char}  # HF layer type -> our mixer
_TYPE = {v: k for k, v in BLOCK_TYPES.items()}
_ROPE = "rope"  # position_embedding_type that turns RoPE on (anything else: no positional encoding)
_HF_MIXER = ((MAMBA, "mamba"), (ATTENTION, "self_attn"))  # our mixer kind, the HF decoder layer's module


def _rope_theta(h) -> float | None:
    """rope_theta when the config turns RoPE on (default type only), else None."""
    if cfg_choice(h, "position_embedding_type", None, (None, _ROPE, "nope")) != _ROPE:
        return None
    return read_rope(h, "granitemoehybrid")[0]


def _ffn(h) -> dict:
    """The FFN half's fields: MoE with the shared MLP as its shared expert, or the shared MLP alone."""
    S = h.shared_intermediate_size
    if not h.num_local_experts:
        return dict(intermediate_size=S)
    return dict(n_routed_experts=h.num_local_experts, num_experts_per_tok=h.num_experts_per_tok,
                moe_intermediate_size=h.intermediate_size, moe_shared_expert_intermediate_size=S,
                router="softmax", norm_topk_prob=True)


def _scalars(h, hd: int | None) -> dict:
    """The multipliers as ModelConfig fields (attention_scale None where it is 1/sqrt(head_dim) anyway, or
    where no layer attends: hd None)."""
    got = {k: getattr(h, k) for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                                      "logits_scaling")}
    for k, v in got.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RemodelError(f"{k} must be a number, got {v!r}")
    att = got["attention_multiplier"]
    return dict(embedding_multiplier=float(got["embedding_multiplier"]),
                residual_multiplier=float(got["residual_multiplier"]), logits_scaling=float(got["logits_scaling"]),
                attention_scale=None if hd is None or att == 1 / math.sqrt(hd) else float(att))


def _gate_up(hf: str, dim: int) -> dict:
    """Our gate_proj and up_proj leaves as the two halves (gate first) of the HF tensor `hf` along `dim`."""
    return {"gate_proj": Part(hf, dim, 0, 2), "up_proj": Part(hf, dim, 1, 2)}


class Granite(Family):
    def required(self, h):
        need = [("num_hidden_layers",), ("layer_types", "layers_block_type"), ("shared_intermediate_size",)]
        types = set(h.layers_block_type)
        if "full_attention" in types:
            need += [("num_attention_heads",)]
        if "linear_attention" in types:
            need += [("mamba_n_heads",), ("mamba_d_state",), ("mamba_expand", "mamba_d_head")]
        if h.num_local_experts:
            need += [("num_local_experts",), ("intermediate_size",)]
        return need

    def from_hf(self, h, extra):
        if h.hidden_act != "silu":
            raise RemodelError(f"unsupported hidden_act {h.hidden_act!r} for granitemoehybrid (only silu)")
        bad = set(h.layers_block_type) - set(BLOCK_TYPES)
        if bad:
            raise RemodelError(f"'layer_types' has unknown layer types {sorted(bad)} "
                               f"(known: mamba, attention, {', '.join(BLOCK_TYPES)})")
        lo, hi = time_step_limit(h)
        ffn = (MOE if h.num_local_experts else MLP_KIND).char
        hd = getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads
        return ModelConfig(
            vocab_size=h.vocab_size, hidden_size=h.hidden_size, norm_eps=h.rms_norm_eps,
            pattern="".join(BLOCK_TYPES[t] + ffn for t in h.layers_block_type),
            tie_word_embeddings=bool(h.tie_word_embeddings),
            num_attention_heads=h.num_attention_heads, num_key_value_heads=h.num_key_value_heads, head_dim=hd,
            rope_theta=_rope_theta(h), attention_bias=bool(h.attention_bias), attention_out_bias=bool(h.attention_bias),
            mlp_act="silu", mlp_gated=True, **_ffn(h),
            mamba_num_heads=h.mamba_n_heads, mamba_head_dim=h.mamba_d_head, n_groups=h.mamba_n_groups,
            **{"mamba.d_state": h.mamba_d_state}, conv_kernel=h.mamba_d_conv, chunk_size=h.mamba_chunk_size,
            use_conv_bias=bool(h.mamba_conv_bias), mamba_proj_bias=bool(h.mamba_proj_bias),
            time_step_min=lo, time_step_max=hi, extra=extra,
            **_scalars(h, hd if "full_attention" in h.layers_block_type else None))

    def check(self, cfg, need):
        need(not cfg.mtp_layers, "MTP layers are nemotron_h only")
        mixers, ffns = cfg.pattern[0::2], cfg.pattern[1::2]
        need(cfg.num_layers % 2 == 0 and set(mixers) <= set(BLOCK_TYPES.values())
             and set(ffns) in ({MOE.char}, {MLP_KIND.char}),
             f"needs the layer pattern of (Mamba 'M' or attention '*') + (every one MoE 'E' or every one MLP '-') "
             f"pairs, got {cfg.pattern!r}")
        need(cfg.mlp.mlp_gated and cfg.mlp.mlp_act == "silu" and not cfg.mlp.mlp_bias, "needs SwiGLU MLPs without bias")
        if routed(cfg):
            need(cfg.moe.router == "softmax" and cfg.moe.norm_topk_prob and cfg.moe.n_group == 1,
                 "granitemoehybrid routes by softmax over the top-k logits (a renormalised softmax router)")
            need(cfg.moe.routed_scaling_factor == 1.0, "routed_scaling_factor must be 1")
            need(cfg.moe.moe_latent_size is None, "latent MoE projections are nemotron_h only")
            need(cfg.moe.moe_shared_expert_intermediate_size > 0 and not cfg.moe.shared_expert_gate,
                 "granitemoehybrid MoE layers always hold an ungated shared expert (its shared_mlp)")
        if ATTENTION in used(cfg):
            need(cfg.attention.rope_scaling is None and cfg.attention.partial_rotary_factor == 1.0,
                 "granitemoehybrid attention has default RoPE on whole heads, or none")
            need(cfg.attention.attention_bias == cfg.attention.attention_out_bias, "q/k/v and o_proj bias must match")
            need(not cfg.attention.qk_norm, "granitemoehybrid attention has no q/k norm")
            need(cfg.attention.sliding_window is None, "granitemoehybrid has no sliding-window attention")
        if MAMBA in used(cfg):
            need(cfg.mamba_inner % cfg.hidden_size == 0, f"granitemoehybrid's Mamba width is mamba_expand * "
                 f"hidden_size: mamba_num_heads * mamba_head_dim = {cfg.mamba_inner} is not a multiple of "
                 f"{cfg.hidden_size}")

    def to_hf(self, cfg):
        mamba, moe, H = MAMBA in used(cfg), routed(cfg), cfg.hidden_size
        scale = cfg.attention.attention_scale if cfg.attention.attention_scale is not None else 1 / math.sqrt(cfg.attention.head_dim or 1)
        d = dict(
            num_hidden_layers=cfg.num_layers // 2, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
            layer_types=[_TYPE[c] for c in cfg.pattern[0::2]],
            num_attention_heads=cfg.attention.num_attention_heads or 1, num_key_value_heads=cfg.attention.num_key_value_heads or 1,
            attention_bias=cfg.attention.attention_bias, position_embedding_type=_ROPE if cfg.attention.rope_theta is not None else None,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.attention.rope_theta or 10000.0},
            num_local_experts=cfg.moe.n_routed_experts if moe else 0, num_experts_per_tok=cfg.moe.num_experts_per_tok or 1,
            intermediate_size=cfg.moe.moe_intermediate_size if moe else cfg.mlp.intermediate_size,
            shared_intermediate_size=cfg.moe.moe_shared_expert_intermediate_size if moe else cfg.mlp.intermediate_size,
            # without Mamba layers any consistent widths do: one head of the whole hidden size
            mamba_n_heads=cfg.mamba.mamba_num_heads if mamba else 1, mamba_d_head=cfg.mamba.mamba_head_dim if mamba else H,
            mamba_expand=cfg.mamba_inner // H if mamba else 1, mamba_n_groups=cfg.mamba.n_groups if mamba else 1,
            mamba_d_state=cfg.mamba.d_state or 1, mamba_d_conv=cfg.mamba.conv_kernel, mamba_chunk_size=cfg.mamba.chunk_size,
            mamba_conv_bias=cfg.mamba.use_conv_bias, mamba_proj_bias=cfg.mamba.mamba_proj_bias,
            time_step_limit=[float(cfg.mamba.time_step_min), float(cfg.mamba.time_step_max)],
            embedding_multiplier=cfg.scales.embedding_multiplier, residual_multiplier=cfg.scales.residual_multiplier,
            attention_multiplier=scale, logits_scaling=cfg.scales.logits_scaling)
        if cfg.attention.head_dim:
            d["head_dim"] = cfg.attention.head_dim  # transformers' default hidden // heads need not hold (pruning)
        return d

    def key_map(self):
        """Our layer 2j's mixer is HF layer j's `mamba` or `self_attn`, 2j+1's MoE its `block_sparse_moe`
        (router, fused experts) with `shared_mlp` as the shared expert, or a dense MLP that is `shared_mlp`:
        both of our names of a shared_mlp tensor map to it (the config says which one a model has)."""
        out = {"embeddings.weight": "model.embed_tokens.weight",
               "layers.{a}." + BLOCK_NORM.leaf: "model.layers.{a}.input_layernorm.weight",
               "layers.{m}." + BLOCK_NORM.leaf: "model.layers.{m}.post_attention_layernorm.weight"}
        for k, module in _HF_MIXER:
            out.update({f"layers.{{a}}.mixer.{p.leaf}": f"model.layers.{{a}}.{module}.{p.leaf}"
                        for p in k.params if "qk_norm" not in p.when})
        shared, moe = "model.layers.{m}.shared_mlp.", "model.layers.{m}.block_sparse_moe."
        for ours in ("layers.{m}.mixer.", "layers.{m}.mixer.shared_experts."):  # dense MLP, MoE's shared expert
            out.update({f"{ours}{p}.weight": v for p, v in _gate_up(shared + "input_linear.weight", 0).items()})
            out[ours + "down_proj.weight"] = shared + "output_linear.weight"
        out["layers.{m}.mixer.gate.weight"] = moe + "router.layer.weight"
        out.update({f"layers.{{m}}.mixer.experts.{p}": v for p, v in _gate_up(moe + "input_linear.weight", 1).items()})
        out["layers.{m}.mixer.experts.down_proj"] = moe + "output_linear.weight"
        out.update({"norm_f.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"})
        return out

    def claims(self, cfg):
        """The default export of every model granitemoehybrid holds exactly (asked after bamba)."""
        return self.holds(cfg)

    def upcycle_into(self, cfg, router, shared):
        """A dense granite (the shared MLP alone) upcycles into granite MoE: the experts come from the dense
        MLP's neurons beyond --shared-expert-size, which stay the shared MLP (its MoE layers always have one)."""
        return self.name


_TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4,
             layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
             num_attention_heads=4, num_key_value_heads=2, intermediate_size=32, shared_intermediate_size=48,
             num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16, mamba_expand=2,
             mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16,
             embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=2.5)
GRANITE = Granite("granitemoehybrid", "GraniteMoeHybridForCausalLM", depth=2, width_rules=(MAMBA_WIDTH_FROM_HIDDEN,),
                  block_types=BLOCK_TYPES, raw={"mamba_expand": (1, MAX_SMALL)},
                  multipliers=True, moe=True, routers=("topk-softmax",), padding_idx=True,
                  upcycle_help="granitemoehybrid (with --shared-expert-size > 0: its MoE layers keep a shared MLP)",
                  # MoE + shared MLP without positions; the shared MLP alone; RoPE, every bias, tied, a dt clamp
                  tiny={"moe": _TINY, "dense": {**{k: v for k, v in _TINY.items() if k not in ("intermediate_size", "num_experts_per_tok")},
                                  "num_local_experts": 0},  # (the experts' fields: none here)
                        "rope_biased_tied": dict(_TINY, layer_types=["full_attention", "linear_attention",
                                                                     "linear_attention", "full_attention"],
                                                 position_embedding_type="rope", attention_bias=True,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                                                 mamba_proj_bias=True, mamba_conv_bias=False, tie_word_embeddings=True,
                                                 head_dim=24, time_step_limit=(0.01, 5.0), embedding_multiplier=1.5,
                                                 residual_multiplier=1.0, attention_multiplier=1.0, logits_scaling=0.5)})

REGISTER = (GRANITE,)  # the families this module adds to models.families.FAMILIES, in order
