"""The one trainer of `remodel train` (LM loss) and `remodel distill` (logit KD from a frozen teacher).

A single process is the 1-rank case of the same code path; under torchrun the processes form a
("dp", "tp") DeviceMesh (pipelines.distributed.runtime) and `parallelize` (pipelines.distributed.parallel) shards the models from
outside: the student with TP / EP / FSDP2 over dp, the frozen teacher with TP (and EP over tp) where its
widths allow. Every rank draws the same global micro-batch and trains on its own rows of it, so the data
order is the single-process run's; the logged values are dp means and the clip is the global norm.

AdamW with linear warm-up and cosine decay to min_lr, grad clipping and accumulation, bf16 autocast on
CUDA only. Resumable from `<out>.run/` (pipelines.training.train_state) at the exact data position. The end result
is a HF checkpoint in OUT with remodel_report.json, metrics.csv and loss.png (written by rank 0); an MoE
student's report and plot also give, per MoE layer, load balance, router entropy and expert similarity
(metrics.MoEStats).
The checks before any heavy work are in pipelines.training.train_setup, the loss in pipelines.training.objective.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from remodel.models.errors import RemodelError
from remodel.models.load import load_config, load_model, read_config_dict

from . import loggers, metrics, run_files
from . import train_state as state
from .held_out import evaluate_on, held_out, held_out_blocks
from .objective import compute_losses
from ..distributed.parallel import check_layout, clip_grad_norm_, local_tensor, parallel_info
from ..distributed.runtime import (init_dist, init_mesh, layout, load_tokenizer, rank, return_freed_memory,
                      source_dtype, wait, wait_group, world_size)
from ..distributed.sharded import export_sharded, load_sharded
from .train_config import RESUME_KEYS, TrainConfig
from .train_setup import Plan, prepare, trained_params
from .vocab_parallel import parallel_loss_fns

__all__ = ["build_optimizer", "build_projections", "compute_losses", "lr_at", "prepare", "run"]


def lr_at(step: int, steps: int, lr: float, min_lr: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps (step 0 gets lr/warmup), then cosine from lr to min_lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def build_projections(student, teacher, layer_map) -> nn.ModuleList | None:
    """A Linear(student width -> teacher width) per mapped pair when the widths differ, else None."""
    hs, ht = student.cfg.hidden_size, teacher.cfg.hidden_size
    if hs == ht:
        return None
    return nn.ModuleList(nn.Linear(hs, ht, bias=False) for _ in layer_map)


def build_optimizer(params: dict[str, nn.Parameter], lr: float, weight_decay: float, betas=(0.9, 0.95)):
    """AdamW; weight decay on matrices (ndim >= 2) only, not on norms, biases, A_log, D, dt_bias. DTensors
    (tensor parallelism's stock styles, FSDP2) and plain tensors (the custom styles' shards) in separate
    groups: the foreach kernels take no list that mixes them. A group of plain CUDA tensors takes the fused
    kernel (`fused_adamw`), the rest torch's default (foreach on CUDA, the loop on CPU)."""
    from torch.distributed.tensor import DTensor
    groups = []
    for decay in (True, False):
        for dt in (True, False):
            ps = [p for p in params.values() if (p.ndim >= 2) == decay and isinstance(p, DTensor) == dt]
            if ps:
                fused = fused_adamw(ps) and not dt
                groups.append({"params": ps, "weight_decay": weight_decay if decay else 0.0,
                               "fused": fused or None})
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8)


def fused_adamw(ps) -> bool:
    """Whether torch's fused AdamW takes these parameters: floating-point tensors all on one CUDA device.
    FUSED_ADAMW = False keeps the foreach kernel (the benchmarks' baseline)."""
    return FUSED_ADAMW and all(p.is_cuda and p.is_floating_point() for p in ps) and len({p.device for p in ps}) == 1


FUSED_ADAMW = True


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


