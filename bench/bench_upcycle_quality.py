"""Upcycling quality: the embedded dense model vs its upcycled MoE, each trained further on the same tokens.

1. An fp32 copy of data/embedded (dense relu2 hybrid `M-M*M-M-`, shipped in bf16): with fp32 weights the
   expert scale s = G^(1/3) rounds at fp32, so the MoE starts equal to the dense model (to ~1e-6).
2. upcycle(..., router="sigmoid", exact=True): Nemotron-H's normalised sigmoid router, virtual groups.
3. pipelines.train.train on both, same `--tokens` from every `--stride`-th chapter of the embedded train
   split (spread over the whole Bible: its first tokens are Genesis alone, unlike the held-out chapters,
   and both models drift towards them), same seed, batch, lr schedule (linear warm-up, cosine to lr/10); the trainer adds the load-balancing loss (1e-2) for
   the MoE only. Held-out loss on the whole valid split before and after.
Prints a markdown block; records it under "## Upcycling" in bench/RESULTS.md unless --no-record.
    python bench/bench_upcycle_quality.py [--experts 8 --granularity 4 --top-k 4 --tokens 131072 --lr 1e-3]
"""
from __future__ import annotations

import argparse
import gzip
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_upcycle import record  # noqa: E402
from models.load import load_model, save_model  # noqa: E402
from pipelines.data import embedded_corpus  # noqa: E402
from pipelines.train import train  # noqa: E402
from upcycle.pipeline import upcycle  # noqa: E402

EMBEDDED = ROOT / "data" / "embedded"
SUBHEAD = "### Quality after further training (bench/bench_upcycle_quality.py)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--granularity", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=131_072)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stride", type=int, default=7, help="train on every k-th chapter of the train split")
    ap.add_argument("--threads", type=int, default=1, help="1: two threads stall 4-5x on a busy 2-core machine")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    train_txt, valid_txt = embedded_corpus()
    t0 = time.time()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with gzip.open(train_txt, "rt", encoding="utf-8") as f:
            chapters = [line for line in f if line.strip()]
        (tmp / "train.txt").write_text("".join(chapters[::a.stride]), encoding="utf-8")
        save_model(load_model(EMBEDDED), tmp / "dense", dtype=torch.float32, aux_from=EMBEDDED)
        up = upcycle(tmp / "dense", tmp / "moe", a.experts, a.granularity, a.top_k, router="sigmoid", exact=True,
                     seed=a.seed)
        for name in ("dense", "moe"):
            t = time.time()
            runs[name] = train(tmp / name, tmp / f"{name}-trained", data=tmp / "train.txt", tokens=a.tokens,
                               seq_len=a.seq_len, batch=a.batch, lr=a.lr, seed=a.seed, eval_data=valid_txt,
                               checkpoint_every=10**9, keep_last=1, log_every=0)
            runs[name]["wall_s"] = time.time() - t
    d, m = runs["dense"], runs["moe"]
    steps, tokens = d["steps"], d["tokens"]
    assert (m["steps"], m["tokens"], m["data_tokens"]) == (steps, tokens, d["data_tokens"])
    dev = up["deviation"]
    prm = up["params"]

    def row(name, r, total, active):
        b, e = r["eval"]["before"], r["eval"]["after"]
        return (f"| {name} | {total / 1e6:.3f}M | {active / 1e6:.3f}M | {b['loss']:.5f} / {b['ppl']:.2f} | "
                f"{e['loss']:.5f} / {e['ppl']:.2f} | {r['final_loss']:.4f} | {r['tokens_per_s']:.0f} | "
                f"{e['tokens_per_s']:.0f} |")

    gap = m["eval"]["after"]["loss"] - d["eval"]["after"]["loss"]
    winner = "MoE" if gap < 0 else "dense"
    body = "\n".join([
        f"- {time.strftime('%Y-%m-%d')} {platform.machine()}, {os.cpu_count()} cpus shared with other jobs, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, fp32. Source: data/embedded (`M-M*M-M-`, relu2 FFN "
        f"768) as fp32. Upcycled: N={a.experts} G={a.granularity} T={a.top_k} (E={a.experts // a.granularity} virtual "
        f"groups, top-{a.top_k // a.granularity} group, expert size {up['expert_size']}), sigmoid router + "
        f"norm_topk_prob (Nemotron-H), s = G^(1/3), exact at init: upcycle's own check max |dlogit| "
        f"{dev['max_abs_logit_diff']:.1e}.",
        f"- Both trained with pipelines.train.train on the same {tokens:,} tokens (every {a.stride}th chapter of the "
        f"embedded train split, {d['data_tokens']:,} tokens packed, {d['epochs']:.2f} epochs of it; {steps} steps of "
        f"{a.batch}x{a.seq_len}, seed {a.seed}), AdamW lr {a.lr:g} (warm-up "
        f"{min(100, steps // 10)} steps, cosine to {a.lr / 10:g}), wd 0.1, clip 1.0; the MoE adds the "
        f"load-balancing loss (coeff 1e-2). Held-out: all {d['eval']['after']['tokens']:,} tokens of the valid "
        f"split, seq {a.seq_len}.",
        "",
        "| model | total params | active params | held-out loss / ppl at init | after training | "
        "final train loss | train tok/s | eval tok/s |",
        "|---|---|---|---|---|---|---|---|",
        row("dense (continued)", d, prm["dense"], prm["dense"]),
        row(f"MoE N{a.experts} G{a.granularity} T{a.top_k}", m, prm["moe_total"], prm["moe_active"]),
        "",
        f"- **{winner} wins**: held-out loss MoE - dense = {gap:+.4f} nats "
        f"(ppl {m['eval']['after']['ppl']:.2f} vs {d['eval']['after']['ppl']:.2f}); at init the gap is "
        f"{m['eval']['before']['loss'] - d['eval']['before']['loss']:+.1e}. Train tok/s are noisy (shared CPU). "
        f"Whole bench {time.time() - t0:.0f} s.",
    ])
    print(body)
    if not a.no_record:
        record(SUBHEAD, body)


if __name__ == "__main__":
    main()
