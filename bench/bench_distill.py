"""Distillation step time against a plain LM training step of the same student, in one process.

Both steps are the trainer's own code path (pipelines.training.trainer.compute_losses + backward + AdamW step):
plain = student forward/backward on the LM loss; distill = the same plus a frozen teacher forward under
no_grad and the fp32 KL(teacher || student) over the vocabulary. Steps alternate (plain, distill,
plain, ...) so machine load hits both alike; medians are reported. Goal: distill / plain <= 1.45x
with a teacher of the student's size (the teacher forward is ~1/3 of a train step).

    python bench/bench_distill.py [--seq-len 256] [--batch 4] [--reps 6] [--threads 1] [--write]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remodel.models.config import ModelConfig  # noqa: E402
from remodel.models.model import HybridLM, init_weights  # noqa: E402
from remodel.pipelines.training.metrics import forward_flops_per_token, measure_matmul_flops  # noqa: E402
from remodel.pipelines.training.trainer import build_optimizer, compute_losses  # noqa: E402

# the Nemotron-H-style ~7M-parameter hybrid of bench_model.py (Mamba-dominant)
STUDENT = dict(vocab_size=2048, hidden_size=256, pattern="M-M-M*M-M-M-", num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, intermediate_size=1024, mamba_num_heads=8, mamba_head_dim=64,
               n_groups=2, ssm_state_size=64, chunk_size=128, conv_kernel=4)


def model(seed, **changes):
    return init_weights(HybridLM(ModelConfig(**{**STUDENT, **changes})), seed=seed)


def timed_step(student, teacher, opt, ids, w):
    t = time.perf_counter()
    loss, _ = compute_losses(student, teacher, ids, w)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(student.parameters()), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def run(teacher_kw, seq_len, batch, reps):
    student = model(0).train()
    teacher = model(1, **teacher_kw).eval().requires_grad_(False)
    opt = build_optimizer(dict(student.named_parameters()), 1e-4, 0.1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, STUDENT["vocab_size"], (batch, seq_len), generator=g)
    plain_w = dict(kl=0.0, lm=1.0, hidden=0.0, lb=0.0, z=0.0, temperature=1.0, topk=None)
    kd_w = dict(plain_w, kl=1.0, lm=0.0)
    timed_step(student, None, opt, ids, plain_w)  # warm-up both paths
    timed_step(student, teacher, opt, ids, kd_w)
    plain, kd = [], []
    for _ in range(reps):
        plain.append(timed_step(student, None, opt, ids, plain_w))
        kd.append(timed_step(student, teacher, opt, ids, kd_w))
    p, d = statistics.median(plain), statistics.median(kd)
    n_s = sum(x.numel() for x in student.parameters())
    n_t = sum(x.numel() for x in teacher.parameters())
    flops_plain = 3 * forward_flops_per_token(student, seq_len)
    flops_kd = flops_plain + forward_flops_per_token(teacher, seq_len)
    tok = batch * seq_len
    return dict(student_params=n_s, teacher_params=n_t, plain_s=p, distill_s=d, ratio=d / p,
                plain_tok_s=tok / p, distill_tok_s=tok / d, plain_flops=flops_plain * tok / p,
                distill_flops=flops_kd * tok / d, spread=(min(plain), max(plain), min(kd), max(kd)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="1 is fastest on a shared 2-core machine")
    ap.add_argument("--write", action="store_true", help="append a section to bench/RESULTS.md")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    peak = measure_matmul_flops(torch.device("cpu"))
    cases = [("equal-size teacher", {}),
             ("2.2x teacher (H=384, F=1536, 12 Mamba heads)", dict(hidden_size=384, intermediate_size=1536,
                                                                   mamba_num_heads=12))]
    lines = []
    for name, kw in cases:
        r = run(kw, a.seq_len, a.batch, a.reps)
        line = (f"{name}: student {r['student_params'] / 1e6:.2f}M, teacher {r['teacher_params'] / 1e6:.2f}M params; "
                f"plain step {r['plain_s'] * 1e3:.0f} ms ({r['plain_tok_s']:.0f} tok/s, "
                f"{r['plain_flops'] / peak:.1%} of matmul peak), distill step {r['distill_s'] * 1e3:.0f} ms "
                f"({r['distill_tok_s']:.0f} tok/s, {r['distill_flops'] / peak:.1%}); "
                f"**ratio {r['ratio']:.2f}x** (min/max plain {r['spread'][0] * 1e3:.0f}/{r['spread'][1] * 1e3:.0f} ms, "
                f"distill {r['spread'][2] * 1e3:.0f}/{r['spread'][3] * 1e3:.0f} ms)")
        print(line, flush=True)
        lines.append(line)
    head = (f"- {time.strftime('%Y-%m-%d')} {platform.machine()} {torch.get_num_threads()} thread(s), "
            f"torch {torch.__version__}, fp32, seq {a.seq_len} x batch {a.batch}, {a.reps} alternating reps "
            f"(medians), matmul peak {peak / 1e9:.1f} GFLOP/s; step = forward + backward + clip + AdamW; "
            f"goal distill/plain <= 1.45x with an equal-size teacher")
    if a.write:
        path = Path(__file__).resolve().parent / "RESULTS.md"
        with open(path, "a") as f:
            f.write("\n## Distillation step\n\n" + head + "\n" + "".join(f"  - {x}\n" for x in lines))
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
