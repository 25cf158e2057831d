"""Tensor-, expert- and data-parallel training and distillation: `remodel train|distill --tp T --ep E`
run under torchrun (one process per device).

    torchrun --nproc-per-node N cli.py distill --teacher T --student S OUT --data D --tp 2 [--ep 2]

pipelines.train.train hands over here when tp * ep > 1 or WORLD_SIZE > 1; same arguments, checks, data
order, losses, lr schedule, checkpoints and outputs (its helpers are reused). The N processes form a
("dp", "tp") DeviceMesh, dp = N // tp; expert parallelism is folded over the tp ranks (ep == tp) or the
dp ranks (ep == dp). pipelines.parallel shards the student (TP, EP, FSDP2 over dp) and the frozen
teacher (TP, and EP when folded over tp, where its widths allow; otherwise replicated; never FSDP).
Every rank packs the same data and draws the same global micro-batch; dp rank r trains on its
contiguous rows, so the global batch and its order are the single-process run's. Losses are the
vocab-parallel CE / KL (pipelines.vocab_parallel), the MoE load-balancing loss counts the expert load
over every dp rank, the logged values are dp means, and parallel.clip_grad_norm_ clips the global norm.

Checkpoints are gathered to the single-process format (rank 0 writes `<out>.run/step-N/`), so a run
resumes exactly under any layout, also in one process. Rank 0 alone shows the progress bar, evaluates
and writes OUT (gathered HF checkpoint, remodel_report.json, metrics.csv, loss.png); it returns the
report, the other ranks None.

Failure: every collective of the training loop times out after REMODEL_DIST_TIMEOUT seconds (default
30), so a dead or stalled rank ends the others with an error well within a minute (under torchrun a
dead rank's exit also stops the others at once). Waits for rank 0's solo work (evaluation, writing a
checkpoint) and for the slowest loader use a separate gloo group with REMODEL_DIST_WAIT_TIMEOUT
(default 3600 s).
"""
from __future__ import annotations

import atexit
import datetime
import math
import os
import shutil
import time

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from models.errors import RemodelError
from models.load import load_model

from .losses import load_balancing_loss, router_probs, topk_kl
from .parallel import (_check, _rank, _size, _unshard_all, clip_grad_norm_, full_state_dict, gather_model,
                       gather_rows, parallel_info, parallelize, shard_tensor)
from .train import (PREPARED, _pack_data, _prepare, _report, _resume_state, _write_outputs, build_optimizer,
                    build_projections, compute_losses, evaluate, forward_flops_per_token, list_checkpoints, lr_at,
                    load_optimizer_state, measure_matmul_flops, optimizer_state, pick_device, rng_state,
                    save_checkpoint, set_rng_state)
from .vocab_parallel import vocab_parallel_kl_div, vocab_parallel_lm_loss, vocab_shard


def _timeout(var: str, default: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get(var, default)))


# ---- process group and mesh -------------------------------------------------------------------

def _init_dist(device) -> torch.device:
    """This rank's device; initialises the default process group from torchrun's environment unless one
    exists. It is kept for later calls in the process (a second init under torchrun would hang) and
    destroyed at exit (gloo threads alive at interpreter exit can abort a finished rank)."""
    dev = pick_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        return dev
    if not {"WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"} <= set(os.environ):
        raise RemodelError("tensor/expert/data parallelism needs one process per rank: launch with "
                           "`torchrun --nproc-per-node N cli.py train|distill ... --tp T --ep E`")
    dist.init_process_group(dist.get_default_backend_for_device(dev),
                            timeout=_timeout("REMODEL_DIST_TIMEOUT", 30))
    atexit.register(_destroy)
    return dev


def _destroy():
    if dist.is_initialized():
        dist.destroy_process_group()


