"""Two ways to a faster CPU Mamba core that remodel does not take, measured against what it does.

Issue #2's CPU targets need our train step 1.5x / 2x transformers' at 1024 / 4096 tokens; what is left
of the gap is the Mamba core (conv + SSD scan + gated norm, models/mamba.py). This bench measures the
two obvious alternatives to our hand-blocked eager PyTorch core, forward + backward, one process,
alternating, median of --reps:

1. `torch.compile` (inductor, C++ codegen) of a straightforward chunked SSD core with the same math
   (conv + silu, softplus/clamp dt, SSD chunks with an inter-chunk matmul, gated group RMSNorm), against
   our `_MambaCore` + `_GatedRMSNorm`. Compile time is reported separately, not timed.
2. A sequential SSD scan in C (bench/ssd_seq.c: the recurrence with every state tile in registers,
   16k multiply-adds per head-token instead of the chunked form's ~29k), built here with the system C
   compiler, against our `ssd_scan` (the chunked scan alone, without conv and norm).

Both are checked against ours first (max abs difference printed). Configs: the Mamba layers of
bench/bench_model.py's two configs (8 heads x 64; state 128 in 8 groups, or 64 in 2 groups).

    python bench/bench_scan_alternatives.py [--lengths 1024 4096] [--reps 7] [--threads 1] [--no-compile]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import models.mamba as mm  # noqa: E402

CONFIGS = {"nemotron-h": dict(h=8, p=64, g=8, n=128), "small-state": dict(h=8, p=64, g=2, n=64)}
Q = 64  # the scan chunk of both our CPU scan (mm.CPU_CHUNK) and the alternatives


def chunked_core(zx, w, cb, dt_bias, A_log, D, nw, Im, g, n, h, eps):
    """conv + silu -> dt -> chunked SSD (+ D skip) -> gated group RMSNorm, written plainly for the compiler."""
    b, l, _ = zx.shape
    p, GN = Im // h, g * n
    Cn, r, K = Im + 2 * GN, h // g, w.shape[-1]
    z, xBC, dtr = zx[..., :Im], zx[..., Im:Im + Cn], zx[..., Im + Cn:]
    xp = F.pad(xBC, (0, 0, K - 1, 0))
    acc = cb + xp[:, K - 1:] * w[:, K - 1]
    for k in range(K - 1):
        acc = acc + xp[:, k:k + l] * w[:, k]
    xBC = F.silu(acc)
    x, B, C = xBC[..., :Im], xBC[..., Im:Im + GN], xBC[..., Im + GN:]
    dt = F.softplus(dtr + dt_bias).clamp(0.001, 100.0)
    A = -torch.exp(A_log)
    c = l // Q
    x = x.reshape(b, c, Q, g, r, p).permute(0, 1, 3, 4, 2, 5)  # b c g r Q p
    dt = dt.reshape(b, c, Q, g, r).permute(0, 1, 3, 4, 2)  # b c g r Q
    B = B.reshape(b, c, Q, g, n).permute(0, 1, 3, 2, 4)  # b c g Q n
    C = C.reshape(b, c, Q, g, n).permute(0, 1, 3, 2, 4)
    Acum = torch.cumsum(dt * A.view(g, r, 1), -1)
    X = x * dt[..., None]
    tril = torch.ones(Q, Q, dtype=torch.bool, device=zx.device).tril()
    L = torch.exp((Acum[..., :, None] - Acum[..., None, :]).masked_fill(~tril, -float("inf")))
    Ydiag = (L * (C @ B.transpose(-1, -2))[:, :, :, None]) @ X
    Alast = Acum[..., -1:]
    S = (X * torch.exp(Alast - Acum)[..., None]).transpose(-1, -2) @ B[:, :, :, None]  # b c g r p n
    al = Alast[..., 0].permute(0, 2, 3, 1)  # b g r c
    cs = torch.cumsum(al, -1)
    before = torch.ones(c, c, dtype=torch.bool, device=zx.device).tril(-1)
    Lc = torch.exp((F.pad(cs, (1, 0))[..., :-1, None] - cs[..., None, :]).masked_fill(~before, -float("inf")))
    prev = (Lc @ S.permute(0, 2, 3, 1, 4, 5).reshape(b, g, r, c, p * n)).reshape(b, g, r, c, p, n)
    Yoff = (C[:, :, :, None] @ prev.permute(0, 3, 1, 2, 4, 5).transpose(-1, -2)) * torch.exp(Acum)[..., None]
    y = (Ydiag + Yoff + x * D.view(g, r, 1, 1)).permute(0, 1, 4, 2, 3, 5).reshape(b, l, Im)
    yz = (y * F.silu(z)).view(b, l, g, -1)
    return nw * (yz * torch.rsqrt(yz.pow(2).mean(-1, keepdim=True) + eps)).view(b, l, Im)


def our_core(zx, w, cb, dt_bias, A_log, D, nw, Im, g, n, h, eps):
    dims = (Im, g, n, h, min(mm.CPU_CHUNK, zx.shape[1]), 0.001, 100.0)
    y, z = mm._MambaCore.apply(zx, w.view(-1, 1, w.shape[-1]), cb, dt_bias, -torch.exp(A_log), D, None, dims)
    return mm._GatedRMSNorm.apply(y, z, nw, g, eps)


def timed(fns: dict, reps: int) -> dict:
    """Median seconds of each callable, alternating (order flipped every repetition)."""
    ts = {k: [] for k in fns}
    for i in range(reps):
        for k in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
            t = time.perf_counter()
            fns[k]()
            ts[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in ts.items()}


def bench_compile(c, L, reps):
    h, p, g, n = c["h"], c["p"], c["g"], c["n"]
    Im = h * p
    Cn = Im + 2 * g * n
    torch.manual_seed(0)
    zx = (torch.randn(1, L, Im + Cn + h) * 0.5).requires_grad_()
    params = [t.requires_grad_() for t in (torch.randn(Cn, 4) * 0.3, torch.randn(Cn) * 0.1, torch.rand(h),
                                            torch.log(torch.arange(1, h + 1.0)), torch.ones(h), torch.ones(Im))]
    dy = torch.randn(1, L, Im)
    args = (Im, g, n, h, 1e-5)
    comp = torch.compile(chunked_core, fullgraph=True, dynamic=False)

    def step(f):
        for t in (zx, *params):
            t.grad = None
        out = f(zx, *params, *args)
        out.backward(dy)
        return out.detach(), [zx.grad.clone()] + [q.grad.clone() for q in params]

    t = time.perf_counter()
    o1, g1 = step(comp)
    t_compile = time.perf_counter() - t
    o2, g2 = step(our_core)
    diff = max([(o1 - o2).abs().max().item()] + [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(g1, g2)])
    t = timed({"ours": lambda: step(our_core), "compiled": lambda: step(comp)}, reps)
    return t, t_compile, diff


def build_c():
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler on PATH"
    out = Path(tempfile.mkdtemp()) / "ssd_seq.so"
    subprocess.run([cc, "-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC",
                    str(ROOT / "bench" / "ssd_seq.c"), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    P, I, Lg = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.ssd_fwd.argtypes = [I] * 6 + [P, Lg, P, Lg, P, P, P, Lg, P, Lg, P, Lg, P, P, P, I, I]
    lib.ssd_bwd.argtypes = [I] * 6 + [P, Lg, P, Lg, P, P, P, Lg, P, Lg, P, Lg, P, P, P, Lg, P, Lg, P, Lg, Lg,
                                      P, Lg, Lg, P, P, P, I, I]
    return lib, cc


def bench_c(lib, c, L, reps):
    h, p, g, n = c["h"], c["p"], c["g"], c["n"]
    assert n % 8 == 0, "bench/ssd_seq.c needs a state size that is a multiple of 8"
    r, nck = h // g, -(-L // Q)
    torch.manual_seed(0)
    x, dt, A = torch.randn(1, L, h, p), torch.rand(1, L, h) * 0.1 + 0.01, -torch.arange(1, h + 1.0)
    B, C, D, dy = torch.randn(1, L, g, n) * 0.3, torch.randn(1, L, g, n) * 0.3, torch.rand(h), torch.randn(1, L, h, p)
    wf = torch.empty(2 * Q + 2 * Q * n + 8 * Q)
    wb = torch.empty(3 * Q + Q * p + 64 * (Q + 1) + 4 * Q * n + 16 * Q)
    a = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731

    def seq():
        y, st, ck = torch.empty(1, L, h, p), torch.zeros(h, p, n), torch.empty(nck, h, p, n)
        lib.ssd_fwd(L, h, p, g, n, Q, a(x), h * p, a(dt), h, a(A), a(D), a(B), g * n, a(C), g * n, a(y), h * p,
                    a(st), a(ck), a(wf), 0, h)
        gs, dx, ddt = torch.zeros(h, p, n), torch.empty_like(x), torch.empty_like(dt)
        dBh, dCh, dA, dD = torch.empty(1, L, h, n), torch.empty(1, L, h, n), torch.zeros(h), torch.zeros(h)
        lib.ssd_bwd(L, h, p, g, n, Q, a(x), h * p, a(dt), h, a(A), a(D), a(B), g * n, a(C), g * n, a(dy), h * p,
                    a(ck), a(gs), a(dx), h * p, a(ddt), h, a(dBh), h * n, n, a(dCh), h * n, n, a(dA), a(dD), a(wb), 0, h)
        return y, dx, ddt, dA, dBh.view(1, L, g, r, n).sum(3), dCh.view(1, L, g, r, n).sum(3), dD

    def ours():
        xs = [t.clone().requires_grad_() for t in (x, dt, A, B, C, D)]
        y = mm.ssd_scan(xs[0], xs[1], xs[2], xs[3], xs[4], Q, D=xs[5])
        y.backward(dy)
        return (y.detach(), *(t.grad for t in xs[:3]), xs[3].grad, xs[4].grad, xs[5].grad)

    diff = max(((u - v).abs().max() / v.abs().max()).item() for u, v in zip(seq(), ours()))
    return timed({"ours": ours, "C sequential": seq}, reps), diff


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s), {os.cpu_count()} CPUs, fp32, batch 1, forward + backward, "
          f"median of {a.reps}; load average {os.getloadavg()[0]:.2f}", flush=True)
    lib, cc = build_c()
    print(f"C sequential scan: {'built with ' + cc if lib else 'not measured: ' + cc}", flush=True)
    for name in a.configs:
        for L in a.lengths:
            if not a.no_compile:
                t, tc, d = bench_compile(CONFIGS[name], L, a.reps)
                print(f"[{name}] len {L}: Mamba core (conv + scan + norm): ours {t['ours'] * 1e3:.1f} ms, "
                      f"torch.compile {t['compiled'] * 1e3:.1f} ms -> compiled / ours {t['compiled'] / t['ours']:.2f}x "
                      f"(compile {tc:.0f} s; max rel diff {d:.1e})", flush=True)
            if lib:
                t, d = bench_c(lib, CONFIGS[name], L, a.reps)
                print(f"[{name}] len {L}: SSD scan alone: ours {t['ours'] * 1e3:.1f} ms, C sequential "
                      f"{t['C sequential'] * 1e3:.1f} ms -> ours / C {t['ours'] / t['C sequential']:.2f}x "
                      f"(max rel diff {d:.1e})", flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
