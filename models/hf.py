"""Hugging Face formats: configs in and out, for every supported family.

Configs are parsed through transformers' own config classes, so their defaults and legacy field
names are the oracle's; `check_exportable` refuses a family that cannot hold a model exactly. Tensor
names live in models.hf_adapter (one declarative key map per family) and are re-exported here:
`weight_table`, `to_hf_name`, `from_hf_name`.
"""
from __future__ import annotations

import json

import math

from .config import MAX_LAYERS, MAX_MTP, MAX_SMALL, MAX_VOCAB, MAX_WIDTH, ModelConfig
from .errors import RemodelError
from .hf_adapter import KEY_MAPS, from_hf_name, to_hf_name, weight_table
from .layout import shapes

__all__ = ["FAMILIES", "KEY_MAPS", "check_exportable", "config_from_hf", "config_to_hf", "default_family",
           "from_hf_name", "our_shapes", "to_hf_name", "weight_table", "without_absent_mtp"]

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
FAMILIES = ("nemotron_h",) + DENSE_FAMILIES + MOE_FAMILIES
ARCH = {"nemotron_h": "NemotronHForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
PASSTHROUGH = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
_CHAR = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
_TYPE = {v: k for k, v in _CHAR.items()}


# config.json keys -> (lo, hi), checked on the raw JSON before transformers sees it (a string, list, bool
# or an unbounded value there would otherwise reach list allocations such as ["full_attention"] * layers)
_RAW_INTS = {"vocab_size": (1, MAX_VOCAB), "hidden_size": (1, MAX_WIDTH), "intermediate_size": (1, MAX_WIDTH),
             "moe_intermediate_size": (1, MAX_WIDTH), "moe_shared_expert_intermediate_size": (0, MAX_WIDTH),
             "shared_expert_intermediate_size": (0, MAX_WIDTH), "moe_latent_size": (1, MAX_WIDTH),
             **dict.fromkeys(("num_attention_heads", "num_key_value_heads", "head_dim", "mamba_num_heads",
                              "mamba_head_dim", "n_groups", "ssm_state_size", "n_routed_experts", "num_local_experts",
                              "num_experts", "num_experts_per_tok", "n_group", "topk_group"), (1, MAX_SMALL)),
             "conv_kernel": (1, 1024), "chunk_size": (1, MAX_WIDTH), "num_hidden_layers": (1, MAX_LAYERS // 2),
             "decoder_sparse_step": (1, MAX_LAYERS), "num_nextn_predict_layers": (0, MAX_MTP),
             "max_position_embeddings": (1, 2**40), "sliding_window": (0, 2**40)}
# key -> smallest value (excluded); every one finite (time_step_max may be inf)
_RAW_FLOATS = {"rms_norm_eps": 0, "layer_norm_epsilon": 0, "rope_theta": 0, "routed_scaling_factor": 0,
               "time_step_min": -1e-300, "time_step_max": 0}
_RAW_LISTS = {"layers_block_type": MAX_LAYERS, "hybrid_override_pattern": MAX_LAYERS,
              "mtp_layers_block_type": MAX_LAYERS}


def check_raw_config(d: dict, where: str = "config.json") -> None:
    """One-line RemodelError naming the key and `where` for a config.json value of the wrong JSON type
    (a string, list or bool where a number belongs) or out of bounds (models.config's MAX_*)."""
    def bad(key, why):
        raise RemodelError(f"{where}: {key!r} {why}")

    for key, (lo, hi) in _RAW_INTS.items():
        v = d.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            bad(key, f"expected int, got {type(v).__name__} {v!r}")
        if not lo <= v <= hi:
            bad(key, f"must be in {lo}..{hi:,}, got {v}")
    rope = d.get("rope_parameters")
    floats = {**d, "rope_theta": rope.get("rope_theta") if isinstance(rope, dict) else d.get("rope_theta")}
    for key, lo in _RAW_FLOATS.items():
        v = floats.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            bad(key, f"expected a number, got {type(v).__name__} {v!r}")
        if math.isnan(v) or v <= lo or (math.isinf(v) and key != "time_step_max"):
            bad(key, f"must be finite and {'>= 0' if lo < 0 else '> 0'}, got {v!r}")
    for key, most in _RAW_LISTS.items():
        v = d.get(key)
        if v is None:
            continue
        want = str if key == "hybrid_override_pattern" else list
        if not isinstance(v, want) or (want is list and not all(isinstance(x, str) for x in v)):
            bad(key, f"expected {'a string' if want is str else 'a list of layer-type strings'}, got "
                     f"{type(v).__name__}")
        if len(v) > most:
            bad(key, f"has {len(v):,} layers, at most {most:,}")
        if isinstance(v, list) and set(v) - set(_CHAR):
            bad(key, f"has unknown layer types {sorted(set(v) - set(_CHAR))} (known: {', '.join(_CHAR)})")


def _hf_config(d: dict, where: str = "config.json"):
    from transformers import AutoConfig, PretrainedConfig

    d = PretrainedConfig._decode_special_floats(d)  # {"__float__": "Infinity"} as transformers writes it
    mt = d.get("model_type")
    if mt not in FAMILIES:
        raise RemodelError(f"unsupported model_type {mt!r} (supported: {', '.join(FAMILIES)})")
    d = {k: v for k, v in d.items() if k not in ("model_type", "architectures", "transformers_version")}
    check_raw_config(d, where)
    try:
        h = AutoConfig.for_model(mt, **d)
    except Exception as e:  # transformers' own validation ("Validation error for field 'x':\n  TypeError: ...")
        msg = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise RemodelError(f"invalid {mt} config: {msg}") from None
    _require(d, h, mt)
    return h


# Fields that set the shapes: transformers fills in defaults for the model it describes (hidden_size
# 4096, ...), which would silently describe another model than the weights; alternatives in a tuple.
_NEED = {"M": (("mamba_num_heads",), ("mamba_head_dim",)), "*": (("num_attention_heads",),),
         "-": (("intermediate_size",),), "E": (("n_routed_experts",), ("moe_intermediate_size",),
                                               ("num_experts_per_tok",))}
_NEED_LLAMA = {"mixtral": (("num_local_experts",), ("num_experts_per_tok",), ("intermediate_size",)),
               "qwen2_moe": (("num_experts",), ("num_experts_per_tok",), ("moe_intermediate_size",)),
               "qwen3_moe": (("num_experts",), ("num_experts_per_tok",), ("moe_intermediate_size",))}


def _require(d: dict, h, mt: str):
    """One-line RemodelError naming the first shape-defining field the raw config.json lacks."""
    need = [("vocab_size",), ("hidden_size",)]
    if mt == "nemotron_h":
        need.append(("layers_block_type", "hybrid_override_pattern"))
        for t in dict.fromkeys(h.layers_block_type):
            need += _NEED.get(_CHAR.get(t, ""), ())
    else:
        need += [("num_hidden_layers",), ("num_attention_heads",)]
        need += _NEED_LLAMA.get(mt, (("intermediate_size",),))
    amap = dict(getattr(h, "attribute_map", {}) or {})  # e.g. qwen3_moe saves num_experts as num_local_experts
    for alts in need:
        alts = tuple(dict.fromkeys([*alts, *(amap[k] for k in alts if k in amap),
                                    *(x for x, t in amap.items() if t in alts)]))
        if not any(d.get(k) is not None for k in alts):
            raise RemodelError(f"{mt} config has no {' or '.join(map(repr, alts))}: it sets the model's shapes "
                               f"(transformers would assume {getattr(h, alts[0], None)!r}); add it to config.json")


def _rope(h) -> tuple[float, dict | None]:
    rp = dict(getattr(h, "rope_parameters", None) or {})
    theta = rp.get("rope_theta", getattr(h, "rope_theta", 10000.0))
    kind = rp.get("rope_type", "default")
    if kind == "default":
        return float(theta), None
    return float(theta), rp  # validated by ModelConfig (only llama3 is supported)


def config_from_hf(d: dict, source=None) -> ModelConfig:
    """HF config.json dict -> ModelConfig (one-line RemodelError when unsupported or out of bounds, naming
    the key and `source`, the file it came from: "config.json" when not given). Checked on the raw JSON
    (check_raw_config), by transformers' config class, then by ModelConfig.validate: before any weight."""
    where = str(source) if source is not None else "config.json"
    h = _hf_config(d, where)
    extra = {k: getattr(h, k) for k in PASSTHROUGH if getattr(h, k, None) is not None}
    try:
        return _nemotron_h_config(h, extra) if h.model_type == "nemotron_h" else _llama_config(h, extra)
    except RemodelError as e:
        raise RemodelError(f"{where}: {e}") from None


def _nemotron_h_config(h, extra: dict) -> ModelConfig:
    """ModelConfig of a transformers NemotronHConfig (no RoPE, squared-ReLU MLPs, sigmoid router, MTP)."""
    if getattr(h, "mamba_hidden_act", "silu") != "silu":
        raise RemodelError(f"unsupported mamba_hidden_act {h.mamba_hidden_act!r} (only silu)")
    mtp = int(getattr(h, "num_nextn_predict_layers", 0) or 0)
    if getattr(h, "num_nextn_predict_layers_dropped", 0):  # declared, but the checkpoint has no mtp.*
        extra["num_nextn_predict_layers_dropped"] = h.num_nextn_predict_layers_dropped
    mtp_pattern = "".join(_CHAR[t] for t in h.mtp_layers_block_type) if mtp else ""
    if h.mlp_bias and "moe" in h.layers_block_type:
        raise RemodelError("nemotron_h with mlp_bias=true and MoE layers is not supported (biased experts)")
    shared = h.moe_shared_expert_intermediate_size or h.intermediate_size  # transformers' fallback
    return ModelConfig(
        vocab_size=h.vocab_size, hidden_size=h.hidden_size,
        pattern="".join(_CHAR[t] for t in h.layers_block_type), norm_eps=h.layer_norm_epsilon,
        tie_word_embeddings=bool(h.tie_word_embeddings),
        num_attention_heads=h.num_attention_heads, num_key_value_heads=h.num_key_value_heads,
        head_dim=h.head_dim, rope_theta=None,
        intermediate_size=h.intermediate_size, mlp_act=h.mlp_hidden_act, mlp_gated=False, mlp_bias=h.mlp_bias,
        mamba_num_heads=h.mamba_num_heads, mamba_head_dim=h.mamba_head_dim, n_groups=h.n_groups,
        ssm_state_size=h.ssm_state_size, conv_kernel=h.conv_kernel, chunk_size=h.chunk_size,
        use_conv_bias=h.use_conv_bias, mamba_proj_bias=h.use_bias, time_step_min=h.time_step_min,
        n_routed_experts=h.n_routed_experts, num_experts_per_tok=h.num_experts_per_tok,
        moe_intermediate_size=h.moe_intermediate_size, moe_shared_expert_intermediate_size=shared,
        moe_latent_size=h.moe_latent_size, router="sigmoid", norm_topk_prob=h.norm_topk_prob,
        routed_scaling_factor=float(h.routed_scaling_factor), n_group=h.n_group, topk_group=h.topk_group,
        mtp_layers=mtp, mtp_pattern=mtp_pattern, extra=extra)


def _llama_config(h, extra: dict) -> ModelConfig:
    """ModelConfig of a Llama-family config: decoder layer j becomes our layers 2j (attention) and
    2j+1 (SwiGLU MLP, or a softmax-routed MoE)."""
    mt = h.model_type
    window = getattr(h, "sliding_window", None) if mt in ("mistral", "mixtral") else None
    if mt.startswith("qwen") and getattr(h, "use_sliding_window", False):
        raise RemodelError(f"{mt} with use_sliding_window=true is not supported (per-layer windows)")
    if getattr(h, "hidden_act", "silu") != "silu":
        raise RemodelError(f"unsupported hidden_act {h.hidden_act!r} for {mt} (only silu)")
    theta, scaling = _rope(h)
    head_dim = getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads
    bias = {"qwen2": True, "qwen2_moe": bool(getattr(h, "qkv_bias", True))}.get(mt, bool(getattr(h, "attention_bias", False)))
    out_bias = bias if mt in ("llama", "mistral", "qwen3", "qwen3_moe", "mixtral") else False
    L = h.num_hidden_layers
    common = dict(vocab_size=h.vocab_size, hidden_size=h.hidden_size, norm_eps=h.rms_norm_eps,
                  tie_word_embeddings=bool(h.tie_word_embeddings),
                  num_attention_heads=h.num_attention_heads, num_key_value_heads=h.num_key_value_heads,
                  head_dim=head_dim, rope_theta=theta, rope_scaling=scaling, attention_bias=bias,
                  attention_out_bias=out_bias, qk_norm=mt in ("qwen3", "qwen3_moe"),
                  mlp_act="silu", mlp_gated=True, mlp_bias=bool(getattr(h, "mlp_bias", False)),
                  sliding_window=window, extra=extra)
    if mt in DENSE_FAMILIES:
        return ModelConfig(pattern="*-" * L, intermediate_size=h.intermediate_size, **common)
    if mt == "mixtral":
        return ModelConfig(pattern="*E" * L, n_routed_experts=h.num_local_experts,
                           num_experts_per_tok=h.num_experts_per_tok, moe_intermediate_size=h.intermediate_size,
                           router="softmax", norm_topk_prob=True, **common)
    if getattr(h, "mlp_only_layers", []) or getattr(h, "decoder_sparse_step", 1) != 1:
        raise RemodelError(f"{mt} with dense layers (mlp_only_layers / decoder_sparse_step) is not supported")
    shared = getattr(h, "shared_expert_intermediate_size", 0) or 0
    return ModelConfig(pattern="*E" * L, n_routed_experts=h.num_experts, num_experts_per_tok=h.num_experts_per_tok,
                       moe_intermediate_size=h.moe_intermediate_size, moe_shared_expert_intermediate_size=shared,
                       shared_expert_gate=mt == "qwen2_moe", router="softmax",
                       norm_topk_prob=bool(h.norm_topk_prob), **common)


def without_absent_mtp(d: dict, tensor_names) -> dict:
    """The HF config of a checkpoint whose config declares MTP layers (num_nextn_predict_layers) but whose
    weights hold no `mtp.*` tensor (e.g. a trunk-only export): MTP off, the declared count recorded in
    `num_nextn_predict_layers_dropped`. MTP is on only when the checkpoint has it."""
    if not (d.get("num_nextn_predict_layers") or 0) or any(k.startswith("mtp.") for k in tensor_names):
        return d
    return {**d, "num_nextn_predict_layers": 0, "num_nextn_predict_layers_dropped": d["num_nextn_predict_layers"]}


def default_family(cfg: ModelConfig) -> str:
    if set(cfg.pattern) & set("M") or cfg.rope_theta is None or not cfg.mlp_gated:
        return "nemotron_h"
    if "E" in cfg.pattern:
        return "qwen3_moe" if cfg.qk_norm else ("qwen2_moe" if cfg.moe_shared_expert_intermediate_size else "mixtral")
    return "qwen3" if cfg.qk_norm else "llama"


def check_exportable(cfg: ModelConfig, family: str) -> None:
    """Refuse (one line) a family that cannot represent this model exactly."""
    def need(ok, why):
        if not ok:
            raise RemodelError(f"cannot export to {family}: {why}")

    need(family in FAMILIES, f"unknown target (supported: {', '.join(FAMILIES)})")
    need(family == "nemotron_h" or not cfg.mtp_layers, "MTP layers are nemotron_h only")
    if family == "nemotron_h":
        need(cfg.rope_theta is None or "*" not in cfg.pattern, "nemotron_h attention has no RoPE")
        need(not (cfg.attention_bias or cfg.attention_out_bias or cfg.qk_norm), "nemotron_h attention has no bias or q/k norm")
        need(not cfg.mlp_gated, "nemotron_h MLPs and experts are not gated (SwiGLU models go to llama/mixtral/qwen)")
        need(cfg.sliding_window is None, "nemotron_h has no sliding-window attention")
        need(not (cfg.mlp_bias and "E" in cfg.pattern), "nemotron_h MoE layers with MLP bias are not supported")
        need("E" not in cfg.pattern or (cfg.router == "sigmoid" and not cfg.shared_expert_gate),
             "nemotron_h MoE uses the sigmoid router without a shared-expert gate")
        return
    L = cfg.num_layers // 2
    want = "*-" if family in DENSE_FAMILIES else "*E"
    need(cfg.num_layers % 2 == 0 and cfg.pattern == want * L, f"needs the layer pattern {want!r} * N, got {cfg.pattern!r}")
    need(cfg.rope_theta is not None, "needs RoPE attention")
    need(cfg.sliding_window is None or family in ("mistral", "mixtral"), "sliding-window attention is mistral/mixtral only")
    need(cfg.mlp_gated and cfg.mlp_act == "silu", "needs SwiGLU MLPs")
    need(cfg.qk_norm == (family in ("qwen3", "qwen3_moe")), "q/k norm must match (only qwen3 families have it)")
    if family == "qwen2":
        need(cfg.attention_bias and not cfg.attention_out_bias, "qwen2 has q/k/v bias and no o_proj bias")
    elif family == "qwen2_moe":
        need(not cfg.attention_out_bias, "qwen2_moe has no o_proj bias")
    else:
        need(cfg.attention_bias == cfg.attention_out_bias, "q/k/v and o_proj bias must match")
    need(not cfg.mlp_bias, "MLP bias is not supported by this family")
    if family in MOE_FAMILIES:
        need(cfg.router == "softmax" and cfg.n_group == 1, "needs a softmax router without expert groups")
        need(cfg.routed_scaling_factor == 1.0, "routed_scaling_factor must be 1")
        need(cfg.moe_latent_size is None, "latent MoE projections are nemotron_h only")
        if family == "mixtral":
            need(cfg.norm_topk_prob, "mixtral always renormalises the top-k weights")
            need(not cfg.moe_shared_expert_intermediate_size, "mixtral has no shared expert (use qwen2_moe)")
        if family == "qwen3_moe":
            need(not cfg.moe_shared_expert_intermediate_size, "qwen3_moe has no shared expert (use qwen2_moe)")
        need(cfg.shared_expert_gate == (family == "qwen2_moe") or not cfg.moe_shared_expert_intermediate_size,
             "shared-expert gate must match the family")


def config_to_hf(cfg: ModelConfig, family: str) -> dict:
    """ModelConfig -> HF config.json dict, built and checked by transformers' config class."""
    check_exportable(cfg, family)
    d = {k: v for k, v in cfg.extra.items() if k in PASSTHROUGH}
    d.update(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, tie_word_embeddings=cfg.tie_word_embeddings,
             architectures=[ARCH[family]])
    if family == "nemotron_h":
        d.update(layers_block_type=[_TYPE[c] for c in cfg.pattern], layer_norm_epsilon=cfg.norm_eps,
                 num_attention_heads=cfg.num_attention_heads or 1, num_key_value_heads=cfg.num_key_value_heads or 1,
                 head_dim=cfg.head_dim or 1, intermediate_size=cfg.intermediate_size or 1,
                 mlp_hidden_act=cfg.mlp_act, mlp_bias=cfg.mlp_bias,
                 mamba_num_heads=cfg.mamba_num_heads or 1, mamba_head_dim=cfg.mamba_head_dim or 1,
                 n_groups=cfg.n_groups, ssm_state_size=cfg.ssm_state_size or 1, conv_kernel=cfg.conv_kernel,
                 chunk_size=cfg.chunk_size, use_conv_bias=cfg.use_conv_bias, use_bias=cfg.mamba_proj_bias,
                 time_step_min=cfg.time_step_min)
        if "E" in cfg.pattern:
            d.update(n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                     moe_intermediate_size=cfg.moe_intermediate_size,
                     moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size or 1,
                     moe_latent_size=cfg.moe_latent_size, norm_topk_prob=cfg.norm_topk_prob,
                     routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.n_group, topk_group=cfg.topk_group)
        if cfg.mtp_layers:
            d.update(num_nextn_predict_layers=cfg.mtp_layers, mtp_layers_block_type=[_TYPE[c] for c in cfg.mtp_pattern])
    else:
        rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"} if cfg.rope_scaling is None else dict(cfg.rope_scaling)
        d.update(num_hidden_layers=cfg.num_layers // 2, rms_norm_eps=cfg.norm_eps,
                 num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                 head_dim=cfg.head_dim, rope_parameters=rope, hidden_act="silu")
        if family in ("llama", "qwen3", "qwen3_moe", "mixtral", "mistral"):
            d["attention_bias"] = cfg.attention_bias
        if family in ("mistral", "mixtral"):
            d["sliding_window"] = cfg.sliding_window
        if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
            d["use_sliding_window"] = False
        if family in DENSE_FAMILIES:
            d["intermediate_size"] = cfg.intermediate_size
        elif family == "mixtral":
            d.update(num_local_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                     intermediate_size=cfg.moe_intermediate_size)
        else:
            d.update(num_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                     moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                     intermediate_size=cfg.moe_intermediate_size, decoder_sparse_step=1, mlp_only_layers=[])
            if family == "qwen2_moe":
                d.update(shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size or 1,
                         qkv_bias=cfg.attention_bias)
    h = _hf_config({"model_type": family, **d})
    out = json.loads(h.to_json_string(use_diff=False))
    out["architectures"] = [ARCH[family]]
    return out


# ---- tensor names (models.hf_adapter; re-exported here, where callers import them) -----------------

def our_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Every parameter of our model definition with its shape (models.layout; the MTP blocks last)."""
    return shapes(cfg)