def _resume_state(p: Plan):
    """-> (checkpoint dir, its meta) to continue from, or Nones; refuses a checkpoint of another
    trajectory (RESUME_KEYS)."""
    if not p.cfg.resume:
        return None, None
    ckpt = state.latest_checkpoint(p.run_dir)  # (nothing removed or written before every check has passed)
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
    from ..data.megatron import is_megatron
    from ..data.tokens import Blend, ensure_tokens, is_token_set, open_set, parse_blend
    c = p.cfg
    d = c.data
    parts = [(1.0, d)] if is_token_set(d) or is_megatron(d) or Path(d).expanduser().exists() else parse_blend(d)
    for who in ("lead", "rest"):
        if (who == "lead") == lead:
            paths = [(w, ensure_tokens(x, tokenizer, num_proc=c.num_proc, doc_split=c.doc_split)) for w, x in parts]
        wait(group)
    sets = [(w, open_set(x)) for w, x in paths]
    for _, s in sets:
        s.check_vocab(p.vocab_size)  # ids past the model's vocabulary: one line now, not an index error later
    return sets[0][1] if len(sets) == 1 else Blend(sets)


def _fingerprint(data) -> list[str]:
    return [s.fingerprint for s in getattr(data, "sets", [data])]


def _load_models(p: Plan, mesh, ep_dim):
    """-> (student, teacher, projections, teacher layout). One process: whole models. Several: each rank
    reads only its shards (pipelines.distributed.sharded): the student TP / EP / FSDP over dp, the frozen teacher
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


def held_bytes(model, group) -> list[int] | None:
    """Bytes of `model`'s parameters that each rank holds (its local TP / EP / FSDP shards), rank by rank:
    sharding shown by what the ranks hold, not inferred from the layout. Collective over `group`."""
    if model is None:
        return None
    n = torch.tensor([sum(local_tensor(q).numel() * q.element_size() for q in model.parameters())], dtype=torch.int64)
    if group is None:
        return [int(n)]
    out = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, n, group=group)
    return [int(x) for x in out]


@dataclass
class _Procs:
    """This process's place in the run: device, mesh and layout, whether it leads (rank 0), its wait group."""
    world: int
    dev: torch.device
    dp: int
    ep_dim: str | None
    mesh: object
    lead: bool
    group: object


def _init_processes(p: Plan) -> _Procs:
    """Joins the process group and builds the mesh (several processes, or --tp/--ep); checks the layout
    against the student's widths before any heavy work."""
    c = p.cfg
    world = world_size()
    return_freed_memory(sharded=world > 1 or c.tp * c.ep > 1)
    dev = init_dist(p.dev) if world > 1 or c.tp * c.ep > 1 else p.dev
    world = world_size()
    dp, ep_dim = layout(world, c.tp, c.ep, c.batch)
    mesh = init_mesh(dev.type, dp, c.tp)
    if mesh is not None:
        check_layout(load_config(p.student_dir), c.tp, c.ep, ep_dim, "tp", "dp", mesh)
    p.args["device"] = str(dev)
    return _Procs(world, dev, dp, ep_dim, mesh, rank() == 0, wait_group())


def run(c: TrainConfig) -> dict | None:
    """Train (or distil) per `c` on this process's share; returns the report on rank 0, None elsewhere.
    Rank 0 holds the lock on OUT.run (taken by `prepare`) until the run ends, however it ends."""
    p = prepare(c)
    try:
        return _run(p)
    finally:
        p.release()


def _run(p: Plan) -> dict | None:
    c = p.cfg
    tokenizer = load_tokenizer(p.student_dir)
    procs = _init_processes(p)
    ckpt, ck_meta = _resume_state(p)
    data = _token_data(p, tokenizer, procs.lead, procs.group)
    p.args["data_fingerprint"] = _fingerprint(data)
    if ck_meta is not None and ck_meta["args"].get("data_fingerprint") != p.args["data_fingerprint"]:
        raise RemodelError(f"cannot resume from {ckpt}: the training data changed since that run (its tokens' "
                           "fingerprint differs); pass the same --data, or --overwrite to start over")
    eval_blocks = held_out_blocks(c, tokenizer) if c.eval_data and (procs.lead or procs.mesh is not None) else None
    training = _Training(p, procs, data, eval_blocks, ckpt, ck_meta)
    try:
        training.loop()
        return training.finish()
    except BaseException:
        training.log.close()
        training.discard_first_step()
        raise


