"""Train-step throughput of our hybrid model against transformers' NemotronHForCausalLM on CPU.

One process per run: for each config builds a small Nemotron-H-style hybrid in transformers, loads
the same weights into ours, times forward+backward (no optimizer) of both, alternately (the CPU is
shared), at several lengths, and reports tokens/s, the speed ratio by wall clock and by process CPU
time, and the achieved fraction of the machine's fp32 matmul rate.

Configs (both 13-layer-ish, vocab 2048, hidden 256, relu2 MLP, Mamba-2 8 heads x 64, config chunk 128):
  small-state  6.66M  `M-M-M*M-M-M-`  ssm state 64, 2 groups, FFN 1024, GQA 4q/2kv x 64 (the first bench model)
  nemotron-h   9.96M  `M-M-M-M*-M-M-` a 13-layer window of the real pattern (M : - : * = 6 : 6 : 1, as in
               nemotron-h-4b/8b), their Mamba sizes: ssm state 128, 8 groups, head dim 64; FFN 4x, GQA 4:1
               (4q/1kv x 64). The 8 x 128 B|C channels make it ~10M rather than 7M at hidden 256.

    python bench/bench_model.py [--configs small-state nemotron-h] [--lengths 256 1024 4096] [--reps 7] [--threads 2]

Prints one line per (config, length) and a markdown table (pasted into bench/RESULTS.md).

FLOPs per token of a train step (forward + backward = 3x forward), documented formula:
  6 * N_linear                         N_linear = weights of every Linear (in/out_proj, q/k/v/o,
                                       up/down, lm_head); embeddings (a lookup), norms, conv excluded
  + 6 * l * nq * hd  per '*' layer     causal attention: QK^T and AV, 2 flops per MAC, mean context l/2
  + 3 * per 'M' layer:                 SSD at the config's chunk size Q (algorithmic, causal half):
      2*(Q/2)*N*G      C.B within a chunk (per group)
    + 2*(Q/2)*P*h      (C.B * decay) @ x within a chunk
    + 2*P*N*h          chunk states
    + 2*P*N*h          state -> output
The same count is used for both implementations, so the ratio of fractions is the speed ratio.
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

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remodel.models.load import load_model  # noqa: E402

HF_KW = dict(vocab_size=2048, hidden_size=256, hybrid_override_pattern="M-M-M*M-M-M-",
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=1024,
             mamba_num_heads=8, mamba_head_dim=64, n_groups=2, ssm_state_size=64, chunk_size=128,
             conv_kernel=4, layer_norm_epsilon=1e-5)
CONFIGS = {
    "small-state": HF_KW,
    "nemotron-h": dict(HF_KW, hybrid_override_pattern="M-M-M-M*-M-M-", num_key_value_heads=1, n_groups=8,
                       ssm_state_size=128),
}


def build(tmp, kw=HF_KW):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("nemotron_h", **kw)).float()
    hf.save_pretrained(tmp)
    ours = load_model(tmp)
    return hf.train(), ours.train()


def flops_per_token(model, l):
    cfg = model.cfg
    n_linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    f = 6 * n_linear
    f += cfg.count("*") * 6 * l * cfg.attention.num_attention_heads * cfg.attention.head_dim
    Q, N, G, P, h = cfg.mamba.chunk_size, cfg.mamba.d_state, cfg.mamba.n_groups, cfg.mamba.mamba_head_dim, cfg.mamba.mamba_num_heads
    scan = 2 * (Q / 2) * N * G + 2 * (Q / 2) * P * h + 2 * P * N * h + 2 * P * N * h
    f += cfg.count("M") * 3 * scan
    return f, n_linear


def matmul_rate(n=2048, reps=5):
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def train_step(fn, model, ids, labels):
    model.zero_grad(set_to_none=True)
    logits = fn(ids)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()


def measure(l, hf, ours, reps):
    """Per train step of each: median and best wall seconds and median process CPU seconds, timed
    alternately (the CPU is shared; the order flips every repetition), and the fp32 matmul rate
    measured between them."""
    g = torch.Generator().manual_seed(l)
    ids = torch.randint(0, ours.cfg.vocab_size, (1, l), generator=g)
    labels = torch.randint(0, ours.cfg.vocab_size, (1, l), generator=g)
    runs = {"ours": (ours, ours), "transformers": (lambda x: hf(x).logits, hf)}
    wall, cpu = {k: [] for k in runs}, {k: [] for k in runs}
    rates = []
    for k, (fn, model) in runs.items():  # warm-up
        train_step(fn, model, ids, labels)
    for i in range(reps):
        for k in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            fn, model = runs[k]
            t, c = time.perf_counter(), time.process_time()
            train_step(fn, model, ids, labels)
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
        rates.append(matmul_rate(reps=3))
    med = statistics.median
    return ({k: med(v) for k, v in wall.items()}, {k: min(v) for k, v in wall.items()},
            {k: med(v) for k, v in cpu.items()}, med(rates))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, torch {torch.__version__}, {os.cpu_count()} CPUs ({platform.machine()}); batch 1, "
          f"fp32, forward+backward, median of {args.reps} (half at > 1024); load average {os.getloadavg()[0]:.2f}")
    rows = []
    for name in args.configs:
        with tempfile.TemporaryDirectory() as tmp:
            hf, ours = build(tmp, CONFIGS[name])
        n_params = sum(p.numel() for p in ours.parameters())
        cfg = ours.cfg
        print(f"[{name}] params {n_params / 1e6:.2f}M, pattern {cfg.pattern}, hidden {cfg.hidden_size}, Mamba "
              f"{cfg.mamba.mamba_num_heads}x{cfg.mamba.mamba_head_dim} state {cfg.mamba.d_state} groups {cfg.mamba.n_groups} chunk "
              f"{cfg.mamba.chunk_size}, FFN {cfg.mlp.intermediate_size}, attention {cfg.attention.num_attention_heads}q/"
              f"{cfg.attention.num_key_value_heads}kv x {cfg.attention.head_dim}, vocab {cfg.vocab_size}", flush=True)
        for l in args.lengths:
            reps = args.reps if l <= 1024 else max(3, (args.reps + 1) // 2)
            t, best, cpu, rate = measure(l, hf, ours, reps)
            fpt, _ = flops_per_token(ours, l)
            r = dict(cfg=name, l=l, ours=l / t["ours"], hf=l / t["transformers"], ratio=t["transformers"] / t["ours"],
                     rate=rate, f_ours=fpt * l / t["ours"] / rate, f_hf=fpt * l / t["transformers"] / rate, fpt=fpt,
                     best=best["transformers"] / best["ours"], cpu=cpu["transformers"] / cpu["ours"],
                     cpu_ours=cpu["ours"], cpu_hf=cpu["transformers"])
            rows.append(r)
            print(f"[{name}] len {l:5d}: ours {r['ours']:7.0f} tok/s  transformers {r['hf']:7.0f} tok/s  "
                  f"ours/transformers wall {r['ratio']:.2f}x (best-of {r['best']:.2f}x) CPU time {r['cpu']:.2f}x "
                  f"({r['cpu_ours']:.2f} s vs {r['cpu_hf']:.2f} s)  matmul fraction ours {r['f_ours']:.0%} "
                  f"transformers {r['f_hf']:.0%}  ({fpt / 1e6:.1f} MFLOP/token, fp32 matmul {rate / 1e9:.1f} GFLOP/s)",
                  flush=True)
        del hf, ours
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    print()
    print("| config | seq len | ours tok/s | transformers tok/s | ours / transformers: wall median; best-of; CPU time | "
          "matmul fraction ours | matmul fraction transformers | MFLOP/token | fp32 matmul GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cfg']} | {r['l']} | {r['ours']:.0f} | {r['hf']:.0f} | {r['ratio']:.2f}x; {r['best']:.2f}x; "
              f"{r['cpu']:.2f}x | {r['f_ours']:.0%} | {r['f_hf']:.0%} | {r['fpt'] / 1e6:.1f} | {r['rate'] / 1e9:.1f} |")


if __name__ == "__main__":
    main()
