"""Figures of a training run: model FLOPs per token and the MFU reference, metrics.csv, loss.png and
the report dict (remodel_report.json)."""
from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import torch


def param_count(model) -> int:
    """Parameters of the full model, also when `model` holds only this rank's shards."""
    from remodel.models.hf import our_shapes
    shapes = our_shapes(model.cfg)
    return sum(math.prod(shapes[n]) if n in shapes else p.numel() for n, p in model.named_parameters())


def matmul_params(model) -> int:
    """Parameters used in matmuls per token: the active count (models.params.active_params, the MTP head
    included when the model has one) less the untied embedding table, which is a lookup (full-model
    figures, also for a sharded model)."""
    from remodel.models.params import active_params
    cfg = model.cfg
    lookup = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return active_params(cfg, with_mtp=hasattr(model, "mtp")) - lookup


def forward_flops_per_token(model, seq_len: int) -> float:
    """2 * matmul params + attention scores/values (4 * seq * heads * head_dim per attention layer,
    no causal discount); the Mamba scan and elementwise work are not counted."""
    from remodel.models.kinds import layer_kinds
    return 2.0 * matmul_params(model) + sum(k.mixing_flops(model.cfg, seq_len) for k in layer_kinds(model.cfg))


_PEAK: dict = {}


def measure_matmul_flops(device: torch.device, dtype=torch.float32, n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of one n x n matmul on `device` (the reference for the MFU estimate; measured once per
    process, device and dtype)."""
    key = (str(device), dtype, n)
    if key in _PEAK:
        return _PEAK[key]
    g = torch.Generator().manual_seed(0)  # leaves the global RNG alone
    a = torch.randn(n, n, generator=g).to(device, dtype)
    b = torch.randn(n, n, generator=g).to(device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    inner = 50 if device.type == "cuda" else 1
    a @ b
    sync()
    best = float("inf")
    for _ in range(reps):  # best of reps: the machine may be shared
        t = time.perf_counter()
        for _ in range(inner):
            a @ b
        sync()
        best = min(best, time.perf_counter() - t)
    _PEAK[key] = 2.0 * n**3 * inner / best
    return _PEAK[key]


METRIC_COLUMNS = ("step", "loss", "kl", "lm", "hidden", "lb", "z", "lr", "grad_norm", "tokens_per_s")


def write_metrics(history: list[dict], path: Path):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(METRIC_COLUMNS)
        for row in history:
            w.writerow(["" if row.get(c) is None else row.get(c) for c in METRIC_COLUMNS])


def plot_losses(history: list[dict], path: Path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in history]
    ax.plot(steps, [r["loss"] for r in history], label="loss")
    for key in ("kl", "lm", "hidden"):
        ys = [r.get(key) for r in history]
        if any(y is not None for y in ys) and ys != [r["loss"] for r in history]:
            ax.plot(steps, [math.nan if y is None else y for y in ys], "--", label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(args, family, n_params, steps, tokens_per_step, data_tokens: int, resumed_from, run_dir, history, evals,
            tok_s, flops_tok, peak, t_start) -> dict:
    """remodel_report.json of a training run. peak: matmul FLOP/s of all the devices used together."""
    return {
        "command": "distill" if args["teacher_dir"] else "train", "args": args, "family": family,
        "params": n_params,
        "steps": steps, "tokens_per_step": tokens_per_step, "tokens": steps * tokens_per_step,
        "data_tokens": data_tokens, "epochs": steps * tokens_per_step / data_tokens,
        "resumed_from": resumed_from, "run_dir": str(run_dir),
        "final_loss": history[-1]["loss"] if history else None,
        "eval": {k: v for k, v in evals.items()},
        "eval_ppl": evals["after"]["ppl"] if "after" in evals else None,
        "tokens_per_s": tok_s, "flops_per_token": flops_tok, "matmul_flops_per_s": peak,
        "mfu": flops_tok * tok_s / peak if tok_s else None,
        "mfu_note": "model FLOPs (6N student + 2N teacher + attention) over one measured 1024^3 matmul",
        "time_s": time.time() - t_start, "history": history,
    }


class PeakRSS:
    """This process's peak resident memory (MB, the kernel's high-water mark) at the end of each phase of
    a run (load, first checkpoint, train, export); written per rank beside the checkpoints."""

    def __init__(self):
        self.marks: dict[str, float] = {}

    @staticmethod
    def now_mb() -> float:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def mark(self, phase: str, first: bool = False):
        if not (first and phase in self.marks):
            self.marks[phase] = round(self.now_mb(), 1)

    def write(self, path: Path):
        import json
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.marks) + "\n")
