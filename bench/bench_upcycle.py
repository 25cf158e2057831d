"""Upcycling throughput: `upcycle` vs a plain streaming copy of the same checkpoint.

Builds a synthetic Nemotron-H-style dense checkpoint (bf16, a few hundred MB) in a temp dir, then
times models.checkpoint.copy_checkpoint(src), upcycle(src) and copy_checkpoint(upcycled) (the same
bytes the upcycle writes), best of --repeats. Prints the ratios and appends them to bench/RESULTS.md
under "## Upcycling".
    python bench/bench_upcycle.py [--experts 16 --granularity 4 --top-k 8 --hidden 1024 --ffn 4096]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.checkpoint import copy_checkpoint  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.load import save_model  # noqa: E402
from models.model import HybridLM  # noqa: E402
from upcycle.pipeline import upcycle  # noqa: E402


def dense_checkpoint(path, hidden, ffn, pattern, vocab):
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, pattern=pattern, num_attention_heads=hidden // 128,
                      num_key_value_heads=2, head_dim=128, intermediate_size=ffn, mamba_num_heads=hidden // 32,
                      mamba_head_dim=64, n_groups=4, ssm_state_size=128, chunk_size=128)
    torch.manual_seed(0)
    with torch.no_grad():
        model = HybridLM(cfg)
        for p in model.parameters():
            p.normal_(0, 0.02)
    save_model(model, path, dtype=torch.bfloat16, max_shard_bytes=256 * 1024**2)
    return cfg


def best(fn, repeats):
    """(fastest wall time, that run's result)"""
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        r = fn()
        runs.append((time.perf_counter() - t, r))
    return min(runs, key=lambda tr: tr[0])


def size(path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--granularity", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--pattern", default="M-M*-M-M-M-M-")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        dense_checkpoint(tmp / "dense", a.hidden, a.ffn, a.pattern, a.vocab)
        n = [0]

        def run_copy(src):
            n[0] += 1
            return copy_checkpoint(src, tmp / f"copy{n[0]}")

        def run_upcycle():
            n[0] += 1
            return upcycle(tmp / "dense", tmp / f"moe{n[0]}", a.experts, a.granularity, a.top_k)

        t_copy, _ = best(lambda: run_copy(tmp / "dense"), a.repeats)
        t_up, rep = best(run_upcycle, a.repeats)
        moe = tmp / f"moe{n[0]}"
        t_copy_out, _ = best(lambda: run_copy(moe), a.repeats)
        t_write, t_check = rep["seconds"]["upcycle_and_write"], rep["seconds"]["deviation_check"]
        src_mb, out_mb = size(tmp / "dense") / 2**20, size(moe) / 2**20
    dev = rep["deviation"].get("max_abs_logit_diff")
    dev = f"{dev:.2g}" if dev is not None else rep["deviation"]["skipped"]
    line = (f"- {time.strftime('%Y-%m-%d')} {platform.machine()}, {os.cpu_count()} cpus shared with other jobs, "
            f"torch {torch.__version__}: dense {src_mb:.0f} MB bf16 (H={a.hidden}, F={a.ffn}, `{a.pattern}`) -> "
            f"N={a.experts} G={a.granularity} T={a.top_k} ({out_mb:.0f} MB), best of {a.repeats}\n"
            f"  - copy_checkpoint(dense) {t_copy:.2f}s, copy_checkpoint(upcycled, same bytes as the upcycle writes) "
            f"{t_copy_out:.2f}s\n"
            f"  - upcycle {t_up:.2f}s = convert+write {t_write:.2f}s + fp32 deviation check {t_check:.2f}s "
            f"(initial max |dlogit| {dev})\n"
            f"  - **ratio upcycle/copy(dense) {t_up / t_copy:.2f}x** (convert+write only {t_write / t_copy:.2f}x); "
            f"upcycle/copy(same output bytes) {t_up / t_copy_out:.2f}x (convert+write only {t_write / t_copy_out:.2f}x)")
    print(line)
    if not a.no_record:
        results = ROOT / "bench" / "RESULTS.md"
        text = results.read_text() if results.exists() else ""
        heads = [ln for ln in text.splitlines() if ln.startswith("## ")]
        with open(results, "a") as f:
            if not heads or heads[-1].strip() != "## Upcycling":
                f.write(("\n" if text and not text.endswith("\n\n") else "") + "## Upcycling\n\n")
            f.write(line + "\n")


if __name__ == "__main__":
    main()
