"""A train step quiet and beside busy processes: torch's defaults against the CLI's policy
(pipelines/commands/threads.py: OpenMP threads that sleep at barriers), and that policy with one thread.

Each (policy, load) runs in a fresh process (OpenMP reads its wait policy once, at load): the embedded
checkpoint (data/embedded), AdamW, forward + backward on 4 x 256 tokens, the median of --steps after two
warm-ups. "busy" is --busy Python loops spinning beside it. Prints one JSON object: step seconds per case and
each policy's busy / quiet ratio (goal <= 2.5 on the 2-core VM, issue 53).

    python bench/bench_load.py [--steps 12] [--busy 2] [--json bench/load.json]

Also the Gated DeltaNet rule's step at 4096 tokens (--delta): the chunk loop before (x[:, :, i] per chunk,
kept here as the baseline) and after (one unbind), in this process, alternately.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

STEP = r"""
import os, sys, time, statistics
policy, steps = sys.argv[1], int(sys.argv[2])
if policy.startswith("remodel"):
    from remodel.pipelines.commands import threads
    threads.prepare_env()
import torch
if policy.startswith("remodel"):
    threads.apply({"REMODEL_THREADS": "1"} if "1 thread" in policy else {})
from remodel.models.load import load_model
from remodel.pipelines.commands.demo import EMBEDDED
torch.manual_seed(0)
m = load_model(EMBEDDED).float().train()
opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
vocab = m.cfg.vocab_size
ids = torch.randint(0, vocab, (4, 256))
times = []
for i in range(steps + 2):
    t = time.perf_counter()
    logits = m(ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    if i >= 2:
        times.append(time.perf_counter() - t)
print(statistics.median(times), torch.get_num_threads())
"""


def _spin():
    while True:
        pass


def one(policy: str, steps: int, busy: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "REMODEL_THREADS")}
    env["PYTHONPATH"] = str(REPO.parent) + os.pathsep + env.get("PYTHONPATH", "")
    loops = [mp.Process(target=_spin, daemon=True) for _ in range(busy)]
    for p in loops:
        p.start()
    try:
        time.sleep(0.5 if busy else 0)
        out = subprocess.run([sys.executable, "-c", STEP, policy, str(steps)], env=env, capture_output=True,
                             text=True, timeout=1800, check=True).stdout.split()
    finally:
        for p in loops:
            p.terminate()
            p.join()
    return {"step_s": float(out[0]), "threads": int(out[1])}


def delta(reps: int) -> dict:
    """The gated delta rule at 4096 tokens (qwen3.5-like head: 2 key x 4 value heads, 128 dims), forward +
    backward, fp32: the old per-chunk indexing against the unbind, alternately."""
    import torch

    from remodel.models import gdn_kernels as gk

    def old(q, k, v, g, beta, chunk_size=64, initial_state=None):
        b, l, h, dv = v.shape
        cd, dtype = gk.compute_dtype(v), q.dtype
        q, k = gk._queries_keys(q, k, h, cd)
        q, k, v = (gk._chunks(x, chunk_size) for x in (q, k, v.to(cd)))
        g, beta = (gk._chunks(x.to(cd)[..., None], chunk_size)[..., 0] for x in (g, beta))
        cum = g.cumsum(-1)
        causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool).tril()
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        big_u, big_w = gk._wy(k, v, beta, cum, decay)
        attn = (q @ k.transpose(-1, -2)) * decay
        q_in, k_out = q * cum.exp()[..., None], k * (cum[..., -1:] - cum).exp()[..., None]
        state = gk._state(initial_state, b, h, k.shape[-1], dv, v)
        outs = []
        for i in range(q.shape[2]):
            u = big_u[:, :, i] - big_w[:, :, i] @ state
            outs.append(q_in[:, :, i] @ state + attn[:, :, i] @ u)
            state = state * cum[:, :, i, -1].exp()[..., None, None] + k_out[:, :, i].transpose(-1, -2) @ u
        return torch.cat(outs, dim=2)[:, :, :l].transpose(1, 2).to(dtype), state

    g = torch.Generator().manual_seed(0)
    L, hk, hv, d = 4096, 2, 4, 128
    base = [torch.randn(1, L, hk, d, generator=g), torch.randn(1, L, hk, d, generator=g),
            torch.randn(1, L, hv, d, generator=g), -torch.rand(1, L, hv, generator=g), torch.rand(1, L, hv, generator=g)]
    runs = {"before": old, "after": gk.chunk_gated_delta_rule_torch}
    times = {k: [] for k in runs}
    grads = {}
    for _ in range(reps):
        for name, fn in runs.items():
            x = [t.clone().requires_grad_(True) for t in base]
            t = time.perf_counter()
            out, state = fn(*x)
            (out.square().sum() + state.square().sum()).backward()
            times[name].append(time.perf_counter() - t)
            grads[name] = [t.grad for t in x]
    same = all(torch.equal(a, b) for a, b in zip(grads["before"], grads["after"]))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"tokens": L, "before_s": med["before"], "after_s": med["after"], "speedup": med["before"] / med["after"],
            "grads_bit_identical": same, "threads": torch.get_num_threads()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--busy", type=int, default=2)
    ap.add_argument("--delta", action="store_true", help="the delta rule's step before / after instead")
    ap.add_argument("--reps", type=int, default=3, help="with --delta")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.delta:
        res = {"delta_rule_4096": delta(a.reps)}
    else:
        res = {"machine": f"{os.cpu_count()} cores", "busy_loops": a.busy, "cases": {}}
        for policy in ("torch default", "remodel", "remodel, 1 thread"):
            quiet, loaded = one(policy, a.steps, 0), one(policy, a.steps, a.busy)
            res["cases"][policy] = {"quiet": quiet, "busy": loaded, "busy_over_quiet": loaded["step_s"] / quiet["step_s"]}
            print(policy, res["cases"][policy], flush=True)
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
