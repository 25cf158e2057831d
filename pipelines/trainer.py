"""The one trainer of `remodel train` (LM loss) and `remodel distill` (logit KD from a frozen teacher).

A single process is the 1-rank case of the same code path; under torchrun the processes form a
("dp", "tp") DeviceMesh (pipelines.runtime) and `parallelize` (pipelines.parallel) shards the models from
outside: the student with TP / EP / FSDP2 over dp, the frozen teacher with TP (and EP over tp) where its
widths allow. Every rank draws the same global micro-batch and trains on its own rows of it, so the data
order is the single-process run's; the logged values are dp means and the clip is the global norm.

AdamW with linear warm-up and cosine decay to min_lr, grad clipping and accumulation, bf16 autocast on
CUDA only. Resumable from `<out>.run/` (pipelines.train_state) at the exact data position. The end result
is a HF checkpoint in OUT with remodel_report.json, metrics.csv and loss.png (written by rank 0).

Loss = kl_weight * KL(teacher||student) + lm_loss_weight * CE + hidden_loss_weight * (1 - cos)
       + lb_coeff * load balancing (student MoE layers) + z_coeff * router z-loss.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from models.errors import RemodelError
from models.load import load_config, load_model, read_config_dict

from . import metrics
from . import train_state as state
from .evaluate import evaluate
from .losses import hidden_cosine_loss, kl_div, lm_loss, load_balancing_loss, topk_kl, z_loss
from .parallel import check_layout, clip_grad_norm_, parallel_info
from .sharded import export_sharded, load_sharded
from .runtime import (check_out, init_dist, init_mesh, layout, load_tokenizer, pick_device, rank,
                      return_freed_memory, source_dtype, wait, wait_group, world_size)
from .train_config import RESUME_KEYS, TrainConfig
from .vocab_parallel import parallel_loss_fns


def lr_at(step: int, steps: int, lr: float, min_lr: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps (step 0 gets lr/warmup), then cosine from lr to min_lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def default_layer_map(n_student: int, n_teacher: int) -> list[tuple[int, int]]:
    """Pairs (student state, teacher state) over the residual-stream states (0 = embeddings, i = after
    layer i): every student layer i to teacher layer round(i * Lt / Ls), so the last maps to the last."""
    return [(i, round(i * n_teacher / n_student)) for i in range(1, n_student + 1)]


def build_projections(student, teacher, layer_map) -> nn.ModuleList | None:
    """A Linear(student width -> teacher width) per mapped pair when the widths differ, else None."""
    hs, ht = student.cfg.hidden_size, teacher.cfg.hidden_size
    if hs == ht:
        return None
    return nn.ModuleList(nn.Linear(hs, ht, bias=False) for _ in layer_map)


def build_optimizer(params: dict[str, nn.Parameter], lr: float, weight_decay: float, betas=(0.9, 0.95)):
    """AdamW; weight decay on matrices (ndim >= 2) only, not on norms, biases, A_log, D, dt_bias."""
    decay = [p for p in params.values() if p.ndim >= 2]
    other = [p for p in params.values() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8)


# ---- the loss of one micro-batch --------------------------------------------------------------

LOSS_FNS = {"kl_div": kl_div, "topk_kl": topk_kl, "lm_loss": lm_loss, "load_balancing_loss": load_balancing_loss}


def compute_losses(student, teacher, ids, w: dict, layer_map=None, projections=None, autocast=None, fns=None):
    """-> (total loss tensor, {name: float}) for one batch of token ids [B, L].
    w: weights {kl, lm, hidden, lb, z, temperature, topk}. The teacher runs under no_grad.
    fns: replacements for the loss functions {kl_div, topk_kl, lm_loss, load_balancing_loss} (same
    signatures; a parallelized run passes vocab_parallel.parallel_loss_fns)."""
    fns = {**LOSS_FNS, **(fns or {})}
    autocast = autocast or torch.autocast("cpu", enabled=False)
    need_states = teacher is not None and w["hidden"] > 0
    if w.get("fused"):
        return _fused_losses(student, teacher, ids, w, layer_map, projections, autocast, fns, need_states)
    with autocast:
        out = student(ids, output_hidden_states=need_states)
        s_logits, s_states = out if need_states else (out, None)
        if teacher is not None:
            with torch.no_grad():
                t_out = teacher(ids, output_hidden_states=need_states)
            t_logits, t_states = t_out if need_states else (t_out, None)
    total = s_logits.new_zeros((), dtype=torch.float32)
    parts = {}
    if teacher is not None:
        kl = (fns["topk_kl"](s_logits, t_logits, w["topk"], w["temperature"]) if w["topk"]
              else fns["kl_div"](s_logits, t_logits, w["temperature"]))
        total = total + w["kl"] * kl
        parts["kl"] = kl.item()
    lm = fns["lm_loss"](s_logits[:, :-1] if w["lm"] > 0 else s_logits[:, :-1].detach(), ids[:, 1:])
    if w["lm"] > 0:
        total = total + w["lm"] * lm
    parts["lm"] = lm.item()
    states = (s_states, t_states, layer_map, projections) if need_states else None
    return _other_losses(student, w, fns, total, parts, states, autocast)


def _fused_losses(student, teacher, ids, w, layer_map, projections, autocast, fns, need_states):
    """compute_losses with the vocabulary losses fused (pipelines.fused_loss): CE and KL from the final
    hidden states in token chunks, so no [tokens, vocab] logits exist for the student or the teacher."""
    from .fused_loss import fused_kl_div, fused_lm_loss, lm_head_weight
    g = w.get("vocab_group")
    with autocast:
        s_h, s_states = student.hidden(ids, output_hidden_states=need_states)
        if teacher is not None:
            with torch.no_grad():
                t_h, t_states = teacher.hidden(ids, output_hidden_states=need_states)
    flat = s_h.reshape(-1, s_h.shape[-1])
    total, parts = s_h.new_zeros((), dtype=torch.float32), {}
    if teacher is not None:
        with autocast:  # the matmuls in the autocast dtype, as the logits path's F.linear
            kl = fused_kl_div(flat, lm_head_weight(student), t_h.reshape(-1, t_h.shape[-1]), lm_head_weight(teacher),
                              w["temperature"], group=g)
        total = total + w["kl"] * kl
        parts["kl"] = kl.item()
    with torch.set_grad_enabled(torch.is_grad_enabled() and w["lm"] > 0), autocast:
        lm = fused_lm_loss(s_h[:, :-1].reshape(-1, s_h.shape[-1]), lm_head_weight(student), ids[:, 1:].reshape(-1),
                           group=g)
    if w["lm"] > 0:
        total = total + w["lm"] * lm
    parts["lm"] = lm.item()
    states = (s_states, t_states, layer_map, projections) if need_states else None
    return _other_losses(student, w, fns, total, parts, states, autocast)


def _other_losses(student, w, fns, total, parts, states, autocast):
    """Adds the hidden-state cosine loss (states: (student's, teacher's, layer_map, projections) or None)
    and the MoE load-balancing and z losses of the student's last forward; -> (total, parts)."""
    if states is not None:
        with autocast:
            hid = hidden_cosine_loss(*states)
        total = total + w["hidden"] * hid
        parts["hidden"] = hid.item()
    moe = student.moe_layers()
    if moe and (w["lb"] > 0 or w["z"] > 0):
        cfg = student.cfg
        logits = [m.router_logits for m in moe]
        if w["lb"] > 0:
            lb = fns["load_balancing_loss"](logits, cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.router)
            total = total + w["lb"] * lb
            parts["lb"] = lb.item()
        if w["z"] > 0:
            z = z_loss(logits)
            total = total + w["z"] * z
            parts["z"] = z.item()
    parts["loss"] = total.item()
    return total, parts


