"""Activation recomputation (models.recompute): peak activation memory and step time per mode on CPU.

The embedded checkpoint's shape (data/embedded/config.json, weights freshly initialised), batch 1 x
--tokens tokens, fp32, one forward + backward of the LM loss (no optimizer). Per mode:
  saved     bytes of the distinct storages autograd keeps for backward during the forward
            (saved_tensors_hooks; a checkpointed region shows only its inputs)
  peak      the allocator's peak during the step above what was allocated before it (weights and
            gradient buffers already exist): the sum of torch.profiler's allocation records in time
            order, so it includes logits, the recomputation's transient memory and backward's work tensors
  rss       peak RSS growth of a fresh subprocess over one step (VmHWM reset after a warm-up step and
            malloc_trim), the operating system's view of the same
  time      median step time over --reps steps, the modes alternated in one process (a shared CPU's
            load hits them alike)
Ratios are against `none` measured in the same run.

    python bench/bench_recompute.py [--tokens 4096] [--reps 5] [--threads 1]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from remodel.models.load import load_config  # noqa: E402
from remodel.models.model import HybridLM, init_weights  # noqa: E402
from remodel.models.recompute import RECOMPUTE_MODES, set_recompute  # noqa: E402


def build(tokens: int):
    """The embedded model's shape with fresh weights, gradient buffers allocated, one batch and a fixed
    gradient for the layer stack's output."""
    cfg = load_config(ROOT / "data" / "embedded")
    model = init_weights(HybridLM(cfg), seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=g)
    dh = torch.randn(1, tokens, cfg.hidden_size, generator=g) / tokens
    step(model, (ids, dh), True)  # allocates .grad; later steps zero it in place
    return model, (ids, dh)


def step(model, batch, head: bool):
    """One forward + backward: of the next-token loss (head), or of the layer stack alone (embeddings,
    layers, final norm) given a fixed output gradient, what recomputation acts on."""
    out, grad = forward(model, batch, head)
    out.backward(grad)


def forward(model, batch, head: bool):
    """The forward of `step` -> (output to backward from, its gradient)."""
    ids, dh = batch
    model.zero_grad(set_to_none=False)
    if head == "fused":  # pipelines.training.fused_loss: CE in vocabulary chunks, no [tokens, V] logits
        from remodel.pipelines.training.fused_loss import fused_lm_loss, lm_head_weight
        return fused_lm_loss(model.hidden(ids)[0][0, :-1], lm_head_weight(model), ids[0, 1:]), None
    if head:
        return F.cross_entropy(model(ids)[0, :-1], ids[0, 1:]), None
    return model.hidden(ids)[0], dh


def saved_bytes(model, batch, head: bool) -> int:
    """Bytes of the distinct storages saved for backward during one forward (then backward runs)."""
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, grad = forward(model, batch, head)
    out.backward(grad)
    return sum(seen.values())


def peak_bytes(model, batch, head: bool) -> int:
    """Peak of the allocator's running total during one step, above its value at the start."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(model, batch, head)
    allocs = []

    def walk(node):
        if node.tag == _EventType.Allocation:
            allocs.append((node.start_time_ns, node.extra_fields.alloc_size))
        for c in node.children:
            walk(c)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    total = peak = 0
    for _, size in sorted(allocs):
        total += size
        peak = max(peak, total)
    return peak


RSS_CHILD = r'''
import ctypes, json, re, sys
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(int(sys.argv[4]))
from bench.bench_recompute import build, step
from remodel.models.recompute import set_recompute
def status(field):
    return int(re.search(field + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
model, batch = build(int(sys.argv[3]))
set_recompute(model, sys.argv[2])
step(model, batch, True)
ctypes.CDLL("libc.so.6").malloc_trim(0)
base = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
step(model, batch, True)
print(json.dumps(status("VmHWM") - base))
'''


def rss_growth(mode: str, tokens: int, threads: int) -> int | None:
    """Peak RSS growth of one step in a fresh process (None where /proc/self/clear_refs is refused)."""
    r = subprocess.run([sys.executable, "-c", RSS_CHILD, str(ROOT), mode, str(tokens), str(threads)],
                       capture_output=True, text=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None


def step_times(model, batch, reps: int) -> dict[str, float]:
    """Median time of a full step (with the loss) per mode, the modes alternated rep by rep."""
    times = {m: [] for m in RECOMPUTE_MODES}
    for _ in range(reps):
        for mode in RECOMPUTE_MODES:
            set_recompute(model, mode)
            t0 = time.perf_counter()
            step(model, batch, True)
            times[mode].append(time.perf_counter() - t0)
    return {m: statistics.median(v) for m, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, batch = build(args.tokens)
    rows = {}
    for mode in RECOMPUTE_MODES:
        set_recompute(model, mode)
        rows[mode] = dict(saved=saved_bytes(model, batch, False), peak=peak_bytes(model, batch, False),
                          saved_h=saved_bytes(model, batch, True), peak_h=peak_bytes(model, batch, True),
                          peak_f=peak_bytes(model, batch, "fused"),
                          rss=rss_growth(mode, args.tokens, args.threads))
    for mode, t in step_times(model, batch, args.reps).items():
        rows[mode]["time"] = t
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"threads {args.threads}, load avg {os.getloadavg()[0]:.2f}, embedded shape, 1 x {args.tokens} tokens fp32")
    print("| mode | layers: saved MiB | layers: peak MiB | step with loss: saved / peak / RSS growth MiB | step s | "
          "layers' peak vs none | step peak vs none | fused-loss step: peak MiB / vs none | time vs none |")
    print("|---|---|---|---|---|---|---|---|---|")
    base, mib = rows["none"], 2.0 ** 20
    for mode, r in rows.items():
        rss = f"{r['rss'] / mib:.0f}" if r["rss"] is not None else "n/a"
        print(f"| {mode} | {r['saved'] / mib:.0f} | {r['peak'] / mib:.0f} | "
              f"{r['saved_h'] / mib:.0f} / {r['peak_h'] / mib:.0f} / {rss} | {r['time']:.2f} | "
              f"{base['peak'] / r['peak']:.2f}x less | {base['peak_h'] / r['peak_h']:.2f}x less | "
              f"{r['peak_f'] / mib:.0f} / {base['peak_f'] / r['peak_f']:.2f}x less | {r['time'] / base['time']:.2f}x |")


if __name__ == "__main__":
    main()
