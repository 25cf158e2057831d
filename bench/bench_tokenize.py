"""Streaming `remodel tokenize` against datasets.map (the former in-RAM tokenize), same tokenizer and
process count: tokens/s and peak memory.

A corpus of --mb MB is made from the shipped training corpus (its lines repeated). Each measured run is a
fresh subprocess: `stream` is pipelines.data.tokens.tokenize; `map` is load_texts + datasets.map(batched,
num_proc) + the same tokens.bin writing, as tokenize did before issue 27. Peak memory is the largest sum of
proportional set sizes (PSS: pages shared after fork count once) of the process and its workers, sampled
every 20 ms. Runs alternate (stream, map, stream, map, ...) so machine load hits both alike; best-of times
are printed. Goals (issue 27): stream tokens/s >= map's; peak memory flat in the corpus size (compare
--mb 100 with --mb 1000). TOKENIZERS_PARALLELISM=false keeps the Rust tokenizer single-threaded.

    python bench/bench_tokenize.py [--mb 50] [--rounds 2] [--procs 2] [--methods stream,map]

`--methods stream` measures the streaming tokenize alone (the memory goals at 100 MB and 1 GB, where
datasets.map would need gigabytes and as long again).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUN = r'''
import json, os, re, sys, threading, time
method, data, out, tokenizer, num_proc = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
peak, stop = [0], threading.Event()
def tree_pss():
    me = os.getpid()
    total = 0
    for pid in [me] + [int(p) for p in open(f"/proc/{me}/task/{me}/children").read().split()]:
        try:
            total += int(re.search(r"Pss:\s+(\d+) kB", open(f"/proc/{pid}/smaps_rollup").read()).group(1)) * 1024
        except (OSError, AttributeError):
            pass
    return total
def watch():
    while not stop.is_set():
        peak[0] = max(peak[0], tree_pss())
        time.sleep(0.02)
from remodel.pipelines.data import tokens as T
from remodel.pipelines.data.data import load_texts
from remodel.pipelines.distributed.runtime import load_tokenizer
tok = load_tokenizer(tokenizer)
base = tree_pss()
threading.Thread(target=watch, daemon=True).start()
t = time.perf_counter()
if method == "stream":
    n_tokens = T.tokenize(data, out, tok, num_proc=num_proc)["n_tokens"]
else:
    import datasets, numpy as np, pyarrow.compute as pc
    datasets.disable_progress_bars()
    texts, tail = load_texts(data), [tok.eos_token_id]
    n_tokens = 0
    with open(out, "wb") as fb:
        for start in range(0, len(texts), 1 << 16):
            part = texts.select(range(start, min(start + (1 << 16), len(texts))))
            ids = part.map(lambda b: {"ids": [x + tail for x in tok(b["text"], add_special_tokens=False)["input_ids"]]},
                           batched=True, num_proc=min(num_proc, len(part)), remove_columns=["text"],
                           keep_in_memory=True, new_fingerprint=f"bench-{start}").data.column("ids")
            for chunk in ids.chunks:
                flat = pc.list_flatten(chunk).to_numpy(zero_copy_only=False).astype(np.uint16)
                flat.tofile(fb)
                n_tokens += len(flat)
seconds = time.perf_counter() - t
stop.set()
print(json.dumps({"seconds": seconds, "n_tokens": n_tokens, "peak": max(peak[0], tree_pss()), "base": base}))
'''


def make_corpus(path: Path, mb: int):
    from remodel.pipelines.data.data import embedded_corpus
    text = gzip.open(embedded_corpus()[0], "rt").read()
    with open(path, "w") as f:
        for _ in range(max(1, round(mb * 1e6 / len(text.encode())))):
            f.write(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=50, help="corpus size in MB")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (each runs both methods)")
    ap.add_argument("--procs", type=int, default=2, help="num_proc of both methods")
    ap.add_argument("--methods", default="stream,map", help="which of stream, map to run")
    a = ap.parse_args()
    from remodel.pipelines.data.data import embedded_tokenizer_path
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = {m: [] for m in a.methods.split(",")}
    if not set(runs) <= {"stream", "map"}:
        sys.exit(f"--methods: stream and/or map, got {a.methods}")
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "corpus.txt"
        make_corpus(data, a.mb)
        for r in range(a.rounds):
            for method in runs:
                out = Path(d) / f"{method}{r}"
                p = subprocess.run([sys.executable, "-c", RUN, method, str(data), str(out),
                                    str(embedded_tokenizer_path()), str(a.procs)], env=env, cwd=ROOT,
                                   capture_output=True, text=True)
                if p.returncode:
                    sys.exit(p.stderr[-3000:])
                runs[method].append(json.loads(p.stdout.splitlines()[-1]))
        size = data.stat().st_size
    tokens = {m: v[0]["n_tokens"] for m, v in runs.items()}
    assert len(set(tokens.values())) == 1, tokens
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.2f}; corpus {size / 1e6:.0f} MB, {next(iter(tokens.values())):,} tokens, "
          f"num_proc={a.procs}")
    best = {}
    for m, v in runs.items():
        best[m] = min(x["seconds"] for x in v)
        peak, times = max(x["peak"] for x in v), ", ".join(f"{x['seconds']:.2f}" for x in v)
        print(f"{m:6s}: best {best[m]:.2f} s = {tokens[m] / best[m]:,.0f} tokens/s "
              f"({times}); peak PSS {peak / 2**20:.0f} MiB "
              f"(+{(peak - v[0]['base']) / 2**20:.0f} MiB over the loaded process)")
    if len(best) == 2:
        print(f"stream tokens/s / map tokens/s: {best['map'] / best['stream']:.2f}x")


if __name__ == "__main__":
    main()