def _dp_mean(values: dict, info, dev) -> dict:
    if info.dp_group is None:
        return values
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=dev)
    dist.all_reduce(t, group=info.dp_group)
    return {k: float(v) / info.dp for k, v in zip(keys, t.tolist())}


@torch.no_grad()
def _clip(student, projections, max_norm, info) -> torch.Tensor:
    """Global-norm clipping of the student's (possibly sharded) gradients plus the (replicated) projections'."""
    max_norm = max_norm if max_norm else float("inf")
    if projections is None:
        return clip_grad_norm_(student, max_norm)
    pgrads = [p.grad for p in projections.parameters() if p.grad is not None]
    if info.dp_group is not None:  # the student's data-parallel mean is FSDP's; the projections' is ours
        for g in pgrads:
            dist.all_reduce(g, group=info.dp_group)
            g.div_(info.dp)
    norm = clip_grad_norm_(student, float("inf")).double()
    total = (norm.square() + sum(g.double().square().sum() for g in pgrads)).sqrt()
    coef = min(1.0, max_norm / (total.item() + 1e-6))
    if coef < 1.0:
        for g in [p.grad for p in student.parameters() if p.grad is not None] + pgrads:
            g.mul_(coef)
    return total.float()


# ---- checks and derived settings (before any heavy work, nothing written) ---------------------

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
    return max(1, math.ceil(tokens / tokens_per_step))


