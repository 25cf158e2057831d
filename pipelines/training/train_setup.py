"""The checks and derived settings of a training run, before any heavy work and with nothing written but
the lock on OUT.run (rank 0 takes it: a second run writing the same OUT refuses; Plan.release drops it).

`prepare` turns a TrainConfig into a `Plan`: the resolved budget (steps), schedule and loss-weight
defaults, absolute paths, the device and the argument record that checkpoints and the report keep.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from remodel.models.families.tower import check_tower_at
from remodel.models.errors import RemodelError
from remodel.models.kinds import routed
from remodel.models.hf import our_shapes
from remodel.models.load import load_config, read_config_dict

from . import train_state as state
from ..distributed.runtime import RunLock, check_out, pick_device
from .train_config import MAX_STEPS, TrainConfig


def default_layer_map(n_student: int, n_teacher: int) -> list[tuple[int, int]]:
    """Pairs (student state, teacher state) over the residual-stream states (0 = embeddings, i = after
    layer i): every student layer i to teacher layer round(i * Lt / Ls), so the last maps to the last."""
    return [(i, round(i * n_teacher / n_student)) for i in range(1, n_student + 1)]



@dataclass
class Plan:
    """What `prepare` derives from a TrainConfig: resolved budget and defaults, paths, the record."""
    cfg: TrainConfig
    out: Path
    student_dir: Path
    teacher_dir: Path | None
    steps: int
    warmup: int
    min_lr: float
    lm_loss_weight: float
    kl_weight: float
    checkpoint_every: int
    layer_map: list | None
    tokens_per_step: int
    family: str
    vocab_size: int
    run_dir: Path
    dev: torch.device
    use_bf16: bool
    args: dict  # what checkpoints and the report record
    t_start: float
    lock: RunLock | None = None  # rank 0's lock on run_dir, held until release()
    marked: bool = False  # this run wrote run_dir's RUN_MARKER (when its training began: a refusal writes none)
    saved: bool = False  # this run wrote (or cleared for) a checkpoint in run_dir

    def mark(self):
        """Rank 0, when training begins (every refusal behind): record run_dir as remodel's (RUN_MARKER)."""
        if self.lock is not None:
            self.marked = state.mark_run_dir(self.run_dir) or self.marked

    def release(self):
        """Drop the lock on run_dir (rank 0; idempotent); a marker this run wrote goes when it saved nothing
        (the run dir is then as it found it) or when the run dir holds nothing else."""
        if self.lock is not None:
            if self.marked:
                state.unmark_unused(self.run_dir, always=not self.saved)
                self.marked = False
            self.lock.release()

    @property
    def distill(self) -> bool:
        return self.teacher_dir is not None

    @property
    def inputs(self) -> list[Path]:
        return [self.student_dir] + ([self.teacher_dir] if self.distill else [])


def _positive(**kw):
    for k, v in kw.items():
        if v is not None and not v > 0:
            raise RemodelError(f"--{k.replace('_', '-')} must be > 0, got {v}")


