"""Distillation vs LM-only retraining of a pruned model at an equal token budget (CPU).

The embedded 3.36M-parameter hybrid (data/embedded, `M-M*M-M-`) is the teacher. It is scored on the
train split (pipelines.commands.score: activation importance) and pruned (pipelines.commands.prune) to about half its
parameters: FFN 768 -> 384, Mamba heads 8 -> 4, hidden 256 -> 192 (the `remodel demo` targets, 53%).
The pruned student is then trained through pipelines.training.train.train with the same tokens, lr schedule,
data order and seed either
  (a) by logit distillation from the teacher (KL(teacher || student), `remodel distill`'s defaults), or
  (b) by the next-token loss alone (`remodel train`).
Held-out perplexity on the whole valid split (seq 256) of the teacher, the pruned model before training,
(a) and (b); training tokens/s of both runs on this CPU.

    python bench/bench_distill_quality.py [--steps 100] [--batch 8] [--seq-len 256] [--lr 2e-3] [--threads 2]
                                          [--write]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin on a shared machine
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remodel.models.load import load_config  # noqa: E402
from remodel.models.params import count_params  # noqa: E402
from remodel.pipelines.data.data import DATA_DIR, embedded_corpus  # noqa: E402
from remodel.pipelines.commands.prune import prune  # noqa: E402
from remodel.pipelines.commands.score import score  # noqa: E402
from remodel.pipelines.training.evaluate import evaluate  # noqa: E402
from remodel.pipelines.training.train import train  # noqa: E402

TEACHER = DATA_DIR / "embedded"
SECTION = "## Distillation quality"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--samples", type=int, default=128, help="calibration sequences for the scores")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", help="keep the intermediate checkpoints here (default: a temporary dir)")
    ap.add_argument("--write", action="store_true", help=f"replace the '{SECTION}' section of bench/RESULTS.md")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t_all = time.time()
    train_txt, valid_txt = embedded_corpus()
    cfg = load_config(TEACHER)
    targets = dict(ffn_size=cfg.mlp.intermediate_size // 2, mamba_heads=cfg.mamba.mamba_num_heads // 2,
                   hidden_size=cfg.hidden_size * 3 // 4)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        t = time.time()
        score(TEACHER, train_txt, work / "scores", samples=a.samples, seq_len=a.seq_len, batch=8, overwrite=True)
        prune(TEACHER, work / "pruned", scores_dir=work / "scores", overwrite=True, **targets)
        t_prune = time.time() - t
        common = dict(data=train_txt, steps=a.steps, seq_len=a.seq_len, batch=a.batch, lr=a.lr, warmup=a.warmup,
                      checkpoint_every=10**9, seed=0, log_every=0, overwrite=True)
        runs = {"distill": train(work / "pruned", work / "distilled", teacher_dir=TEACHER, **common),
                "lm": train(work / "pruned", work / "lm_only", **common)}
        assert runs["distill"]["tokens"] == runs["lm"]["tokens"]
        ev = {}
        for name, path in (("teacher", TEACHER), ("pruned", work / "pruned"), ("distill", work / "distilled"),
                           ("lm", work / "lm_only")):
            ev[name] = evaluate(path, valid_txt, seq_len=a.seq_len, batch=8)
            ev[name]["params"] = count_params(load_config(path))["total"]
            print(f"{name}: params {ev[name]['params']:,}, held-out loss {ev[name]['loss']:.4f}, "
                  f"ppl {ev[name]['ppl']:.2f}", flush=True)

    tokens = runs["lm"]["tokens"]
    rows = [("teacher (data/embedded)", "teacher", "-", None),
            ("pruned, before training", "pruned", "-", None),
            ("pruned + distillation (KL from the teacher)", "distill", f"{tokens:,}", runs["distill"]),
            ("pruned + LM loss only", "lm", f"{tokens:,}", runs["lm"])]
    table = ["| model | params | training tokens | held-out loss | held-out ppl | train tok/s (CPU) | train time |",
             "|---|---|---|---|---|---|---|"]
    for label, key, tok, rep in rows:
        speed = f"{rep['tokens_per_s']:,.0f}" if rep else "-"
        secs = f"{rep['tokens'] / rep['tokens_per_s']:.0f} s" if rep else "-"
        table.append(f"| {label} | {ev[key]['params']:,} | {tok} | {ev[key]['loss']:.4f} | {ev[key]['ppl']:.2f} | "
                     f"{speed} | {secs} |")
    gain = ev["lm"]["ppl"] / ev["distill"]["ppl"]
    closed = (ev["pruned"]["loss"] - ev["distill"]["loss"]) / (ev["pruned"]["loss"] - ev["teacher"]["loss"])
    closed_lm = (ev["pruned"]["loss"] - ev["lm"]["loss"]) / (ev["pruned"]["loss"] - ev["teacher"]["loss"])
    head = (f"bench/bench_distill_quality.py, {time.strftime('%Y-%m-%d')}: {platform.machine()} 2-core CPU shared "
            f"with other jobs, torch {torch.__version__}, {torch.get_num_threads()} thread(s), fp32. Teacher = "
            f"data/embedded; student = the teacher scored on {a.samples} x {a.seq_len} train-split tokens "
            f"(activation importance) and pruned to FFN {targets['ffn_size']}, {targets['mamba_heads']} Mamba heads, "
            f"hidden {targets['hidden_size']} ({ev['pruned']['params'] / ev['teacher']['params']:.0%} of the "
            f"parameters). Both runs: {a.steps} steps x {a.batch} x {a.seq_len} tokens of the train split, same "
            f"order and seed, AdamW lr {a.lr:g} (warm-up {a.warmup}, cosine to lr/10), grad clip 1.0; distillation "
            f"= pure KL(teacher || student) at T=1 (`remodel distill` defaults), LM = next-token cross-entropy. "
            f"Held-out = all {ev['teacher']['tokens']:,} valid-split tokens, seq {a.seq_len}.")
    summary = (f"Distillation ends at {gain:.2f}x lower held-out perplexity than LM-only training on the same "
               f"tokens; it recovers {closed:.0%} of the pruned-to-teacher loss gap (LM-only {closed_lm:.0%}). "
               f"Distillation throughput (student forward + backward + teacher forward) "
               f"{runs['distill']['tokens_per_s']:,.0f} tokens/s vs {runs['lm']['tokens_per_s']:,.0f} for LM-only "
               f"on this CPU. Whole benchmark {time.time() - t_all:.0f} s (scoring + pruning {t_prune:.0f} s).")
    text = "\n".join([SECTION, "", head, "", *table, "", summary, ""])
    print("\n" + text)
    if a.write:
        path = Path(__file__).resolve().parent / "RESULTS.md"
        write_section(path, text)
        print(f"wrote the '{SECTION}' section of {path}")


def write_section(path: Path, text: str):
    """Replace (or append) the SECTION of the markdown file `path` with `text`, leaving the others alone."""
    old = path.read_text() if path.exists() else ""
    parts = [p if i == 0 else "## " + p for i, p in enumerate(old.split("\n## "))]
    kept = [p.rstrip("\n") for p in parts if p.strip() and p.splitlines()[0].strip() != SECTION]
    path.write_text("\n\n".join(kept + [text.rstrip("\n")]) + "\n")


if __name__ == "__main__":
    main()