def _layer_map(c: TrainConfig, s_cfg, t_cfg):
    layer_map = [tuple(p) for p in (c.layer_map or default_layer_map(s_cfg.num_layers, t_cfg.num_layers))]
    bad = [p for p in layer_map if not (0 <= p[0] <= s_cfg.num_layers and 0 <= p[1] <= t_cfg.num_layers)]
    if bad:
        raise RemodelError(f"layer_map pairs {bad} are outside the student ({s_cfg.num_layers}) or "
                           f"teacher ({t_cfg.num_layers}) layers")
    return layer_map


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
    if kl_w == 0 and lm_w == 0 and not c.hidden_loss_weight:
        raise RemodelError("every loss weight is zero: nothing to train")
    from models.recompute import RECOMPUTE_MODES
    if c.recompute not in RECOMPUTE_MODES:
        raise RemodelError(f"--recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {c.recompute!r}")
    s_cfg = load_config(student_dir)
    family = read_config_dict(student_dir)["model_type"]
    layer_map = None
    if c.distill:
        t_cfg = _check_teacher(student_dir, teacher_dir, s_cfg)
        if c.hidden_loss_weight:
            layer_map = _layer_map(c, s_cfg, t_cfg)
    plan_inputs = [student_dir] + ([teacher_dir] if c.distill else [])
    check_out(out, c.overwrite, plan_inputs)
    run_dir = state.run_dir_for(out)
    if state.list_checkpoints(run_dir) and not c.resume and not c.overwrite:
        raise RemodelError(f"{run_dir} holds checkpoints of an earlier run: pass --resume to continue it "
                           "or --overwrite to start over")
    dev = pick_device(c.device)
    use_bf16 = dev.type == "cuda" and (c.bf16 is True or (c.bf16 == "auto" and torch.cuda.is_bf16_supported()))
    args = {"student_dir": str(student_dir), "teacher_dir": str(teacher_dir) if c.distill else None,
            "data": str(Path(c.data).absolute()) if isinstance(c.data, (str, Path)) else repr(c.data),
            "out": str(out), "steps": steps, "seq_len": c.seq_len, "batch": c.batch, "grad_accum": c.grad_accum,
            "lr": c.lr, "min_lr": min_lr, "warmup": warmup, "weight_decay": c.weight_decay,
            "grad_clip": c.grad_clip, "temperature": c.temperature, "kl_weight": kl_w, "lm_loss_weight": lm_w,
            "hidden_loss_weight": c.hidden_loss_weight, "layer_map": [list(p) for p in layer_map or []] or None,
            "topk": c.topk, "lb_coeff": c.lb_coeff if "E" in s_cfg.pattern else 0.0, "z_coeff": c.z_coeff,
            "checkpoint_every": checkpoint_every, "keep_last": c.keep_last, "seed": c.seed,
            "eval_data": str(c.eval_data) if c.eval_data is not None else None, "eval_tokens": c.eval_tokens,
            "recompute": c.recompute, "device": str(dev), "bf16": use_bf16}
    return Plan(c, out, student_dir, teacher_dir, steps, warmup, min_lr, lm_w, kl_w, checkpoint_every, layer_map,
                tokens_per_step, family, s_cfg.vocab_size, run_dir, dev, use_bf16, args, t_start)


