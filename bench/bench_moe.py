"""MoE layer forward + backward tokens/s: the per-expert loop against the grouped path (F.grouped_mm over
the rows sorted by expert; models.moe), same weights and tokens, alternating, in one process.

Windows (fp32 on CPU; bf16 on a GPU when there is one): the embedded MoE's layer (8 experts, top-4,
hidden 256), the Nemotron 3 Nano window (128 experts, top-6, a shared expert) and the Super window
(512 experts, top-22, latent 256) at reduced width. Goal (issue 28): the grouped path faster than the loop
on every window, and the Nano window at >= 2/3 the tokens/s of a dense MLP of the same active width
(k expert widths + the shared expert; a layer-level stand-in for the issue's training figure).

`--model`: the issue's training figure itself: one train step (the trainer's compute_losses: CE + the
router's load-balancing loss, backward, clipping, AdamW) of a Nano-shaped hybrid (`MEMEM*EME`, 128
experts, top-6, a shared expert, hidden 256) against its dense twin (each E an MLP of the same active width),
alternating, best of --rounds.

    python bench/bench_moe.py [--tokens 2048] [--rounds 5] [--model]
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
    width = cfg.moe.num_experts_per_tok * cfg.moe.moe_intermediate_size + cfg.moe.moe_shared_expert_intermediate_size
    return M.MLP(cfg.hidden_size, width, cfg.mlp.mlp_act, cfg.mlp.mlp_gated).to(device, dtype)


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


NANO_MODEL = dict(vocab_size=2048, hidden_size=256, pattern="MEMEM*EME", num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, mamba_num_heads=8, mamba_head_dim=32, n_groups=2,
                  ssm_state_size=64, chunk_size=128, **{k: v for k, v in WINDOWS["nano"].items() if k != "hidden_size"})


def train_models(tokens: int, rounds: int) -> dict:
    """Train-step tokens/s of the Nano-shaped MoE model and its dense twin (same batches, alternating)."""
    from remodel.models.model import HybridLM, init_weights
    from remodel.pipelines.training.objective import compute_losses
    from remodel.pipelines.training.trainer import build_optimizer

    moe_cfg = ModelConfig(router="sigmoid", **NANO_MODEL)
    width = moe_cfg.moe.num_experts_per_tok * moe_cfg.moe.moe_intermediate_size + moe_cfg.moe.moe_shared_expert_intermediate_size
    dense_cfg = ModelConfig(**{**NANO_MODEL, "pattern": NANO_MODEL["pattern"].replace("E", "-"),
                               "intermediate_size": width, "n_routed_experts": 0, "num_experts_per_tok": 0,
                               "moe_intermediate_size": 0, "moe_shared_expert_intermediate_size": 0})
    models = {name: init_weights(HybridLM(cfg), seed=0) for name, cfg in (("moe", moe_cfg), ("dense", dense_cfg))}
    opts = {name: build_optimizer(dict(m.named_parameters()), 1e-4, 0.1) for name, m in models.items()}
    w = dict(kl=0.0, lm=1.0, hidden=0.0, lb=1e-3, z=0.0, temperature=1.0, topk=None, fused=False)
    ids = torch.randint(0, moe_cfg.vocab_size, (max(1, tokens // 512), 512), generator=torch.Generator().manual_seed(0))
    times = {"moe": [], "dense": []}
    for r in range(rounds + 1):
        for name, m in models.items():
            t0 = time.perf_counter()
            loss, _ = compute_losses(m, None, ids, w)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(m.parameters()), 1.0)
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            if r:
                times[name].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in times.items()}
    n_tok = ids.numel()
    return {"model": "nano-shaped " + moe_cfg.pattern, "tokens": n_tok, "dense_active_width": width,
            **{f"{k}_tok_s": round(n_tok / v) for k, v in best.items()},
            "moe_over_dense": round(best["dense"] / best["moe"], 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", action="store_true", help="train steps of a Nano-shaped model vs its dense twin")
    a = ap.parse_args()
    if a.model:
        r = train_models(a.tokens, a.rounds)
        print(f"{r['model']}: MoE {r['moe_tok_s']:,} tok/s  dense {r['dense_tok_s']:,} tok/s  "
              f"MoE/dense {r['moe_over_dense']:.3f}x  ({torch.get_num_threads()} threads)")
        print(json.dumps({"device": platform.processor() or "cpu", "threads": torch.get_num_threads(), **r}))
        return
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