def _mesh(device_type: str, dp: int, tp: int):
    """("dp", "tp") DeviceMesh whose groups carry the short timeout (init_device_mesh's subgroups would
    get torch's 30-minute default)."""
    from torch.distributed.device_mesh import DeviceMesh
    grid = torch.arange(dp * tp).view(dp, tp)
    me, mine = dist.get_rank(), {}
    for name, rows in (("dp", grid.t().tolist()), ("tp", grid.tolist())):
        for ranks in rows:  # every rank creates every group, in the same order
            g = dist.new_group(ranks, timeout=_timeout("REMODEL_DIST_TIMEOUT", 30))
            if me in ranks:
                mine[name] = g
    return DeviceMesh.from_group([mine["dp"], mine["tp"]], device_type, mesh=grid, mesh_dim_names=("dp", "tp"))


def _layout(world: int, tp: int, ep: int, batch: int) -> tuple[int, str | None]:
    """-> (dp, ep mesh dimension or None); one-line errors for layouts that cannot work."""
    if tp < 1 or ep < 1:
        raise RemodelError(f"tp and ep must be >= 1, got tp={tp} ep={ep}")
    if world % tp:
        raise RemodelError(f"tp={tp} does not divide the {world} processes")
    dp = world // tp
    ep_dim = None
    if ep > 1:
        if ep == tp:
            ep_dim = "tp"
        elif ep == dp:
            ep_dim = "dp"
        else:
            raise RemodelError(f"ep={ep} must equal tp={tp} or dp={dp} (= processes / tp): expert parallelism is "
                               "folded over the tensor- or the data-parallel ranks")
    if batch % dp:
        raise RemodelError(f"batch={batch} is not divisible by the {dp} data-parallel ranks (processes / tp)")
    return dp, ep_dim


def _wait(group):
    """Barrier on the long-timeout group (others wait while rank 0 works alone)."""
    dist.barrier(group=group)


# ---- losses -----------------------------------------------------------------------------------

def dp_load_balancing_loss(router_logits_list, top_k: int, n_experts: int, router_kind: str = "softmax",
                           group=None) -> torch.Tensor:
    """losses.load_balancing_loss of the global batch, tokens split evenly over the ranks of `group`: the
    expert load f counts every rank's routing slots (all-reduced; not differentiable), the mean routing
    probability P is this rank's. The group mean of the per-rank values (and of their gradients)
    is the single-process loss of the whole batch."""
    if _size(group) == 1:
        return load_balancing_loss(router_logits_list, top_k, n_experts, router_kind)
    logits = [lg.reshape(-1, lg.shape[-1]).float() for lg in router_logits_list]
    counts = torch.stack([torch.bincount(lg.detach().topk(top_k, dim=-1)[1].reshape(-1), minlength=n_experts)
                          for lg in logits]).to(logits[0].dtype)
    dist.all_reduce(counts, group=group)
    losses = []
    for lg, c in zip(logits, counts):
        f = c / (lg.shape[0] * top_k * _size(group))
        losses.append(n_experts * (f * router_probs(lg, router_kind).mean(0)).sum())
    return torch.stack(losses).mean()


def parallel_loss_fns(info) -> dict:
    """compute_losses' loss functions on vocab-sharded logits (teacher logits may be a shard or full)."""
    g, n = info.vocab_group, _size(info.vocab_group)

    def shard(t, like):
        return t if t.shape[-1] == like.shape[-1] else vocab_shard(t, g)

    def full(z, V):  # [..., V/n] -> [..., V]; backward keeps this rank's block (the loss is replicated)
        if z.shape[-1] == V:
            return z
        return gather_rows(z.movedim(-1, 0).contiguous(), g, V).movedim(0, -1)

    def top(s, t, k, T):
        V = s.shape[-1] * n
        return topk_kl(full(s, V), full(t, V), k, T)

    return {"lm_loss": lambda logits, labels: vocab_parallel_lm_loss(logits, labels, g),
            "kl_div": lambda s, t, T: vocab_parallel_kl_div(s, shard(t, s), g, T),
            "topk_kl": top,
            "load_balancing_loss": lambda lg, k, E, kind: dp_load_balancing_loss(lg, k, E, kind, info.dp_group)}


def _dp_mean(values: dict, info, dev) -> dict:
    if info.dp_group is None:
        return values
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=dev)
    dist.all_reduce(t, group=info.dp_group)
    return {k: float(v) / info.dp for k, v in zip(keys, t.tolist())}


