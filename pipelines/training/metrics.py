"""Figures of a training run: model FLOPs per token and the MFU reference, metrics.csv, loss.png and
the report dict (remodel_report.json)."""
from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import torch

from remodel.models.moe import router_probs

from .held_out import LOSS_TERMS, last_losses


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
    return 2.0 * matmul_params(model) + sum(k.mixing_flops(model.cfg.view(k), seq_len) for k in layer_kinds(model.cfg))


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
MOE_FIGURES = ("load_balance", "router_entropy", "expert_cosine_same_shard", "expert_cosine_all_pairs")  # MoEStats
MOE_METHOD = ("per MoE layer, over each interval of record_every_steps steps: load_balance = max / mean tokens per "
              "expert; router_entropy = mean over tokens of the entropy of the router's distribution over the "
              "experts (softmax of the logits, or sigmoid scores normalised to sum 1); at the interval's end, the "
              "mean pairwise cosine of the experts' flattened weights, same_shard over the experts built from one "
              "dense shard (e = e' mod granularity, known from an upcycled student's config.json), all_pairs over "
              "all; measured in a single process only")


def write_metrics(history: list[dict], path: Path):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(METRIC_COLUMNS)
        for row in history:
            w.writerow(["" if row.get(c) is None else row.get(c) for c in METRIC_COLUMNS])


