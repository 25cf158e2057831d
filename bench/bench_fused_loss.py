"""Fused vocabulary losses (pipelines.training.fused_loss) against the unfused losses on materialised logits.

    python bench/bench_fused_loss.py [--tokens 4096] [--hidden 512] [--teacher-hidden 768] [--vocab 32768]
                                     [--reps 3] [--chunk ROWS] [--only ce|kl] [--device cpu|cuda]

Forward + backward of the LM cross-entropy and of KL(teacher || student), fused and unfused, alternating
in one process; prints the median time and the median peak-RSS growth of each, and the ratios. With
--liger (CUDA, liger-kernel installed) liger's fused linear cross-entropy and fused linear JSD (beta 0:
forward KL, its closest to ours) run beside ours in the same rounds. On CUDA an `eager` row times ours with
its block arithmetic eager (fused_loss.COMPILE off: the compiled kernels' gain). --json writes the figures.
Peak RSS: VmHWM reset before each call (clear_refs), glibc's mmap threshold fixed so freed blocks
return to the OS and the peak counts live memory.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import remodel.pipelines.training.fused_loss as fused_loss  # noqa: E402
from remodel.pipelines.training.fused_loss import fused_kl_div, fused_lm_loss  # noqa: E402
from remodel.pipelines.training.losses import kl_div, lm_loss  # noqa: E402


def _status(field: str) -> int:
    return int(re.search(field + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


def _reset_peak() -> int:
    open("/proc/self/clear_refs", "w").write("5")
    return _status("VmRSS")


def measure(fn, device="cpu"):
    """-> (seconds, peak growth in bytes: RSS on CPU, allocated GPU memory on CUDA) of fn() (forward + backward)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base, t = torch.cuda.memory_allocated(), time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t, torch.cuda.max_memory_allocated() - base
    base = _reset_peak()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t, _status("VmHWM") - base


def cases(a):
    g = torch.Generator().manual_seed(0)
    N, H, Ht, V = a.tokens, a.hidden, a.teacher_hidden, a.vocab
    dev = dict(device=a.device, dtype=torch.bfloat16 if a.device == "cuda" else torch.float32)
    h = torch.randn(N, H, generator=g).to(**dev).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H ** 0.5).to(**dev).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g).to(a.device)
    h_t, w_t = torch.randn(N, Ht, generator=g).to(**dev), (torch.randn(V, Ht, generator=g) / Ht ** 0.5).to(**dev)

    def run(loss_fn, compiled=True):
        """One timed call: forward + backward; compiled=False: the block arithmetic eager on CUDA too."""
        def go():
            fused_loss.COMPILE, fused_loss.LIGER = compiled, False  # ours (liger's is timed apart)
            loss_fn().backward()
            h.grad = w.grad = None
            fused_loss.COMPILE, fused_loss.LIGER = True, False
        return go

    def unfused_kl():
        with torch.no_grad():
            t = F.linear(h_t, w_t)
        return kl_div(F.linear(h, w), t, 2.0)
    out = {}
    lg = liger() if a.liger else None
    if a.only in (None, "ce"):
        out["ce"] = {"fused": run(lambda: fused_lm_loss(h, w, labels, chunk=a.chunk)),
                     "unfused": run(lambda: lm_loss(F.linear(h, w), labels))}
        if a.device == "cuda":
            out["ce"]["eager"] = run(lambda: fused_lm_loss(h, w, labels, chunk=a.chunk), compiled=False)
        if lg:
            out["ce"]["liger"] = run(lambda: lg.liger_fused_linear_cross_entropy(h, w, labels))
    if a.only in (None, "kl"):
        out["kl"] = {"fused": run(lambda: fused_kl_div(h, w, h_t, w_t, 2.0, chunk=a.chunk)), "unfused": run(unfused_kl)}
        if a.device == "cuda":
            out["kl"]["eager"] = run(lambda: fused_kl_div(h, w, h_t, w_t, 2.0, chunk=a.chunk), compiled=False)
        if lg:
            out["kl"]["liger"] = run(lambda: lg.liger_fused_linear_jsd(h, w, h_t, w_t, jsd_beta=0.0, temperature=2.0))
    return out


def liger():
    """liger-kernel's functional module, or None where it does not import (it needs Triton and CUDA)."""
    try:
        from liger_kernel.transformers import functional
        return functional
    except Exception as e:  # optional: the comparison row is left out
        print(f"liger-kernel not usable here: {type(e).__name__}: {e}")
        return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--teacher-hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=None, help="rows per chunk (default: pipelines.training.fused_loss's)")
    p.add_argument("--only", choices=["ce", "kl"], default=None)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: bf16, peak = allocated GPU memory")
    p.add_argument("--liger", action="store_true", help="also time liger-kernel's fused losses (CUDA)")
    p.add_argument("--json", default=None, help="write the figures here (default: none)")
    a = p.parse_args()
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    where = torch.cuda.get_device_name() if a.device == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, N={a.tokens} H={a.hidden} "
          f"H_t={a.teacher_hidden} V={a.vocab}; [N, V] fp32 logits = {a.tokens * a.vocab * 4 / 2**20:.0f} MiB")
    report = {"device": where, "tokens": a.tokens, "hidden": a.hidden, "vocab": a.vocab}
    for name, fns in cases(a).items():
        for fn in fns.values():
            fn()  # warm-up
        res = {k: [] for k in fns}
        for _ in range(a.reps):
            for k, fn in fns.items():
                res[k].append(measure(fn, a.device))
        med = {k: (statistics.median(t for t, _ in v), statistics.median(m for _, m in v)) for k, v in res.items()}
        (tf, mf), (tu, mu) = med["fused"], med["unfused"]
        print(f"{name}: fused {tf:.2f} s, peak +{mf / 2**20:.0f} MiB | unfused {tu:.2f} s, peak +{mu / 2**20:.0f} MiB"
              f" | time fused/unfused {tf / tu:.2f}x, memory unfused/fused {mu / max(mf, 1):.1f}x")
        if "eager" in med:
            te, me = med["eager"]
            print(f"{name}: eager blocks {te:.3f} s, peak +{me / 2**20:.0f} MiB | compiled/eager time {tf / te:.2f}x")
        if "liger" in med:
            tl, ml = med["liger"]
            print(f"{name}: liger {tl:.3f} s, peak +{ml / 2**20:.0f} MiB | ours/liger time {tf / tl:.2f}x, memory {mf / max(ml, 1):.2f}x")
        report[name] = {k: {"s": t, "peak_gib": m / 2**30} for k, (t, m) in med.items()}
    if a.json:
        import json
        open(a.json, "w").write(json.dumps(report, indent=1))

if __name__ == "__main__":
    main()