class _Training:
    """One run's models, optimizer and history, from loading (or resuming) to the written OUT."""

    def __init__(self, p: Plan, procs: _Procs, data, eval_blocks, ckpt, ck_meta):
        from remodel.models.recompute import set_recompute
        c = self.c = p.cfg
        self.p, self.procs, self.data, self.eval_blocks = p, procs, data, eval_blocks
        self.student, self.teacher, self.projections, self.teacher_layout = _load_models(p, procs.mesh, procs.ep_dim)
        self.held = {"student": held_bytes(self.student, procs.group), "teacher": held_bytes(self.teacher, procs.group)}
        self.rss = metrics.PeakRSS()
        self.rss.mark("load")
        self.info = parallel_info(self.student)
        self.fns = parallel_loss_fns(self.info)
        self._resume_history(ckpt, ck_meta)
        self._measure()
        if eval_blocks is not None and "before" not in self.evals:
            self.evals["before"] = self._evaluate(self.student)
            if self.teacher is not None:  # the same tokens: the figure distillation moves the student towards
                self.evals["teacher"] = self._evaluate(self.teacher)
        wait(procs.group)
        set_recompute(self.student, c.recompute)
        params = trained_params(self.student, c.train_only)
        if self.projections is not None:
            params.update({f"proj.{k}": q for k, q in self.projections.named_parameters()})
        self.opt = build_optimizer(params, c.lr, c.weight_decay)
        if ckpt is not None:  # every rank reads only the chunks it holds, whatever layout wrote them
            state.load(ckpt, self.student, self.projections, self.opt)
        self.saver = state.Saver(p.run_dir, c.keep_last, background=c.async_checkpoint, group=procs.group)
        self.at, self.written = None, []  # the step in progress (its checkpoint and the export included); ours
        self.autocast = torch.autocast(procs.dev.type, dtype=torch.bfloat16, enabled=p.use_bf16)
        self.w = {"kl": p.kl_weight, "lm": p.lm_loss_weight, "hidden": c.hidden_loss_weight,
                  "lb": p.args["lb_coeff"], "z": c.z_coeff, "temperature": c.temperature, "topk": c.topk,
                  "fused": c.fused_loss, "vocab_group": self.info.vocab_group, "forced": c.forced_layers}
        self.hf_config = read_config_dict(p.student_dir)  # `remodel convert` exports a checkpoint alone
        self.step_time, self.step_tokens = 0.0, 0
        self.moe_every = max(1, p.steps // 100)
        self.moe, self.moe_init = self._moe_stats(ck_meta)
        self.log = loggers.Loggers(c, p.args, procs.lead)  # TensorBoard / W&B, when asked for (rank 0)
        self.log.eval(self.evals.get("before"), self.start)

    def _moe_stats(self, ck_meta) -> tuple:
        """(metrics.MoEStats, the experts' similarity before step 1 (from the checkpoint when resuming)) of an
        MoE student, recorded every moe_every steps; (None, None) without MoE layers. An upcycled student's
        config.json tells the shard origin (UPCYCLE_KEY's granularity)."""
        from remodel.upcycle.similarity import UPCYCLE_KEY
        up = self.hf_config.get(UPCYCLE_KEY)
        g = up.get("granularity") if isinstance(up, dict) else None
        g = g if isinstance(g, int) and not isinstance(g, bool) and g >= 1 else None
        stats = metrics.MoEStats(self.student, g, self.procs.world == 1)
        if not stats.routers:
            stats.close()
            return None, None
        init = ck_meta.get("moe_init") if ck_meta else stats.similarity(self.student)
        return stats, init if isinstance(init, dict) else None

    def _resume_history(self, ckpt, ck_meta):
        self.start, self.history, self.resumed_from, self.evals = 0, [], None, {}
        if ck_meta is not None:
            self.start, self.history, self.evals = ck_meta["step"], ck_meta["history"], ck_meta.get("eval", {})
            self.resumed_from = str(ckpt)
            if self.procs.lead:
                tqdm.write(f"resuming from {ckpt} (step {self.start} of {self.p.steps})")

    def _measure(self):
        """Parameter counts, FLOPs per token and the peak matmul rate (for the MFU in the report)."""
        p, c, student, teacher = self.p, self.c, self.student, self.teacher
        self.n_params = {"student": metrics.param_count(student),
                         "teacher": metrics.param_count(teacher) if p.distill else None,
                         "trainable_extra": sum(q.numel() for q in self.projections.parameters())
                         if self.projections else 0}
        self.flops_tok = 3 * metrics.forward_flops_per_token(student, c.seq_len)
        if p.distill:
            self.flops_tok += metrics.forward_flops_per_token(teacher, c.seq_len)
        dtype = torch.bfloat16 if p.use_bf16 else torch.float32
        self.peak = metrics.measure_matmul_flops(self.procs.dev, dtype) * self.procs.world

    def _evaluate(self, model) -> dict:
        out = evaluate_on(model, self.eval_blocks, self.c.batch, self.p.use_bf16)
        _reshard(model)
        return out

    def checkpoint(self, step: int):
        """Save step `step` (weights checked finite first); the first save of a run that starts over
        empties the run dir of an earlier run's files then, not before: a run that fails earlier leaves them."""
        run_files.check_finite(step, (self.student, self.projections), self.procs.dev)
        if not self.p.saved and not self.c.resume and self.procs.lead:
            run_files.clear_run_dir(self.p.run_dir)  # start over (the Saver's barrier holds the other ranks until this is done)
        self.p.saved = True
        self.written.append(self.p.run_dir / f"step-{step:06d}")
        meta = {"step": step, "consumed_batches": step * self.c.grad_accum, "args": self.p.args,
                "history": self.history, "eval": self.evals, "hf_config": self.hf_config, "moe_init": self.moe_init}
        self.saver.save(step, self.student, self.projections, self.opt, meta, prune=self.at != self.start + 1)
        self.rss.mark("checkpoint", first=True)

    def loop(self):
        """The optimizer steps from `start` to the end, with checkpoints every checkpoint_every steps. Rank 0
        marks the run dir as remodel's now (every refusal is behind) and, resuming, removes what a killed
        save left (hidden .step-* folders)."""
        p, c, procs = self.p, self.c, self.procs
        if procs.lead:
            p.mark()
            if c.resume:
                state.clean_stale(p.run_dir)
        from ..data.sampler import sequences
        # this rank's rows of each global batch, read from disk by a prefetch thread
        it = sequences(self.data, c.seq_len, c.batch, seed=c.seed, start=self.start * c.grad_accum,
                       dp_rank=self.info.dp_rank, dp_size=procs.dp, vocab_size=p.vocab_size)
        bar = tqdm(total=p.steps, initial=self.start, desc="distill" if p.distill else "train", unit="step",
                   dynamic_ncols=True, disable=not procs.lead)
        for step in range(self.start, p.steps):
            self.at = step + 1
            row = self.step(step, it, bar)
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
            self.log.step(row)
            if procs.lead and c.log_every and (step + 1) % c.log_every == 0:
                tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                                    if not isinstance(v, dict)))
            self.rss.mark("first step", first=True)
            if (step + 1) % p.checkpoint_every == 0 or step + 1 == p.steps:
                self.checkpoint(step + 1)
        bar.close()
        it.close()
        self.saver.wait()
        self.rss.mark("train")

    def discard_first_step(self):
        """A run that fails at its first step (in it, at its checkpoint, or at the export of a one-step run)
        removes what it wrote: its checkpoints (rank 0), then its marker (Plan.release). An older run's files
        stay; a run that failed later keeps its checkpoints, to --resume from."""
        if self.at != self.start + 1:
            return
        run_files.discard(self.written, self.saver, self.procs.lead)
        if self.procs.lead:
            self.p.saved = False

    def step(self, step: int, it, bar) -> dict:
        """One optimizer step over grad_accum micro-batches; -> its history row."""
        p, c, dev, opt = self.p, self.c, self.procs.dev, self.opt
        t0 = time.perf_counter()
        cur_lr = lr_at(step, p.steps, c.lr, p.min_lr, p.warmup)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        sums: dict[str, float] = {}
        for _ in range(c.grad_accum):
            ids = next(it).to(dev, non_blocking=True)
            loss, parts = compute_losses(self.student, self.teacher, ids, self.w, p.layer_map, self.projections,
                                         self.autocast, self.fns)
            _reshard(self.teacher)  # its no-grad forward left the FSDP root (embeddings, lm_head) whole
            (loss / c.grad_accum).backward()
            if self.moe is not None:
                self.moe.collect()
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v / c.grad_accum
        sums = _dp_mean(sums, self.info, dev)
        gnorm = _clip(self.student, self.projections, c.grad_clip, self.info)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.step_time += dt
        self.step_tokens += p.tokens_per_step
        if not math.isfinite(sums["loss"]):
            bar.close()
            last = state.list_checkpoints(p.run_dir)
            raise RemodelError(f"loss became {sums['loss']} at step {step + 1}"
                               + (f"; last checkpoint {last[-1]}" if last else ""))
        row = {"step": step + 1, **{k: sums[k] for k in parts}, "lr": cur_lr, "grad_norm": float(gnorm),
               "tokens_per_s": p.tokens_per_step / dt}
        if self.moe is not None and ((step + 1) % self.moe_every == 0 or step + 1 == p.steps):
            row["moe"] = self.moe.record(self.student, self.info.dp_group)
        self.history.append(row)
        return row

    def finish(self) -> dict | None:
        """Final evaluation, report, export (rank 0 writes; every rank takes part); -> the report on rank 0."""
        from remodel.models.recompute import set_recompute
        set_recompute(self.student, "none")
        if self.moe is not None:
            self.moe.close()
        if self.eval_blocks is not None:
            self.evals["after"] = self._evaluate(self.student)
        self.log.finish(self.evals.get("after"), self.p.steps)
        for who, model in (("student", self.student), ("teacher", self.teacher)):  # still sharded at the end
            self.held[f"{who}_end"] = held_bytes(model, self.procs.group)
        report = self.report() if self.procs.lead else None
        _write_outputs(self.p, self.student, report)
        self.at = None  # written: the run no longer fails at its first step
        if self.procs.lead:
            state.prune_checkpoints(self.p.run_dir, self.c.keep_last)  # what a first step's save kept
        self.rss.mark("export")
        self.rss.write(self.p.run_dir / f"peak-rss-rank{rank()}.json")
        wait(self.procs.group)
        return report

    def report(self) -> dict:
        p, c, procs = self.p, self.c, self.procs
        tok_s = self.step_tokens / self.step_time if self.step_time else None
        data_tokens = sum(s.n_tokens for s in getattr(self.data, "sets", [self.data]))
        report = metrics.report(p, self, data_tokens, tok_s)
        if self.eval_blocks is not None:
            report["held_out"] = held_out(c, self.eval_blocks, p.out)
        report["parallel"] = {"world": procs.world, "tp": c.tp, "ep": self.info.ep, "dp": procs.dp,
                              "ep_over": self.info.ep_over, "teacher": self.teacher_layout,
                              "held_bytes": self.held,  # per rank, measured from the local tensors
                              "backend": dist.get_backend() if procs.mesh is not None else None}
        report["memory"] = metrics.memory_figures(self.student.cfg, c, procs.dp, p.use_bf16, self.n_params["teacher"],
                                                  procs.dev)
        if procs.world > 1:
            report["mfu_note"] += f", times {procs.world} processes"
        if self.moe is not None:
            report["moe"] = metrics.moe_summary(self.history, self.moe_init, self.moe.granularity, self.moe_every)
        return report


def _reshard(model):
    """Shard FSDP modules (of `model`, if any) again after a no-grad forward: with no backward to reshard it, the root module keeps
    its parameters unsharded, and an optimizer built then holds tensors the next step no longer uses."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules() if model is not None else ():
        if isinstance(m, FSDPModule):
            m.reshard()


def _write_outputs(p: Plan, student, report):
    """OUT: the HF checkpoint of `student`, streamed tensor by tensor from its shards, with
    remodel_report.json, metrics.csv and loss.png (rank 0). Collective."""
    dtype = getattr(torch, p.cfg.save_dtype) if p.cfg.save_dtype else source_dtype(p.student_dir)

    def finish(tmp):
        run_files.keep_upcycle_origin(p.student_dir, tmp / "config.json")
        (tmp / "remodel_report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        metrics.write_metrics(report["history"], tmp / "metrics.csv")
        metrics.plot_losses(report["history"], tmp / "loss.png", f"{report['command']}: {p.student_dir.name}")

    export_sharded(student, p.out, family=p.family, aux_from=p.student_dir, overwrite=p.cfg.overwrite, dtype=dtype,
                   inputs=p.inputs, finish=finish)