def _budget(steps, tokens, tokens_per_step: int) -> int:
    if (steps is None) == (tokens is None):
        raise RemodelError("give exactly one of --steps or --tokens as the training budget")
    if steps is not None:
        if steps < 1:
            raise RemodelError(f"--steps must be >= 1, got {steps}")
        return int(steps)
    if tokens < 1:
        raise RemodelError(f"--tokens must be >= 1, got {tokens}")
    steps = max(1, -(-int(tokens) // tokens_per_step))
    if steps > MAX_STEPS:  # a run that would never end (and checkpoint every steps // 10): refused up front
        raise RemodelError(f"--tokens {tokens} at {tokens_per_step} tokens per step (--batch x --grad-accum x "
                           f"--seq-len) is {steps} steps, more than {MAX_STEPS}")
    return steps


def trained_params(student, train_only) -> dict:
    """{name: parameter} the optimizer steps: those named by a prefix in `train_only` (the rest frozen, no
    gradient, no AdamW state), or every one when it is None."""
    if train_only is None:
        return dict(student.named_parameters())
    out = {}
    for name, q in student.named_parameters():
        q.requires_grad_(any(name.startswith(x) for x in train_only))
        if q.requires_grad:
            out[name] = q
    return out


def _check_train_only(c: TrainConfig, s_cfg) -> None:
    """Every prefix of train_only names some parameter of the student (a typo would freeze the whole model)."""
    if c.train_only is None:
        return
    names = list(our_shapes(s_cfg))
    listed = isinstance(c.train_only, (list, tuple)) and len(c.train_only) > 0
    bad = [x for x in c.train_only if not (isinstance(x, str) and x and any(n.startswith(x) for n in names))] \
        if listed else []
    if bad or not listed:
        raise RemodelError(f"train_only: {bad or c.train_only!r} names no parameter of the student (a list of name "
                           "prefixes, e.g. ['layers.0.mixer.'])")


def _layer_map(c: TrainConfig, s_cfg, t_cfg):
    layer_map = [tuple(p) for p in (c.layer_map or default_layer_map(s_cfg.num_layers, t_cfg.num_layers))]
    bad = [p for p in layer_map if not (0 <= p[0] <= s_cfg.num_layers and 0 <= p[1] <= t_cfg.num_layers)]
    if bad:
        raise RemodelError(f"layer_map pairs {bad} are outside the student ({s_cfg.num_layers}) or "
                           f"teacher ({t_cfg.num_layers}) layers")
    return layer_map


def _forced_map(c: TrainConfig, s_cfg, t_cfg):
    """forced_layers checked against both models (layer i of the student reads the teacher's input to its layer i:
    the same depth and width); -> the hidden loss's pairs, each forced layer's output state in both streams."""
    n, same = s_cfg.num_layers, (s_cfg.num_layers, s_cfg.hidden_size) == (t_cfg.num_layers, t_cfg.hidden_size)
    ok = isinstance(c.forced_layers, (list, tuple)) and len(c.forced_layers) > 0
    if not ok or not same or any(not isinstance(i, int) or not 0 <= i < n for i in c.forced_layers):
        raise RemodelError(f"forced_layers: {c.forced_layers!r} must be a non-empty list of layer indices of a student "
                           f"as deep and wide as its teacher ({n} / {t_cfg.num_layers} layers, hidden "
                           f"{s_cfg.hidden_size} / {t_cfg.hidden_size})")
    return [(i + 1, i + 1) for i in sorted(set(c.forced_layers))]


def _check_teacher(student_dir: Path, teacher_dir: Path, s_cfg):
    t_cfg = load_config(teacher_dir)
    if t_cfg.vocab_size != s_cfg.vocab_size:
        raise RemodelError(f"teacher vocab_size {t_cfg.vocab_size} != student vocab_size {s_cfg.vocab_size}: "
                           "logit distillation needs the same tokenizer")
    st, tt = student_dir / "tokenizer.json", teacher_dir / "tokenizer.json"
    if st.is_file() and tt.is_file() and st.read_bytes() != tt.read_bytes():
        raise RemodelError(f"{teacher_dir} and {student_dir} have different tokenizers")
    return t_cfg


def prepare(c: TrainConfig) -> Plan:
    """Every argument check of a run, before any heavy work and with nothing written; derived settings."""
    t_start = time.time()
    out = Path(c.out).absolute()
    student_dir = Path(c.student_dir).absolute()
    teacher_dir = Path(c.teacher_dir).absolute() if c.distill else None
    lm_w = (0.0 if c.distill else 1.0) if c.lm_loss_weight is None else float(c.lm_loss_weight)
    kl_w = float(c.kl_weight) if c.distill else 0.0
    _positive(seq_len=c.seq_len, batch=c.batch, grad_accum=c.grad_accum, lr=c.lr, temperature=c.temperature,
              checkpoint_every=c.checkpoint_every, eval_tokens=c.eval_tokens)
    if c.seq_len < 2:
        raise RemodelError(f"--seq-len must be >= 2 for next-token training, got {c.seq_len}")
    tokens_per_step = c.batch * c.grad_accum * c.seq_len
    steps = _budget(c.steps, c.tokens, tokens_per_step)
    min_lr = c.lr / 10 if c.min_lr is None else float(c.min_lr)
    warmup = min(100, steps // 10) if c.warmup is None else min(int(c.warmup), steps)
    checkpoint_every = c.checkpoint_every or max(1, steps // 10)
    _check_options(c, min_lr, warmup, kl_w, lm_w)
    s_cfg = load_config(student_dir)
    _check_train_only(c, s_cfg)
    family = read_config_dict(student_dir)["model_type"]
    check_tower_at(student_dir, s_cfg, family)  # a vision tower carried to OUT: as transformers builds it, finite
    layer_map = None
    if c.distill:
        t_cfg = _check_teacher(student_dir, teacher_dir, s_cfg)
        if c.hidden_loss_weight:
            layer_map = _forced_map(c, s_cfg, t_cfg) if c.forced_layers is not None else _layer_map(c, s_cfg, t_cfg)
    plan_inputs = [student_dir] + ([teacher_dir] if c.distill else [])
    check_out(out, c.overwrite, plan_inputs)
    run_dir = state.run_dir_for(out)
    state.check_run_dir(run_dir, out, _run_inputs(c, student_dir, teacher_dir))
    dev = pick_device(c.device)
    use_bf16 = dev.type == "cuda" and (c.bf16 is True or (c.bf16 == "auto" and torch.cuda.is_bf16_supported()))
    p = Plan(c, out, student_dir, teacher_dir, steps, warmup, min_lr, lm_w, kl_w, checkpoint_every, layer_map,
             tokens_per_step, family, s_cfg.vocab_size, run_dir, dev, use_bf16, {}, t_start)
    p.lock = _lock(run_dir, out)
    try:
        if state.list_checkpoints(run_dir) and not c.resume and not c.overwrite:
            raise RemodelError(f"{run_dir} holds checkpoints of an earlier run: pass --resume to continue it "
                               "or --overwrite to start over")
        p.args = _record(p, moe=routed(s_cfg))  # (run_dir is marked when training begins: Plan.mark)
    except BaseException:
        p.release()
        raise
    return p


def _run_inputs(c: TrainConfig, student_dir: Path, teacher_dir: Path | None) -> list[tuple[str, Path]]:
    """(what, path) of every file input of a run: none may lie inside the run directory."""
    rows = [("--student" if teacher_dir is not None else "MODEL", student_dir)]
    rows += [("--teacher", teacher_dir)] if teacher_dir is not None else []
    for name, v in (("--data", c.data), ("--eval-data", c.eval_data)):
        if isinstance(v, (str, Path)) and Path(v).expanduser().exists():
            rows.append((name, Path(v)))
    return rows


def _lock(run_dir: Path, out: Path) -> RunLock | None:
    """The lock on run_dir, taken by the single process or rank 0 of torchrun (RANK: the process group
    does not exist yet) after every check that needs no lock, before any heavy work."""
    if int(os.environ.get("RANK", "0") or 0) != 0:
        return None
    return RunLock(run_dir, out).acquire()


def _check_options(c: TrainConfig, min_lr: float, warmup: int, kl_w: float, lm_w: float):
    """The checks of options that need no file: one-line RemodelErrors."""
    if min_lr < 0 or min_lr > c.lr or warmup < 0 or c.weight_decay < 0 or c.keep_last < 0:
        raise RemodelError(f"need 0 <= --min-lr <= --lr, --warmup >= 0, --weight-decay >= 0, --keep-last >= 0 "
                           f"(got min_lr={min_lr}, lr={c.lr}, warmup={warmup}, weight_decay={c.weight_decay}, "
                           f"keep_last={c.keep_last})")
    if c.topk is not None and c.topk < 1:
        raise RemodelError(f"--topk must be >= 1, got {c.topk}")
    if (c.fp8 or c.fp8_teacher) and (pick_device(c.device).type != "cuda" or c.tp > 1):
        raise RemodelError("--fp8 / --fp8-teacher need a CUDA GPU with FP8 matmuls (H100-class) and --tp 1 "
                           "(FSDP / one process) for now")
    if c.fused_loss and c.topk:
        raise RemodelError("--fused-loss computes the full-vocabulary KL; drop --topk or --fused-loss")
    if not c.distill and (c.hidden_loss_weight or c.topk):
        raise RemodelError("--hidden-loss-weight and --topk need a teacher (distill)")
    if c.forced_layers is not None and (not c.hidden_loss_weight or kl_w or lm_w or c.tp > 1):
        raise RemodelError("forced_layers (teacher forcing) trains on the hidden loss alone, with one tensor-parallel "
                           "rank: needs a teacher, hidden_loss_weight > 0, kl_weight = lm_loss_weight = 0 and --tp 1")
    if kl_w == 0 and lm_w == 0 and not c.hidden_loss_weight:
        raise RemodelError("every loss weight is zero: nothing to train")
    from remodel.models.recompute import RECOMPUTE_MODES
    if c.recompute not in RECOMPUTE_MODES:
        raise RemodelError(f"--recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {c.recompute!r}")
    from .loggers import check_loggers
    check_loggers(c)  # --log-dir / --wandb-project: their package present


def _record(p: Plan, moe: bool) -> dict:
    """The run's arguments as checkpoints and the report record them (resolved defaults included)."""
    c = p.cfg
    return {"student_dir": str(p.student_dir), "teacher_dir": str(p.teacher_dir) if c.distill else None,
            "data": str(Path(c.data).absolute()) if isinstance(c.data, (str, Path)) else repr(c.data),
            "out": str(p.out), "steps": p.steps, "seq_len": c.seq_len, "batch": c.batch, "grad_accum": c.grad_accum,
            "lr": c.lr, "min_lr": p.min_lr, "warmup": p.warmup, "weight_decay": c.weight_decay,
            "grad_clip": c.grad_clip, "temperature": c.temperature, "kl_weight": p.kl_weight,
            "lm_loss_weight": p.lm_loss_weight, "hidden_loss_weight": c.hidden_loss_weight,
            "layer_map": [list(x) for x in p.layer_map or []] or None, "forced_layers": c.forced_layers,
            "topk": c.topk, "lb_coeff": c.lb_coeff if moe else 0.0, "z_coeff": c.z_coeff,
            "checkpoint_every": p.checkpoint_every, "keep_last": c.keep_last, "seed": c.seed,
            "eval_data": str(c.eval_data) if c.eval_data is not None else None, "eval_tokens": c.eval_tokens,
            "recompute": c.recompute, "device": str(p.dev), "bf16": p.use_bf16}
