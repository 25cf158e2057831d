"""Cost of the importance hooks: calibration tokens/s with the Scorer attached vs the plain forward.

Both are timed in the same process on the same batches, interleaved rep by rep (the CPU is shared),
each step being what score_model does per batch: forward to the final norm, then the LM loss. Two hooked
figures: *steady*, a Scorer whose routed-output sample is already full (every calibration batch after the
first SAMPLE_TOKENS tokens of each MoE layer), and *first*, a fresh Scorer, whose MoE layers also run every
expert on the step's tokens for the reconstruction sample (compress/expert_select.py).

    python bench/bench_score.py [--batch 4 --seq-len 512 --reps 7 --threads 2] [--write]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remodel.compress.expert_select import SAMPLE_TOKENS  # noqa: E402
from remodel.compress.importance import Scorer, head_weight, lm_loss_sums  # noqa: E402
from remodel.models.config import ModelConfig  # noqa: E402
from remodel.models.model import HybridLM, init_weights  # noqa: E402

BASE = dict(vocab_size=2048, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            intermediate_size=1024, mamba_num_heads=8, mamba_head_dim=64, n_groups=2, ssm_state_size=64,
            chunk_size=128, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
            moe_shared_expert_intermediate_size=512)
MODELS = {"hybrid M*-": "M-M-M*M-M-M-", "hybrid M*-E": "M-M*MEM-ME"}


@torch.no_grad()
def step(model, ids):
    h, _ = model.hidden(ids)
    return lm_loss_sums(h, head_weight(model), ids)


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def measure(model, ids, reps):
    """-> {plain, hooked, first}: tokens per wall second and per CPU second, best of reps (least disturbed);
    hooked = a Scorer with its routed-output sample full, first = a fresh Scorer's first step."""
    plain, hooked, first = [], [], []
    step(model, ids)  # warm-up, both ways
    Scorer(model).attach().detach()
    for _ in range(reps):
        plain.append(timed(lambda: step(model, ids)))
        scorer = Scorer(model).attach()
        first.append(timed(lambda: step(model, ids)))
        for _ in range(-(-SAMPLE_TOKENS // ids.numel()) - 1):  # the rest of the sample, untimed
            step(model, ids)
        hooked.append(timed(lambda: step(model, ids)))
        scorer.result()
        scorer.detach()
    n = ids.numel()
    best = lambda ts, k: n / min(t[k] for t in ts)  # noqa: E731
    return {"plain": best(plain, 0), "hooked": best(hooked, 0), "first": best(first, 0),
            "plain_cpu": best(plain, 1), "hooked_cpu": best(hooked, 1), "first_cpu": best(first, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, pattern in MODELS.items():
        model = init_weights(HybridLM(ModelConfig(pattern=pattern, **BASE)), seed=0).eval()
        ids = torch.randint(0, BASE["vocab_size"], (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
        r = dict(name=name, pattern=pattern, params=sum(p.numel() for p in model.parameters()),
                 **measure(model, ids, args.reps))
        r["overhead"], r["overhead_cpu"] = r["plain"] / r["hooked"] - 1, r["plain_cpu"] / r["hooked_cpu"] - 1
        r["overhead_first"] = r["plain"] / r["first"] - 1
        rows.append(r)
        print(f"{name:12s} {r['params'] / 1e6:5.2f}M params: plain {r['plain']:7.0f} tok/s, hooks {r['hooked']:7.0f} "
              f"tok/s, overhead {r['overhead']:+.1%} wall, {r['overhead_cpu']:+.1%} CPU time "
              f"({r['plain_cpu']:.0f} vs {r['hooked_cpu']:.0f} tok per CPU-s; goal <= 10%); first step of a fresh "
              f"scorer {r['first']:.0f} tok/s ({r['overhead_first']:+.1%})", flush=True)
    if args.write:
        write_results(rows, args)


def write_results(rows, args):
    path = Path(__file__).with_name("RESULTS.md")
    head = "## Scoring overhead"
    lines = [head, "",
             f"`python bench/bench_score.py --threads {args.threads} --reps {args.reps} --write`, "
             f"{datetime.date.today()}: calibration step (forward to norm_f + LM loss) with the importance hooks "
             f"attached vs without, same process, interleaved, best of {args.reps} (wall clock and process CPU time). Machine: {os.cpu_count()}-core "
             f"CPU ({platform.processor() or platform.machine()}) shared with other jobs, torch {torch.__version__}, "
             f"{args.threads} threads, fp32, batch {args.batch} x {args.seq_len} tokens, hidden {BASE['hidden_size']}, "
             f"vocab {BASE['vocab_size']}. Goal: overhead <= 10%. *With hooks*: every calibration batch once each "
             f"MoE layer's routed-output sample (its first {SAMPLE_TOKENS} tokens) is full; *first*: a fresh "
             f"scorer's first step, whose MoE layers also run every expert on the step's tokens for that sample.", "",
             "| model | pattern | params | plain tok/s | with hooks tok/s | overhead (wall) | "
             "overhead (CPU time) | first step tok/s (overhead) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | `{r['pattern']}` | {r['params'] / 1e6:.2f}M | {r['plain']:.0f} | "
                     f"{r['hooked']:.0f} | {r['overhead']:+.1%} | {r['overhead_cpu']:+.1%} | "
                     f"{r['first']:.0f} ({r['overhead_first']:+.1%}) |")
    section = "\n".join(lines) + "\n"
    text = path.read_text() if path.exists() else ""
    if head in text:  # replace our own earlier section, keep everyone else's
        start = text.index(head)
        nxt = text.find("\n## ", start + len(head))
        text = text[:start] + section + (text[nxt:] if nxt != -1 else "")
        path.write_text(text)
    else:
        with open(path, "a") as f:
            f.write(("" if not text else "\n" if text.endswith("\n") else "\n\n") + section)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
