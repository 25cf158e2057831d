"""MoE layer forward + backward tokens/s: the per-expert loop against the grouped path (F.grouped_mm over
the rows sorted by expert; models.moe), same weights and tokens, alternating, in one process.

Windows (fp32 on CPU; bf16 on a GPU when there is one): the embedded MoE's layer (8 experts, top-4,
hidden 256), the Nemotron 3 Nano window (128 experts, top-6, a shared expert) and the Super window
(512 experts, top-22, latent 256) at reduced width. Goal (issue 28): the grouped path faster than the loop
on every window, and the Nano window at >= 2/3 the tokens/s of a dense MLP of the same active width
(k expert widths + the shared expert; a layer-level stand-in for the issue's training figure).

    python bench/bench_moe.py [--tokens 2048] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remodel.models import moe as M  # noqa: E402
from remodel.models.config import ModelConfig  # noqa: E402

WINDOWS = {
    "embedded": dict(hidden_size=256, n_routed_experts=8, num_experts_per_tok=4, moe_intermediate_size=192),
    "nano": dict(hidden_size=256, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=96,
                 moe_shared_expert_intermediate_size=384),
    "super": dict(hidden_size=256, n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=64,
                  moe_latent_size=128, moe_shared_expert_intermediate_size=512),
}


def layer(window: str, device, dtype):
    cfg = ModelConfig(vocab_size=8, pattern="E", router="sigmoid", **WINDOWS[window])
    m = M.MoE(cfg).to(device, dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return m, cfg


def dense(cfg, device, dtype):
    """The dense MLP of the same active width (k expert widths + the shared expert), same activation."""
    width = cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.moe_shared_expert_intermediate_size
    return M.MLP(cfg.hidden_size, width, cfg.mlp_act, cfg.mlp_gated).to(device, dtype)


def step(m, x):
    m.zero_grad(set_to_none=True)
    m(x).float().square().mean().backward()


def measure(window: str, tokens: int, rounds: int, device, dtype) -> dict:
    m, cfg = layer(window, device, dtype)
    x = torch.randn(1, tokens, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
    d = dense(cfg, device, dtype)
    times = {"loop": [], "grouped": [], "dense": []}
    for r in range(rounds + 1):
        for path in ("loop", "grouped", "dense"):
            M.GROUPED = path == "grouped"
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(d if path == "dense" else m, x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r:  # the first round warms up
                times[path].append(time.perf_counter() - t0)
    M.GROUPED = True
    best = {k: min(v) for k, v in times.items()}
    return {"window": window, "tokens": tokens, **{f"{k}_tok_s": round(tokens / v) for k, v in best.items()},
            "grouped_over_loop": round(best["loop"] / best["grouped"], 2),
            "grouped_over_dense": round(best["dense"] / best["grouped"], 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = [measure(w, a.tokens, a.rounds, device, dtype) for w in WINDOWS]
    for r in rows:
        print(f"{r['window']:9s} loop {r['loop_tok_s']:>8,} tok/s  grouped {r['grouped_tok_s']:>8,} tok/s  "
              f"grouped/loop {r['grouped_over_loop']:.2f}x  dense {r['dense_tok_s']:>8,} tok/s  "
              f"grouped/dense {r['grouped_over_dense']:.2f}x")
    print(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
                      or "cpu", "threads": torch.get_num_threads(), "dtype": str(dtype), "rows": rows}))


if __name__ == "__main__":
    main()