def plot_losses(history: list[dict], path: Path, title: str):
    """loss.png: the losses per step; for an MoE student also a panel per MoE figure (MoEStats), a line per layer."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    moe = [r for r in history if r.get("moe")]
    panels = [k for k in MOE_FIGURES if any(f.get(k) is not None for r in moe for f in r["moe"].values())]
    fig, axes = plt.subplots(1, 1 + len(panels), figsize=(7 + 4.5 * len(panels), 4), squeeze=False)
    ax = axes[0][0]
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
    for key, ax in zip(panels, axes[0][1:]):
        _moe_panel(ax, moe, key)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _moe_panel(ax, rows: list[dict], key: str):
    """One MoE figure over the recorded steps, a line per layer."""
    for label in sorted({lb for r in rows for lb in r["moe"]}, key=lambda x: (len(x), x)):
        ys = [r["moe"].get(label, {}).get(key) for r in rows]
        ax.plot([r["step"] for r in rows], [math.nan if y is None else y for y in ys], ".-", label=label)
    ax.set_xlabel("step")
    ax.set_title(key.replace("_", " "))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def report(p, run, data_tokens: int, tok_s) -> dict:
    """remodel_report.json of a training run. p: the run's plan (args, family, steps, tokens_per_step, run_dir,
    t_start); run: its figures (n_params, resumed_from, history, evals, flops_tok, peak: the matmul FLOP/s of all
    the devices used together); tok_s: measured tokens/s (None before a timed step). The loss terms are
    named (last_step_losses, explained in loss_terms); eval: teacher, student before and after on the same
    held-out tokens (the trainer adds "held_out", which names them)."""
    args, steps, tokens_per_step, history, evals = p.args, p.steps, p.tokens_per_step, run.history, run.evals
    flops_tok, peak = run.flops_tok, run.peak
    return {
        "command": "distill" if args["teacher_dir"] else "train", "args": args, "family": p.family,
        "params": run.n_params,
        "steps": steps, "tokens_per_step": tokens_per_step, "tokens": steps * tokens_per_step,
        "data_tokens": data_tokens, "epochs": steps * tokens_per_step / data_tokens,
        "resumed_from": run.resumed_from, "run_dir": str(p.run_dir),
        "last_step_losses": last_losses(history), "loss_terms": LOSS_TERMS,
        "eval": {k: evals[k] for k in ("teacher", "before", "after") if k in evals},  # on the held_out tokens
        "eval_ppl": evals["after"]["ppl"] if "after" in evals else None,
        "tokens_per_s": tok_s, "flops_per_token": flops_tok, "matmul_flops_per_s": peak,
        "mfu": flops_tok * tok_s / peak if tok_s else None,
        "mfu_note": "model FLOPs (6N student + 2N teacher + attention) over one measured 1024^3 matmul",
        "time_s": time.time() - p.t_start, "history": history,
    }


def memory_figures(cfg, c, dp: int, use_bf16: bool, teacher_params: int | None, dev) -> dict:
    """The report's "memory": compress.train_memory's estimate per rank for this run (the one `plan
    --train-memory-gb` filters by; c: the TrainConfig) and, on CUDA, the peak bytes torch allocated; the
    parameter bytes each rank holds are measured in "parallel"'s held_bytes (estimate: student_weight_bytes
    and teacher)."""
    from remodel.compress.train_memory import STATE_BYTES, TrainSetup, train_memory_bytes
    setup = TrainSetup(tp=c.tp, ep=c.ep, dp=dp, recompute=c.recompute, batch=c.batch, seq_len=c.seq_len,
                       act_bytes=2 if use_bf16 else 4, teacher_params=teacher_params or 0)
    est = train_memory_bytes(cfg, setup)
    est["student_weight_bytes"] = est["state"] * 4 // STATE_BYTES  # the fp32 weights within the state
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    return {"estimate_per_rank": est, "peak_allocated_bytes": peak, "unit": "bytes (GiB = 2**30)"}


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


class MoEStats:
    """Per MoE layer of a training run ("layers.i", the trunk's and the MTP head's): load balance (max /
    mean tokens per expert, >= 1), router entropy (mean over tokens of the entropy of the router's
    distribution over the E experts: the softmax of its logits, or its sigmoid scores normalised to sum
    to 1; in [0, log E]) and the experts' similarity (upcycle.similarity: the mean pairwise cosine of
    their flattened weights, same_shard over the experts built from one dense shard, all_pairs over all).
    Router outputs come from forward hooks on the Router modules (models.moe): a hook keeps the last
    output of its router, and `collect`, called after each micro-batch's backward, adds it to the
    interval's sums (activation recomputation replays the same forward, so keeping rather than adding
    counts each micro-batch once). The shard origin of an expert (e mod G) is known when the student is
    an upcycled checkpoint: config.json's UPCYCLE_KEY (written by `remodel upcycle`) gives G; without
    it same_shard is None and only all_pairs is given. Similarity is measured in a single process only
    (sharded experts would need gathering); router counts are summed over the data-parallel ranks."""

    def __init__(self, model, granularity: int | None, measure_weights: bool):
        from remodel.models.moe import Router
        self.granularity, self.measure_weights = granularity, measure_weights
        self.routers = {n.rsplit(".mixer.", 1)[0]: m for n, m in model.named_modules() if isinstance(m, Router)}
        self.last: dict = {}
        self.sums: dict = {}
        self.handles = [m.register_forward_hook(self._hook(label)) for label, m in self.routers.items()]

    def _hook(self, label: str):
        def keep(module, inputs, out):  # out: (logits [T, E], weights [T, k], indices [T, k])
            self.last[label] = (module.cfg.moe.router, out[0].detach(), out[2].detach())
        return keep

    @torch.no_grad()
    def collect(self):
        """Adds the routers' last outputs to the interval's sums: [tokens per expert..., entropy sum, tokens]."""
        for label, (kind, logits, idx) in self.last.items():
            z = logits.float()
            p = router_probs(z, kind)
            ent = -(p * p.clamp_min(1e-30).log()).sum(-1)
            row = torch.cat([torch.bincount(idx.reshape(-1), minlength=z.shape[-1]).double(),
                             ent.sum().double().view(1), torch.tensor([ent.numel()], dtype=torch.float64, device=z.device)])
            self.sums[label] = row if label not in self.sums else self.sums[label] + row
        self.last.clear()

    @torch.no_grad()
    def record(self, model, group=None) -> dict:
        """{layer: {load_balance, router_entropy, expert_cosine_same_shard, expert_cosine_all_pairs}} of the
        interval since the last record (collective over `group`, the data-parallel ranks, when given)."""
        import torch.distributed as dist
        out = {}
        for label in sorted(self.sums):
            row = self.sums[label]
            if group is not None:
                dist.all_reduce(row, group=group)
            counts, ent, n = row[:-2], row[-2].item(), row[-1].item()
            out[label] = {"load_balance": (counts.max() / counts.mean().clamp_min(1e-30)).item(),
                          "router_entropy": ent / max(n, 1.0)}
        self.sums.clear()
        for label, sim in (self.similarity(model) or {}).items():
            out.setdefault(label, {}).update(sim)
        return out

    def similarity(self, model) -> dict | None:
        """{layer: {expert_cosine_same_shard, expert_cosine_all_pairs}}; None when not measured."""
        from remodel.models.moe import Experts
        from remodel.upcycle.similarity import expert_similarity
        if not self.measure_weights:
            return None
        out = {}
        for name, m in model.named_modules():
            if isinstance(m, Experts):
                sim = expert_similarity([m.up_proj, m.gate_proj, m.down_proj], self.granularity)
                out[name.rsplit(".mixer.", 1)[0]] = {"expert_cosine_same_shard": sim["same_shard"],
                                                     "expert_cosine_all_pairs": sim["all_pairs"]}
        return out

    def close(self):
        for h in self.handles:
            h.remove()
        self.handles = []



def moe_summary(history: list[dict], initial: dict | None, granularity: int | None, every: int) -> dict:
    """The report's "moe" section: per MoE layer, each figure's series over the recorded steps (the
    history rows that carry "moe"), and the experts' similarity before the first step."""
    layers: dict = {}
    for row in history:
        for label, figs in (row.get("moe") or {}).items():
            d = layers.setdefault(label, {"step": [], **{k: [] for k in MOE_FIGURES}})
            d["step"].append(row["step"])
            for k in MOE_FIGURES:
                d[k].append(figs.get(k))
    return {"layers": layers, "initial": initial, "granularity": granularity, "record_every_steps": every,
            "method": MOE_METHOD}