def _resume_state(p: Plan):
    """-> (checkpoint dir, its meta) to continue from, or Nones; refuses a checkpoint of another
    trajectory (RESUME_KEYS)."""
    if not p.cfg.resume:
        return None, None
    if rank() == 0:
        state.clean_stale(p.run_dir)
    ckpt = state.latest_checkpoint(p.run_dir)
    if ckpt is None:
        return None, None
    meta = state.read_meta(ckpt)
    keys = [k for k in RESUME_KEYS if k in p.args]
    diff = [k for k in keys if meta["args"].get(k) != json.loads(json.dumps(p.args[k]))]
    if diff:
        was = ", ".join(f"{k}={meta['args'].get(k)!r}" for k in diff)
        raise RemodelError(f"cannot resume from {ckpt}: {', '.join(diff)} differ from that run ({was})")
    return ckpt, meta


def _token_data(p: Plan, tokenizer, lead: bool, group):
    """The training tokens on disk: a token set (remodel tokenize), a text DATA tokenized once into the
    cache (rank 0 first, the others then find it), or a blend 'W1 A W2 B ...' of either."""
    from .tokens import Blend, TokenSet, ensure_tokens, is_token_set, parse_blend
    c = p.cfg
    d = c.data
    parts = [(1.0, d)] if is_token_set(d) or Path(d).expanduser().exists() else parse_blend(d)
    for who in ("lead", "rest"):
        if (who == "lead") == lead:
            paths = [(w, ensure_tokens(x, tokenizer, num_proc=c.num_proc, doc_split=c.doc_split)) for w, x in parts]
        wait(group)
    sets = [(w, TokenSet(x)) for w, x in paths]
    for _, s in sets:
        if s.vocab_size > p.vocab_size:
            raise RemodelError(f"{s.path}: token ids go up to {s.vocab_size - 1}, beyond the model's vocabulary "
                               f"({p.vocab_size})")
    return sets[0][1] if len(sets) == 1 else Blend(sets)


def _eval_blocks(p: Plan, tokenizer):
    from .data import load_texts, pack
    return pack(load_texts(p.cfg.eval_data), tokenizer, p.cfg.seq_len, max_tokens=p.cfg.eval_tokens)


def _fingerprint(data) -> list[str]:
    return [s.fingerprint for s in getattr(data, "sets", [data])]


def _load_models(p: Plan, mesh, ep_dim):
    """-> (student, teacher, projections, teacher layout). One process: whole models. Several: each rank
    reads only its shards (pipelines.sharded): the student TP / EP / FSDP over dp, the frozen teacher
    FSDP over dp plus TP (and EP over tp) where its widths allow."""
    torch.manual_seed(p.cfg.seed)
    teacher, layout_t = None, None
    from .fp8 import convert
    s_fp8, t_fp8 = (convert if p.cfg.fp8 else None), (convert if p.cfg.fp8_teacher else None)
    if mesh is None:
        student = load_model(p.student_dir, device=p.dev)
        if s_fp8:
            s_fp8(student)
        if p.distill:
            teacher = load_model(p.teacher_dir, device=p.dev)
            if t_fp8:
                t_fp8(teacher)
    else:
        student, _ = load_sharded(p.student_dir, mesh, "tp", ep_dim, "dp", p.dev, prepare=s_fp8)
        if p.distill:
            tries = [("tp", ep_dim if ep_dim == "tp" else None), ("tp", None), (None, None)]
            teacher, layout_t = load_sharded(p.teacher_dir, mesh, None, None, "dp", p.dev, layouts=tries,
                                             prepare=t_fp8)
    student.train()
    if teacher is not None:
        teacher.eval().requires_grad_(False)
    projections = build_projections(student, teacher, p.layer_map) if p.cfg.hidden_loss_weight else None
    if projections is not None:
        projections.to(p.dev)
    return student, teacher, projections, layout_t


