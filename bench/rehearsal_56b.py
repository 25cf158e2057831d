"""Rehearsal of 56B -> 47B distillation under torchrun on CPU, and the projection of the real job.

Teacher: the real 118-layer Nemotron-H 56B pattern with every width / SCALE (bench/dry_run_56b.py's
model; 2 KV heads instead of 1 so that TP 2 splits attention), random bf16 weights. Student: the
teacher pruned to the 47B class (magnitude scores, 98 layers, FFN x 30/32), as `remodel prune` does.
Runs (each `cli.py distill`, the same flags, data: the embedded corpus as a cached token set):
  one process (the reference), DP 2 x TP 2 and DP 4 under `torchrun --nproc-per-node 4`;
  DP 2 x TP 2 with rank 1 SIGKILLed after its step-2 checkpoint, resumed under DP 4 and in one process.
Recorded per rank: peak RSS after loading, after the first checkpoint, after training and after the
export (pipelines.training.metrics.PeakRSS), against the 1/N share of the training state; losses of the resumed
runs against the reference. Then the projection of the real job (see `project`), checked against the
rehearsal's own measured per-rank memory. Prints one JSON object (bench/rehearsal_56b.json).

    python bench/rehearsal_56b.py [--scale 32] [--steps 4] [--seq-len 128] [--batch 4] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from dry_run_56b import build_checkpoint, reference, scaled_config  # noqa: E402
from remodel.models.hf import config_from_hf  # noqa: E402
from remodel.models.load import load_model, read_config_dict  # noqa: E402
from remodel.models.params import count_params  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus  # noqa: E402

H100_GB, USABLE = 80, 0.9  # a GPU's memory and the share a job can plan on (allocator, NCCL, CUDA context)
SEQ_REAL = 8192


def build(root: Path, scale: int):
    """Teacher checkpoint (56B pattern / scale) and its 47B-class pruned student."""
    from remodel.pipelines.commands.prune import prune
    from remodel.pipelines.commands.score import score_weights
    cfg = scaled_config(scale).replace(num_key_value_heads=2)
    teacher, student = root / "teacher", root / "student"
    build_checkpoint(cfg, teacher)
    score_weights(teacher, root / "scores", "magnitude")
    prune(teacher, student, scores_dir=root / "scores", num_layers=98, ffn_size=cfg.mlp.intermediate_size * 30 // 32)
    return teacher, student


def distill(root: Path, name: str, teacher: Path, student: Path, a, procs: int, tp: int, resume=False,
            kill_after_step: int | None = None) -> dict:
    """One `cli.py distill` run (torchrun when procs > 1); optionally SIGKILL rank 1 once the checkpoint
    of `kill_after_step` exists. -> {rc, seconds, rss per rank, report or None}."""
    out = root / name
    flags = ["distill", "--teacher", str(teacher), "--student", str(student), str(out), "--data", str(a.data),
             "--steps", str(a.steps), "--seq-len", str(a.seq_len), "--batch", str(a.batch), "--lr", "1e-4",
             "--lm-loss-weight", "1.0",
             "--warmup", "1", "--checkpoint-every", "2", "--keep-last", "0", "--log-every", "0", "--tp", str(tp)]
    flags += ["--resume"] if resume else []
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"] if procs > 1
           else [sys.executable]) + [str(REPO / "cli.py"), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    t0 = time.time()
    p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(root / f"{name}.log", "w"))
    if kill_after_step is not None:
        ckpt = root / f"{name}.run" / f"step-{kill_after_step:06d}"
        while not ckpt.is_dir() and p.poll() is None:
            time.sleep(0.2)
        victim = _rank_pid(p.pid, 1)
        if victim:
            os.kill(victim, signal.SIGKILL)
    rc = p.wait()
    run = root / f"{name}.run"
    rss = {int(f.stem.rsplit("rank", 1)[1]): json.loads(f.read_text()) for f in run.glob("peak-rss-rank*.json")}
    rep = json.loads((out / "remodel_report.json").read_text()) if (out / "remodel_report.json").exists() else None
    return {"rc": rc, "seconds": round(time.time() - t0, 1), "rss_mb": dict(sorted(rss.items())), "report": rep}


def _rank_pid(parent: int, rank: int) -> int | None:
    """pid of the torchrun worker with RANK=rank."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.split("\n")
    kids = {int(a): int(b) for a, b in (x.split() for x in out if x.strip())}
    todo, seen = [parent], []
    while todo:
        q = todo.pop()
        seen.append(q)
        todo += [c for c, pp in kids.items() if pp == q]
    for pid in seen:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


