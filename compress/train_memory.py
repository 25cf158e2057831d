"""Training memory per rank of `remodel distill` / `train`, by arithmetic alone: the figure clusters are
sized by (`plan --train-memory-gb`) and the one distill's report sets beside what its ranks hold.

Per rank, in bytes (binary GiB when printed):
  state        student parameters * (4 fp32 weights + 4 fp32 grads + 8 AdamW moments) / (tp * dp): the trainer
               keeps fp32 master weights, TP shards over tp and FSDP2 over dp (experts' EP is folded over one
               of the two, so it divides nothing more); TP-replicated norms are counted as sharded (< 0.1%)
  teacher      teacher parameters * 4 (fp32, frozen, no grads or moments) / (tp * dp)
  activations  per layer, what autograd saves for backward, for the rank's micro-batch of tokens
               T = batch / dp * seq_len: T * ACT[mode] * (active layer parameters / hidden) * act_bytes / tp
               (ACT none 3, selective 2; against the bytes per token autograd saves on the 1/32-width 56B -> 47B
               rehearsal student, bench/rehearsal_56b.json, the estimate is 9% (none) and 14% (selective)
               high); with full recomputation T * hidden * act_bytes per layer (its input) plus one
               layer's 'none' figure, recomputed in backward
  logits       T * vocab * 12 / tp: the student's fp32 logits, their log-softmax and the teacher's logits
               (the unfused loss; --fused-loss holds far less)
Not counted: FSDP's unsharded copy of the layer in flight, allocator slack, CUDA context.
Weights and the per-layer terms are additive over layers at a fixed hidden size, which lets the plan search
use them as a budget (compress.search_space).
"""
from __future__ import annotations

from dataclasses import dataclass

from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.kinds import KINDS
from remodel.models.params import count_params, per_layer
from remodel.models.recompute import RECOMPUTE_MODES

STATE_BYTES = 4 + 4 + 8  # fp32 weight, fp32 grad, AdamW exp_avg + exp_avg_sq
TEACHER_BYTES = 4
ACT = {"none": 3, "selective": 2}  # saved activations per token per layer, in units of active params / hidden
LOGIT_BYTES = 12


@dataclass(frozen=True)
class TrainSetup:
    """The job the memory is for: parallel sizes, recomputation, the global micro-batch (sequences over all
    dp ranks, distill's --batch) and sequence length, activation dtype bytes (2: bf16 autocast on CUDA), and
    the teacher's parameter count (0: `remodel train`)."""
    tp: int = 1
    ep: int = 1
    dp: int = 1
    recompute: str = "none"
    batch: int = 8
    seq_len: int = 4096
    act_bytes: int = 2
    teacher_params: int = 0

    def check(self):
        """One-line errors for a layout distill would refuse (pipelines.distributed.runtime.layout's rules)."""
        for name in ("tp", "ep", "dp", "batch", "seq_len", "act_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise RemodelError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise RemodelError(f"--recompute must be one of {', '.join(RECOMPUTE_MODES)}, not {self.recompute!r}")
        if self.ep > 1 and self.ep not in (self.tp, self.dp):
            raise RemodelError(f"--ep {self.ep} must equal --tp {self.tp} or --dp {self.dp}")
        if self.batch % self.dp:
            raise RemodelError(f"--batch {self.batch} is not divisible by --dp {self.dp}")
        return self

    @property
    def tokens(self) -> int:
        """Tokens of one rank's micro-batch."""
        return self.batch // self.dp * self.seq_len


def unit_parts(s: TrainSetup, params: int, active: int, hidden: int) -> tuple[int, int]:
    """Per rank: (state, saved activations) of a layer (or unit) from its parameters, its parameters active per
    token and the hidden size (the same numbers for the plan's search and for a whole model)."""
    per_token = hidden if s.recompute == "full" else ACT[s.recompute] * active // hidden
    return params * STATE_BYTES // (s.tp * s.dp), s.tokens * per_token * s.act_bytes // s.tp


def unit_bytes(s: TrainSetup, params: int, active: int, hidden: int) -> int:
    return sum(unit_parts(s, params, active, hidden))


def base_parts(s: TrainSetup, params: int, vocab: int, hidden: int, largest_active: int) -> dict:
    """Per rank: embeddings / lm_head / final norm state (`params`), logits, the teacher, and under full
    recomputation the one layer recomputed at a time (`largest_active`: the largest layer's active params)."""
    replay = s.tokens * (ACT["none"] * largest_active // hidden) * s.act_bytes // s.tp if s.recompute == "full" else 0
    return {"state": params * STATE_BYTES // (s.tp * s.dp), "logits": s.tokens * vocab * LOGIT_BYTES // s.tp,
            "teacher": s.teacher_params * TEACHER_BYTES // (s.tp * s.dp), "activations": replay}


def base_bytes(s: TrainSetup, params: int, vocab: int, hidden: int, largest_active: int) -> int:
    return sum(base_parts(s, params, vocab, hidden, largest_active).values())


def layer_figures(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(params, active params) of each layer, pre-norm included (as compress.search_space counts a unit)."""
    one, H = per_layer(cfg), cfg.hidden_size
    out = []
    for c in cfg.pattern:
        k = KINDS[c]
        p = one[k.name] + H
        a = p - (one["routed"] - one["routed"] * cfg.moe.num_experts_per_tok // cfg.moe.n_routed_experts
                 if k.routed else 0)
        out.append((p, a))
    return out


def train_memory_bytes(cfg: ModelConfig, setup: TrainSetup, largest_active: int | None = None) -> dict:
    """{total, state, teacher, activations, logits} per rank (bytes) of training `cfg` under `setup`, and
    the setup. largest_active: the layer replayed under full recomputation (default: cfg's largest)."""
    setup.check()
    H = cfg.hidden_size
    layers = layer_figures(cfg)
    largest = max((a for _, a in layers), default=0) if largest_active is None else largest_active
    out = base_parts(setup, count_params(cfg)["total"] - sum(p for p, _ in layers), cfg.vocab_size, H, largest)
    for p, a in layers:
        state, act = unit_parts(setup, p, a, H)
        out["state"] += state
        out["activations"] += act
    return {"total": sum(out.values()), **out, "setup": dict(setup.__dict__)}
