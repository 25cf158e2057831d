"""The one configuration every remodel model is described by.

A model is a stack of pre-norm residual layers, one character each in `pattern`:
  M  Mamba-2 mixer            *  GQA self-attention (RoPE or none)
  -  dense MLP (relu2/SwiGLU)  E  mixture of experts (+ optional shared expert)
  P  attention and Mamba-2 in parallel on the same input, their outputs summed (Falcon-H1)
A Llama decoder layer is the pair "*-" (its two norms are the two layers' norms), so Llama,
Mistral and Qwen2 are the pattern "*-" * L, and Mixtral / Qwen-MoE are "*E" * L.
Widths are homogeneous across layers of one type (what Minitron / MiniPuzzle prune to).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

from .errors import RemodelError
from .kinds import KINDS, used

# Bounds of a config's sizes: far above any real model, low enough that nothing allocates or loops
# without bound on a hostile config.json (models.hf checks the raw JSON against them too).
MAX_VOCAB = 2**24
MAX_WIDTH = 2**20  # hidden, FFN, expert FFN, shared expert, latent
MAX_SMALL = 2**16  # heads, head dims, groups, SSM state, experts, top-k
MAX_LAYERS = 8192  # pattern characters (a Llama decoder layer is two)
MAX_MTP = 64
# int field -> (lo, hi); 0 allowed where the field is unused by the pattern (validate checks use)
INT_BOUNDS = {"vocab_size": (1, MAX_VOCAB), "hidden_size": (1, MAX_WIDTH), "intermediate_size": (0, MAX_WIDTH),
              "moe_intermediate_size": (0, MAX_WIDTH), "moe_shared_expert_intermediate_size": (0, MAX_WIDTH),
              "moe_latent_size": (1, MAX_WIDTH), "num_attention_heads": (0, MAX_SMALL),
              "num_key_value_heads": (0, MAX_SMALL), "head_dim": (0, MAX_SMALL), "mamba_num_heads": (0, MAX_SMALL),
              "mamba_head_dim": (0, MAX_SMALL), "n_groups": (1, MAX_SMALL), "ssm_state_size": (0, MAX_SMALL),
              "conv_kernel": (1, 1024), "chunk_size": (1, MAX_WIDTH), "n_routed_experts": (0, MAX_SMALL),
              "num_experts_per_tok": (0, MAX_SMALL), "n_group": (1, MAX_SMALL), "topk_group": (1, MAX_SMALL),
              "mtp_layers": (0, MAX_MTP), "sliding_window": (1, 2**40)}
# Falcon-H1's multipliers (ModelConfig fields): the scalar ones, and the vectors with their lengths
SCALARS = ("key_multiplier", "attention_in_multiplier", "attention_out_multiplier", "ssm_in_multiplier",
           "ssm_out_multiplier", "lm_head_multiplier")
VECTORS = {"ssm_multipliers": 5, "mlp_multipliers": 2}


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    pattern: str
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # attention ('*')
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    rope_theta: float | None = None  # None: no positional encoding (Nemotron-H)
    rope_scaling: dict | None = None  # HF rope_parameters beyond "default" (only "llama3" supported)
    partial_rotary_factor: float = 1.0  # RoPE on the first int(head_dim * this) channels of each head (Bamba: 0.5)
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    attention_out_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    sliding_window: int | None = None  # Mistral / Mixtral: attend to the last `sliding_window` keys
    # dense MLP ('-')
    intermediate_size: int = 0
    mlp_act: str = "relu2"
    mlp_gated: bool = False  # SwiGLU-style: down(act(gate(x)) * up(x))
    mlp_bias: bool = False
    # Mamba-2 ('M')
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    n_groups: int = 1
    ssm_state_size: int = 0
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_min: float = 0.001  # lower clamp of dt (transformers' nemotron_h)
    time_step_max: float = float("inf")  # upper clamp of dt
    mamba_rms_norm: bool = True  # the gated group RMSNorm before out_proj (False: y * silu(z) alone, Falcon-H1)
    mamba_norm_before_gate: bool = False  # normalise y, then gate (Falcon-H1's option); False: gate first
    # MoE ('E')
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0  # 0: no shared expert
    moe_latent_size: int | None = None
    router: str = "sigmoid"  # sigmoid (Nemotron-H / DeepSeek-V3) or softmax (Mixtral / Qwen)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_expert_gate: bool = False  # Qwen2-MoE: shared output scaled by sigmoid(w.x)
    # MTP (multi-token prediction, Nemotron 3 Super): `mtp_layers` steps of the `mtp_pattern` blocks
    # after the trunk, sharing its widths, embeddings and lm_head (models/mtp.py); 0: none
    mtp_layers: int = 0
    mtp_pattern: str = ""
    # scalar multipliers (Granite; 1 / None elsewhere): the embeddings times embedding_multiplier, every
    # layer's output times residual_multiplier before it joins the residual stream, attention scores times
    # attention_scale (None: 1/sqrt(head_dim)), logits divided by logits_scaling. Part of the model, not
    # of its weights: training keeps them as they are.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None
    logits_scaling: float = 1.0
    # Falcon-H1's per-projection multipliers (plain elsewhere), applied in forward like the scalars above:
    # keys times key_multiplier (Attention), the Mamba in_proj output segments (in the spec's order) times
    # ssm_multipliers (Mamba2Mixer), the gate_proj and down_proj outputs times mlp_multipliers (MLP), the
    # parallel mixer's attention / Mamba input and output times attention_in/out and ssm_in/out
    # (models/parallel_mixer.py), the logits times lm_head_multiplier.
    key_multiplier: float = 1.0
    ssm_multipliers: tuple = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp_multipliers: tuple = (1.0, 1.0)
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    # HF fields carried through untouched (bos/eos ids, max positions, ...)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in VECTORS:  # a list from JSON is the same vector
            if isinstance(getattr(self, name), list):
                setattr(self, name, tuple(getattr(self, name)))
        self.validate()

    # ---- derived sizes -------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    @property
    def mamba_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def moe_input_size(self) -> int:
        return self.moe_latent_size or self.hidden_size

    @property
    def mtp_full_pattern(self) -> str:
        """Every MTP block in order (vLLM numbers them flat: mtp.layers.0 .. len-1)."""
        return self.mtp_pattern * self.mtp_layers

    def count(self, layer_char: str) -> int:
        return self.pattern.count(layer_char)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if math.isinf(d["time_step_max"]):
            d["time_step_max"] = "inf"
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        if d.get("time_step_max") == "inf":
            d["time_step_max"] = float("inf")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise RemodelError(f"unknown remodel config fields: {sorted(unknown)}")
        return cls(**d)

    # ---- validation: one line naming the problem -------------------------------------
    def validate(self) -> None:
        def need(ok, msg):
            if not ok:
                raise RemodelError(f"invalid config: {msg}")

        self._check_numbers(need)
        need(len(self.pattern) > 0, "the layer pattern is empty")
        bad = sorted(set(self.pattern + self.mtp_pattern) - set(KINDS))
        need(not bad, f"unknown layer characters {bad} in pattern (allowed: {' '.join(KINDS)})")
        need(self.mtp_layers >= 0 and bool(self.mtp_layers) == bool(self.mtp_pattern),
             "MTP needs both mtp_layers > 0 and a non-empty mtp_pattern (or neither)")
        need(set(self.mtp_pattern) <= set(self.pattern),
             f"MTP layer types {self.mtp_pattern!r} must also occur in the trunk (they share its widths)")
        need(not self.mtp_layers or (self.logits_scaling, self.embedding_multiplier, self.lm_head_multiplier) == (1, 1, 1),
             "MTP layers read the trunk's final hidden states and embeddings unscaled: logits_scaling, "
             "embedding_multiplier and lm_head_multiplier must be 1")
        for k in used(self):
            k.validate(self, need)

    def _check_numbers(self, need) -> None:
        """Every size an int (not bool) within INT_BOUNDS, every float finite and in range, the pattern
        bounded: before anything is allocated from them."""
        for name, (lo, hi) in INT_BOUNDS.items():
            v = getattr(self, name)
            if v is None and name in ("moe_latent_size", "sliding_window"):
                continue
            need(not isinstance(v, bool) and isinstance(v, numbers.Integral),
                 f"{name} expected int, got {type(v).__name__} {v!r}")
            need(lo <= v <= hi, f"{name} must be in {lo}..{hi:,}, got {v}")
        for name in ("pattern", "mtp_pattern"):
            need(isinstance(getattr(self, name), str), f"{name} must be a string")
        need(len(self.pattern) <= MAX_LAYERS and len(self.mtp_pattern) <= MAX_LAYERS,
             f"{len(self.pattern)} layers (pattern length), at most {MAX_LAYERS}")
        floats = {"norm_eps": (0, 1), "rope_theta": (0, None), "routed_scaling_factor": (0, None),
                  "partial_rotary_factor": (0, None), "time_step_min": (None, None), "time_step_max": (0, "inf"),
                  **dict.fromkeys(("embedding_multiplier", "residual_multiplier", "attention_scale",
                                   "logits_scaling", *SCALARS), (0, None))}
        for name, (lo, hi) in floats.items():
            v = getattr(self, name)
            if v is None and name in ("rope_theta", "attention_scale"):
                continue
            ok = not isinstance(v, bool) and isinstance(v, numbers.Real) and not math.isnan(v)
            ok = ok and (math.isfinite(v) or hi == "inf") and (lo is None or v > lo)
            ok = ok and (hi in (None, "inf") or v < hi) and (name != "time_step_min" or v >= 0)
            need(ok, f"{name} must be a finite number{f' > {lo}' if lo is not None else ' >= 0'}"
                     f"{f' and < {hi}' if hi not in (None, 'inf') else ''}, got {v!r}")
        for name, n in VECTORS.items():
            v = getattr(self, name)
            ok = isinstance(v, tuple) and len(v) == n and all(
                not isinstance(x, bool) and isinstance(x, numbers.Real) and math.isfinite(x) and x > 0 for x in v)
            need(ok, f"{name} must be {n} finite numbers > 0, got {v!r}")