@torch.no_grad()
def _clip(student, projections, max_norm, info) -> torch.Tensor:
    """Global-norm clipping of the student's sharded gradients plus the (replicated) projections'."""
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


# ---- checkpoints in the single-process format --------------------------------------------------

def _param_order(params: dict) -> list[str]:
    """Names in the optimizer's parameter-id order (build_optimizer: matrices first, then the rest)."""
    return [n for n, p in params.items() if p.ndim >= 2] + [n for n, p in params.items() if p.ndim < 2]


def _full_optimizer_state(opt, order, info) -> dict:
    """opt.state_dict() with every sharded state tensor gathered to full (valid on rank 0; collective)."""
    sd = opt.state_dict()
    state = {pid: dict(st) for pid, st in sd["state"].items()}
    keys = sorted({k for st in state.values() for k, v in st.items() if torch.is_tensor(v) and k != "step"})
    holder = _Named(info)
    for k in keys:  # exp_avg, exp_avg_sq: sharded like their parameter
        pids = [pid for pid in sorted(state) if k in state[pid]]
        full = _unshard_all(holder, [(order[pid], state[pid][k]) for pid in pids], rank0_only=True)
        for pid in pids:
            state[pid][k] = full.get(order[pid])
    return {"state": state, "param_groups": sd["param_groups"]}


class _Named:
    """Stand-in model for parallel._unshard_all, which reads only its ParallelInfo."""

    def __init__(self, info):
        self._parallel = info


def _snapshot(student, projections, opt, order, info, dev, meta: dict):
    """(tensors, meta) of a checkpoint in pipelines.train's format on rank 0, (None, None) elsewhere."""
    model_sd = full_state_dict(student)
    opt_sd = _full_optimizer_state(opt, order, info)
    if dist.get_rank() != 0:
        return None, None
    tensors = {f"model.{k}": v.contiguous() for k, v in model_sd.items()}
    if projections is not None:
        tensors.update({f"proj.{k}": v.detach().cpu().contiguous() for k, v in projections.state_dict().items()})
    opt_t, opt_meta = optimizer_state(None, opt_sd)
    tensors.update({k: v.detach().cpu().contiguous() for k, v in opt_t.items()})
    tensors.update(rng_state(dev))
    return tensors, {**meta, "optimizer": opt_meta}


