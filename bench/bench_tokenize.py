"""Tokenizing the shipped corpus into a token set with num_proc=1 against num_proc=2, in one process.

Both runs are pipelines.data.tokens.tokenize (load_texts + datasets.map + streaming tokens.bin); they alternate
(1, 2, 1, 2, ...) so machine load hits both alike, and best-of and median times are printed with the
ratio t(num_proc=1) / t(num_proc=2). Goal (issue 16): >= 1.5x. Both outputs must have the same
fingerprint. TOKENIZERS_PARALLELISM=false keeps the Rust tokenizer single-threaded inside each process,
so the baseline is one core.

    python bench/bench_tokenize.py [--rounds 5] [--procs 2]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path  # noqa: E402
from remodel.pipelines.data.tokens import load_tokenizer, tokenize  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (each runs both settings)")
    ap.add_argument("--procs", type=int, default=2, help="num_proc compared against 1")
    a = ap.parse_args()
    tok = load_tokenizer(embedded_tokenizer_path())
    data = embedded_corpus()[0]
    times = {1: [], a.procs: []}
    prints = set()
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds + 1):  # round 0 warms caches and the fork path, not timed
            for n in times:
                t = time.perf_counter()
                meta = tokenize(data, Path(d) / f"out{r}-{n}", tok, num_proc=n)
                if r:
                    times[n].append(time.perf_counter() - t)
                prints.add(meta["fingerprint"])
    assert len(prints) == 1, "num_proc changed the token set"
    best = {n: min(v) for n, v in times.items()}
    med = {n: statistics.median(v) for n, v in times.items()}
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}; corpus {data.name}: {meta['n_docs']} docs, {meta['n_tokens']} tokens")
    for n in times:
        print(f"num_proc={n}: best {best[n]:.3f} s, median {med[n]:.3f} s  ({', '.join(f'{x:.2f}' for x in times[n])})")
    print(f"speedup num_proc={a.procs} vs 1: best-of {best[1] / best[a.procs]:.2f}x, "
          f"median {med[1] / med[a.procs]:.2f}x")


if __name__ == "__main__":
    main()