def run(c: TrainConfig) -> dict | None:
    """Train (or distil) per `c` on this process's share; returns the report on rank 0, None elsewhere."""
    p = prepare(c)
    tokenizer = load_tokenizer(p.student_dir)
    world = world_size()
    return_freed_memory(sharded=world > 1 or c.tp * c.ep > 1)
    dev = init_dist(p.dev) if world > 1 or c.tp * c.ep > 1 else p.dev
    world = world_size()
    dp, ep_dim = layout(world, c.tp, c.ep, c.batch)
    if c.fused_loss and dp > 1:
        raise RemodelError("--fused-loss runs in one process or under tensor parallelism alone (--tp equal to the "
                           "number of processes) for now: FSDP over data-parallel ranks is not wired to it yet")
    mesh = init_mesh(dev.type, dp, c.tp)
    if mesh is not None:
        check_layout(load_config(p.student_dir), c.tp, c.ep, ep_dim, "tp", "dp", mesh)  # before any heavy work
    p.args["device"] = str(dev)
    lead = rank() == 0
    group = wait_group()
    from models.recompute import set_recompute

    # -- resume state, data, models -------------------------------------------------------------
    ckpt, ck_meta = _resume_state(p)
    data = _token_data(p, tokenizer, lead, group)
    p.args["data_fingerprint"] = _fingerprint(data)
    if ck_meta is not None and ck_meta["args"].get("data_fingerprint") != p.args["data_fingerprint"]:
        raise RemodelError(f"cannot resume from {ckpt}: the training data changed since that run (its tokens' "
                           "fingerprint differs); pass the same --data, or --overwrite to start over")
    eval_blocks = _eval_blocks(p, tokenizer) if c.eval_data and (lead or mesh is not None) else None
    student, teacher, projections, teacher_layout = _load_models(p, mesh, ep_dim)
    rss = metrics.PeakRSS()
    rss.mark("load")
    info = parallel_info(student)
    fns = parallel_loss_fns(info)
    start, history, resumed_from, evals = 0, [], None, {}
    if ck_meta is not None:
        start, history, evals = ck_meta["step"], ck_meta["history"], ck_meta.get("eval", {})
        resumed_from = str(ckpt)
        if lead:
            tqdm.write(f"resuming from {ckpt} (step {start} of {p.steps})")
    n_params = {"student": metrics.param_count(student),
                "teacher": metrics.param_count(teacher) if p.distill else None,
                "trainable_extra": sum(q.numel() for q in projections.parameters()) if projections else 0}
    flops_tok = 3 * metrics.forward_flops_per_token(student, c.seq_len)
    if p.distill:
        flops_tok += metrics.forward_flops_per_token(teacher, c.seq_len)
    peak = metrics.measure_matmul_flops(dev, torch.bfloat16 if p.use_bf16 else torch.float32) * world
    if eval_blocks is not None and "before" not in evals:
        evals["before"] = evaluate(student, eval_blocks, batch=c.batch, bf16=p.use_bf16, loss_fn=fns.get("lm_loss"))
        student.train()
    wait(group)

    # -- recompute, optimizer ---------------------------------------------------------------------
    set_recompute(student, c.recompute)
    params = dict(student.named_parameters())
    if projections is not None:
        params.update({f"proj.{k}": q for k, q in projections.named_parameters()})
    opt = build_optimizer(params, c.lr, c.weight_decay)
    if ckpt is not None:  # every rank reads only the chunks it holds, whatever layout wrote them
        state.load(ckpt, student, projections, opt)
    saver = state.Saver(p.run_dir, c.keep_last, background=c.async_checkpoint, group=group)

    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=p.use_bf16)
    w = {"kl": p.kl_weight, "lm": p.lm_loss_weight, "hidden": c.hidden_loss_weight, "lb": p.args["lb_coeff"],
         "z": c.z_coeff, "temperature": c.temperature, "topk": c.topk, "fused": c.fused_loss,
         "vocab_group": info.vocab_group}

    def checkpoint(step):
        meta = {"step": step, "consumed_batches": step * c.grad_accum, "args": p.args, "history": history,
                "eval": evals, "hf_config": hf_config}  # hf_config: `remodel convert` exports a checkpoint alone
        saver.save(step, student, projections, opt, meta)
        rss.mark("checkpoint", first=True)

    hf_config = read_config_dict(p.student_dir)

    # -- loop -------------------------------------------------------------------------------------
    if lead and not c.resume and p.run_dir.exists():
        shutil.rmtree(p.run_dir)  # overwrite: start over (only now that every input has loaded)
    from .tokens import sequences
    it = sequences(data, c.seq_len, c.batch, seed=c.seed, start=start * c.grad_accum, dp_rank=info.dp_rank,
                   dp_size=dp)  # this rank's rows of each global batch, read from disk by a prefetch thread
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    step_time, step_tokens = 0.0, 0
    bar = tqdm(total=p.steps, initial=start, desc="distill" if p.distill else "train", unit="step",
               dynamic_ncols=True, disable=not lead)
    for step in range(start, p.steps):
        t0 = time.perf_counter()
        cur_lr = lr_at(step, p.steps, c.lr, p.min_lr, p.warmup)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        sums: dict[str, float] = {}
        for _ in range(c.grad_accum):
            ids = next(it).to(dev, non_blocking=True)
            loss, parts = compute_losses(student, teacher, ids, w, p.layer_map, projections, autocast, fns)
            (loss / c.grad_accum).backward()
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v / c.grad_accum
        sums = _dp_mean(sums, info, dev)
        gnorm = _clip(student, projections, c.grad_clip, info)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t0
        step_time += dt
        step_tokens += p.tokens_per_step
        if not math.isfinite(sums["loss"]):
            bar.close()
            last = state.list_checkpoints(p.run_dir)
            raise RemodelError(f"loss became {sums['loss']} at step {step + 1}"
                               + (f"; last checkpoint {last[-1]}" if last else ""))
        row = {"step": step + 1, **{k: sums[k] for k in parts}, "lr": cur_lr, "grad_norm": float(gnorm),
               "tokens_per_s": p.tokens_per_step / dt}
        history.append(row)
        bar.update(1)
        bar.set_postfix(loss=f"{sums['loss']:.4f}", lr=f"{cur_lr:.2e}")
        if lead and c.log_every and (step + 1) % c.log_every == 0:
            tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        rss.mark("first step", first=True)
        if (step + 1) % p.checkpoint_every == 0 or step + 1 == p.steps:
            checkpoint(step + 1)
    bar.close()
    it.close()
    saver.wait()
    rss.mark("train")

    # -- final evaluation, report, export (rank 0 writes; every rank takes part) ----------------------
    set_recompute(student, "none")
    if eval_blocks is not None:
        evals["after"] = evaluate(student, eval_blocks, batch=c.batch, bf16=p.use_bf16, loss_fn=fns.get("lm_loss"))
    report = None
    if lead:
        tok_s = step_tokens / step_time if step_time else None
        data_tokens = sum(s.n_tokens for s in getattr(data, "sets", [data]))
        report = metrics.report(p.args, p.family, n_params, p.steps, p.tokens_per_step, data_tokens, resumed_from, p.run_dir, history, evals, tok_s, flops_tok, peak, p.t_start)
        report["parallel"] = {"world": world, "tp": c.tp, "ep": info.ep, "dp": dp, "ep_over": info.ep_over,
                              "teacher": teacher_layout, "teacher_fsdp": bool(p.distill and dp > 1),
                              "backend": dist.get_backend() if mesh is not None else None}
        if world > 1:
            report["mfu_note"] += f", times {world} processes"
    _write_outputs(p, student, report)
    rss.mark("export")
    rss.write(p.run_dir / f"peak-rss-rank{rank()}.json")
    wait(group)
    return report


def _write_outputs(p: Plan, student, report):
    """OUT: the HF checkpoint of `student`, streamed tensor by tensor from its shards, with
    remodel_report.json, metrics.csv and loss.png (rank 0). Collective."""
    dtype = getattr(torch, p.cfg.save_dtype) if p.cfg.save_dtype else source_dtype(p.student_dir)

    def finish(tmp):
        (tmp / "remodel_report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        metrics.write_metrics(report["history"], tmp / "metrics.csv")
        metrics.plot_losses(report["history"], tmp / "loss.png", f"{report['command']}: {p.student_dir.name}")

    export_sharded(student, p.out, family=p.family, aux_from=p.student_dir, overwrite=p.cfg.overwrite, dtype=dtype,
                   inputs=p.inputs, finish=finish)