# ---- memory model -------------------------------------------------------------------------------

def activation_bytes_per_token(model_dir: Path, seq_len: int = 256) -> dict:
    """Bytes saved for backward per token (fp32, unique storages) of one training forward of the model,
    for each recompute mode (models.recompute)."""
    from remodel.models.recompute import set_recompute
    model = load_model(model_dir).train()
    ids = torch.randint(0, model.cfg.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    out = {}
    for mode in ("none", "selective", "full"):
        set_recompute(model, mode)
        seen, total = set(), [0]

        def pack(t):
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen and t.device.type == "cpu":
                seen.add(key)
                total[0] += key[1]
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h, _ = model.hidden(ids)
        out[mode] = total[0] / seq_len
        del h
    set_recompute(model, "none")
    return out


def project(student_cfg, teacher_cfg, act_per_token: dict, width_ratio: float, gpus: int, tp: int, mode: str,
            fused: bool) -> dict:
    """GB per GPU of distilling `student_cfg` from `teacher_cfg` on `gpus` H100s (TP `tp`, FSDP over the
    gpus / tp data-parallel ranks), bf16 compute, one 8K-token sequence per micro-batch:
      state      student 16 B/param (bf16 weights, fp32 master, grads, AdamW m and v: 2+4+2+8), teacher
                 2 B/param, both sharded over all gpus (TP x FSDP);
      buffers    FSDP's unsharded bf16 copy of the largest unit of each model, x2 (prefetch);
      activations the bytes per token saved for backward, measured on the rehearsal student (fp32) for
                 the mode, x width_ratio (they grow linearly with the widths), / 2 for bf16; the layer
                 inputs (what `full` keeps) are replicated over TP, the rest split by it;
      logits     the student's and the teacher's [8K, vocab] fp32 logits, unless --fused-loss."""
    ps, pt = count_params(student_cfg)["total"], count_params(teacher_cfg)["total"]
    state = (16 * ps + 2 * pt) / gpus
    layer = max(_largest_layer(student_cfg), _largest_layer(teacher_cfg))
    buffers = 2 * 2 * layer * 2 / tp
    kept, rest = act_per_token["full"], act_per_token[mode] - act_per_token["full"]
    act = (kept + rest / tp) * width_ratio / 2 * SEQ_REAL
    logits = 0 if fused else 2 * SEQ_REAL * student_cfg.vocab_size * 4 / tp
    total = state + buffers + act + logits
    return {"gpus": gpus, "tp": tp, "state_gb": round(state / 1e9, 2), "fsdp_buffers_gb": round(buffers / 1e9, 2),
            "activations_gb": round(act / 1e9, 2), "logits_gb": round(logits / 1e9, 2),
            "total_gb": round(total / 1e9, 2)}


def _largest_layer(cfg) -> int:
    from remodel.models.hf import our_shapes
    per = {}
    for name, shape in our_shapes(cfg).items():
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name
        per[key] = per.get(key, 0) + math.prod(shape)
    return max(per.values())


def smallest_gpus(student_cfg, teacher_cfg, act, ratio, mode, fused) -> dict:
    """The fewest H100s (a multiple of 8) that fit the job at 90% of 80 GB, over TP 1, 2, 4, 8."""
    best = None
    for tp in (1, 2, 4, 8):
        for n in range(8, 1025, 8):
            r = project(student_cfg, teacher_cfg, act, ratio, n, tp, mode, fused)
            if r["total_gb"] <= H100_GB * USABLE:
                if best is None or n < best["gpus"]:
                    best = r
                break
    return best or {"gpus": None}


def projections(student_dir: Path, s_cfg) -> dict:
    act = activation_bytes_per_token(student_dir)
    s_real, t_real = reference("nemotron-h-47b"), reference("nemotron-h-56b")
    ratio = s_real.hidden_size / s_cfg.hidden_size
    return {"activation_bytes_per_token_fp32": act,
            "projection_56b_to_47b_8k": {f"{m}{' + fused loss' if f else ''}": smallest_gpus(s_real, t_real, act, ratio,
                                                                                           m, f)
                                         for m in act for f in (False, True)}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=32)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--projection-only", type=Path, metavar="JSON",
                    help="recompute the projection of an earlier run's JSON (its --out folder must still exist)")
    a = ap.parse_args()
    if a.projection_only:
        res = json.loads(a.projection_only.read_text())
        student = Path(res["dir"]) / "student"
        res.update(projections(student, config_from_hf(read_config_dict(student))))
        print(json.dumps(res, indent=1))
        (REPO / "bench" / "rehearsal_56b.json").write_text(json.dumps(res, indent=1) + "\n")
        return
    root = a.out or Path(tempfile.mkdtemp(prefix="rehearsal-"))
    root.mkdir(parents=True, exist_ok=True)
    a.data = embedded_corpus()[0]
    teacher, student = build(root, a.scale)
    s_cfg, t_cfg = config_from_hf(read_config_dict(student)), config_from_hf(read_config_dict(teacher))
    res = {"machine": "2-core CPU VM, 24 GiB, gloo, OMP_NUM_THREADS=1 per process", "scale": a.scale, "dir": str(root),
           "student_params": count_params(s_cfg)["total"], "teacher_params": count_params(t_cfg)["total"],
           "student_layers": len(s_cfg.pattern), "teacher_layers": len(t_cfg.pattern),
           "flags": {"steps": a.steps, "seq_len": a.seq_len, "batch": a.batch}}
    res["state_mb"] = {"student_fp32_train": 16 * res["student_params"] / 2**20,
                       "teacher_fp32": 4 * res["teacher_params"] / 2**20}
    runs = {}
    runs["one_process"] = distill(root, "one", teacher, student, a, 1, 1)
    runs["dp2_tp2"] = distill(root, "dp2tp2", teacher, student, a, 4, 2)
    runs["dp4"] = distill(root, "dp4", teacher, student, a, 4, 1)
    runs["killed_dp2_tp2"] = distill(root, "killed", teacher, student, a, 4, 2, kill_after_step=2)
    shutil.copytree(root / "killed.run", root / "killed1.run", ignore=shutil.ignore_patterns("peak-rss-*"))
    runs["resumed_dp4"] = distill(root, "killed", teacher, student, a, 4, 1, resume=True)
    runs["resumed_one_process"] = distill(root, "killed1", teacher, student, a, 1, 1, resume=True)
    ref = [r["loss"] for r in runs["one_process"]["report"]["history"]]
    for k in ("dp2_tp2", "dp4", "resumed_dp4", "resumed_one_process"):
        rep = runs[k]["report"]
        if rep:
            got = [r["loss"] for r in rep["history"]]
            runs[k]["max_rel_loss_diff_vs_one_process"] = max(abs(x - y) / abs(y) for x, y in zip(got, ref))
    for v in runs.values():
        v.pop("report", None)
    res["runs"] = runs
    one = max(runs["one_process"]["rss_mb"][0].values())
    res["peak_rss_ratio_4_ranks_vs_one"] = {k: max(max(m.values()) for m in runs[k]["rss_mb"].values()) / one
                                             for k in ("dp2_tp2", "dp4")}
    res.update(projections(student, s_cfg))
    # check the model against the rehearsal: DP 4 per-rank state (fp32: 16 B student, 4 B teacher) + activations
    # of batch/4 sequences of seq_len, over the one-process baseline minus its own full share
    base = one - (16 * res["student_params"] + 4 * res["teacher_params"]) / 2**20
    pred = base + (16 * res["student_params"] + 4 * res["teacher_params"]) / 4 / 2**20
    res["check"] = {"predicted_dp4_rank_mb": pred,
                    "measured_dp4_rank_mb": max(max(m.values()) for m in runs["dp4"]["rss_mb"].values())}
    print(json.dumps(res, indent=1))
    (REPO / "bench" / "rehearsal_56b.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