def _local_optimizer_tensors(ck_tensors: dict, order, params: dict, info, dev) -> dict:
    """A checkpoint's full optimizer tensors -> this rank's shards (TP/EP spec, then FSDP's DTensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    out = {}
    for key, t in ck_tensors.items():
        if not key.startswith("optim."):
            continue
        _, pid, k = key.split(".", 2)
        name = order[int(pid)]
        p = params[name]
        if k != "step":
            t = t.to(dev)
            spec = info.specs.get(name)
            if spec is not None:
                kind, dim, sizes = spec
                g = info.tp_group if kind == "tp" else info.ep_group
                t = shard_tensor(t, dim, sizes, _rank(g), _size(g)).contiguous()
            if isinstance(p, DTensor):
                t = distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None)
        out[key] = t
    return out


# ---- the engine -------------------------------------------------------------------------------

def train_parallel(student_dir, out, data, teacher_dir=None, steps=None, tokens=None, seq_len=256, batch=8,
                   lr=1e-4, min_lr=None, warmup=None, weight_decay=0.1, grad_clip=1.0, grad_accum=1,
                   temperature=1.0, kl_weight=1.0, lm_loss_weight=None, hidden_loss_weight=0.0, layer_map=None,
                   topk=None, lb_coeff=1e-2, z_coeff=0.0, checkpoint_every=None, keep_last=2, resume=False,
                   seed=0, eval_data=None, eval_tokens=65536, overwrite=False, log_every=50, device="auto",
                   bf16="auto", save_dtype=None, tp=1, ep=1) -> dict | None:
    """pipelines.train.train over torch.distributed (see the module doc); every rank calls it with the
    same arguments. Uses the default process group, initialised from torchrun's environment if needed.
    Returns the report on rank 0, None on the others."""
    kw = dict(locals())
    s = _prepare(kw)  # every argument check, before any heavy work and with nothing written
    tp, ep = int(tp or 1), int(ep or 1)
    return _run(kw, s, tp, ep, _init_dist(device))


def _run(kw, s, tp, ep, dev):
    (t_start, out, student_dir, teacher_dir, distill, lm_loss_weight, kl_weight, tokens_per_step, steps,
     min_lr, warmup, checkpoint_every, layer_map, s_cfg, family, inputs, run_dir, tokenizer, _, use_bf16,
     args) = (s[k] for k in PREPARED)
    seq_len, batch, grad_accum, lr, seed = kw["seq_len"], kw["batch"], kw["grad_accum"], kw["lr"], kw["seed"]
    rank, world = dist.get_rank(), dist.get_world_size()
    lead = rank == 0
    args["device"] = str(dev)
    dp, ep_dim = _layout(world, tp, ep, batch)
    mesh = _mesh(dev.type, dp, tp)
    _check(s_cfg, tp, ep, ep_dim, "tp", "dp", mesh)
    wait_group = dist.new_group(backend="gloo", timeout=_timeout("REMODEL_DIST_WAIT_TIMEOUT", 3600))

    # -- resume state, data, models (plain, full, identical on every rank) ------------------------
    ckpt, ck_tensors, ck_meta = _resume_state(kw["resume"], run_dir, args)
    blocks, eval_blocks = _pack_data(kw["data"], kw["eval_data"] if lead else None, tokenizer, seq_len,
                                     steps * tokens_per_step, kw["eval_tokens"], s_cfg.vocab_size)
    torch.manual_seed(seed)
    student = load_model(student_dir, device=dev).train()
    teacher = None
    if distill:
        teacher = load_model(teacher_dir, device=dev).eval()
        teacher.requires_grad_(False)
    projections = build_projections(student, teacher, layer_map) if kw["hidden_loss_weight"] else None
    if projections is not None:
        projections.to(dev)
    start, history, resumed_from, evals = 0, [], None, {}
    if ck_meta is not None:
        student.load_state_dict({k[6:]: v.to(dev) for k, v in ck_tensors.items() if k.startswith("model.")},
                                strict=True)
        if projections is not None:
            projections.load_state_dict({k[5:]: v.to(dev) for k, v in ck_tensors.items() if k.startswith("proj.")})
        set_rng_state(ck_tensors, dev)
        start, history, evals = ck_meta["step"], ck_meta["history"], ck_meta.get("eval", {})
        resumed_from = str(ckpt)
        if lead:
            tqdm.write(f"resuming from {ckpt} (step {start} of {steps})")
    n_params = {"student": sum(p.numel() for p in student.parameters()),
                "teacher": sum(p.numel() for p in teacher.parameters()) if distill else None,
                "trainable_extra": sum(p.numel() for p in projections.parameters()) if projections else 0}
    flops_tok = 3 * forward_flops_per_token(student, seq_len)
    if distill:
        flops_tok += forward_flops_per_token(teacher, seq_len)
    peak = measure_matmul_flops(dev, torch.bfloat16 if use_bf16 else torch.float32) * world
    if lead and eval_blocks is not None and "before" not in evals:
        evals["before"] = evaluate(student, eval_blocks, batch=batch, bf16=use_bf16)
        student.train()
    _wait(wait_group)

    # -- shard, optimizer ---------------------------------------------------------------------------
    parallelize(student, mesh, tp_dim="tp", ep_dim=ep_dim, dp_dim="dp")
    info = parallel_info(student)
    teacher_layout = None
    if distill:
        for t_tp, t_ep in (("tp", ep_dim if ep_dim == "tp" else None), ("tp", None), (None, None)):
            try:
                parallelize(teacher, mesh, tp_dim=t_tp, ep_dim=t_ep)
                teacher_layout = {"tp": tp if t_tp else 1, "ep": ep if t_ep else 1}
                break
            except RemodelError:
                continue
    params = dict(student.named_parameters())
    if projections is not None:
        params.update({f"proj.{k}": p for k, p in projections.named_parameters()})
    order = _param_order(params)
    opt = build_optimizer(params, lr, kw["weight_decay"])
    if ck_meta is not None:
        load_optimizer_state(opt, _local_optimizer_tensors(ck_tensors, order, params, info, dev),
                             ck_meta["optimizer"])
        del ck_tensors

    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16)
    w = {"kl": kl_weight, "lm": lm_loss_weight, "hidden": kw["hidden_loss_weight"], "lb": args["lb_coeff"],
         "z": kw["z_coeff"], "temperature": kw["temperature"], "topk": kw["topk"]}
    fns = parallel_loss_fns(info)

    def checkpoint(step):
        meta = {"step": step, "consumed_batches": step * grad_accum, "args": args, "history": history,
                "eval": evals}
        tensors, meta = _snapshot(student, projections, opt, order, info, dev, meta)
        if lead:
            save_checkpoint(run_dir, step, tensors, meta, keep_last=kw["keep_last"])
        _wait(wait_group)

    # -- loop ---------------------------------------------------------------------------------------
    if lead and not kw["resume"] and run_dir.exists():
        shutil.rmtree(run_dir)  # overwrite: start over (only now that every input has loaded)
    from .data import batches
    it = batches(blocks, batch, shuffle_seed=seed, start=start * grad_accum, epochs=None, drop_last=True)
    per = batch // dp
    rows = slice(info.dp_rank * per, (info.dp_rank + 1) * per)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    step_time, step_tokens = 0.0, 0
    bar = tqdm(total=steps, initial=start, desc="distill" if distill else "train", unit="step", dynamic_ncols=True,
               disable=not lead)
    for step in range(start, steps):
        t0 = time.perf_counter()
        cur_lr = lr_at(step, steps, lr, min_lr, warmup)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        sums: dict[str, float] = {}
        for _ in range(grad_accum):
            ids = next(it)[rows].to(dev, non_blocking=True)
            loss, parts = compute_losses(student, teacher, ids, w, layer_map, projections, autocast, fns)
            (loss / grad_accum).backward()
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v / grad_accum
        sums = _dp_mean(sums, info, dev)
        gnorm = _clip(student, projections, kw["grad_clip"], info)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t0
        step_time += dt
        step_tokens += tokens_per_step
        if not math.isfinite(sums["loss"]):
            bar.close()
            last = list_checkpoints(run_dir)
            raise RemodelError(f"loss became {sums['loss']} at step {step + 1}"
                               + (f"; last checkpoint {last[-1]}" if last else ""))
        row = {"step": step + 1, **{k: sums[k] for k in parts}, "lr": cur_lr, "grad_norm": float(gnorm),
               "tokens_per_s": tokens_per_step / dt}
        history.append(row)
        bar.update(1)
        bar.set_postfix(loss=f"{sums['loss']:.4f}", lr=f"{cur_lr:.2e}")
        if lead and kw["log_every"] and (step + 1) % kw["log_every"] == 0:
            tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        if (step + 1) % checkpoint_every == 0 or step + 1 == steps:
            checkpoint(step + 1)
    bar.close()

    # -- final model and report (rank 0) ----------------------------------------------------------
    full = gather_model(student)
    report = None
    if lead:
        if eval_blocks is not None:
            evals["after"] = evaluate(full.to(dev), eval_blocks, batch=batch, bf16=use_bf16)
        tok_s = step_tokens / step_time if step_time else None
        report = _report(args, family, n_params, steps, tokens_per_step, blocks, resumed_from, run_dir, history,
                         evals, tok_s, flops_tok, peak, t_start)
        report["parallel"] = {"world": world, "tp": tp, "ep": info.ep, "dp": dp, "ep_over": info.ep_over,
                              "teacher": teacher_layout, "backend": dist.get_backend()}
        report["mfu_note"] += f", times {world} processes"
        _write_outputs(out, kw["overwrite"], inputs, full.cpu(), student_dir, family, kw["save_dtype"], report)
    _wait(wait_group)
    return report
