"""Upcycling throughput: `upcycle` vs a plain streaming copy of the same checkpoint.

Builds a synthetic Nemotron-H-style dense checkpoint (bf16, a few hundred MB) in a temp dir, then
times models.checkpoint.copy_checkpoint(src), upcycle(src) (deviation check included) and
copy_checkpoint(upcycled) (the same bytes the upcycle writes), interleaved for --repeats rounds in one
process. Prints the ratios and records them under "## Upcycling" in bench/RESULTS.md (its own
subsection, replaced on each run) unless --no-record.
    python bench/bench_upcycle.py [--experts 16 --granularity 4 --top-k 8 --hidden 1024 --ffn 4096]
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from remodel.models.checkpoint import copy_checkpoint  # noqa: E402
from remodel.models.config import ModelConfig  # noqa: E402
from remodel.models.load import save_model  # noqa: E402
from remodel.models.model import HybridLM  # noqa: E402
from remodel.pipelines.commands.upcycle import upcycle  # noqa: E402

SUBHEAD = "### Time against a plain copy (bench/bench_upcycle.py)"


def dense_checkpoint(path, hidden, ffn, pattern, vocab):
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, pattern=pattern, num_attention_heads=hidden // 128,
                      num_key_value_heads=2, head_dim=128, intermediate_size=ffn, mamba_num_heads=hidden // 32,
                      mamba_head_dim=64, n_groups=4, ssm_state_size=128, chunk_size=128)
    torch.manual_seed(0)
    with torch.no_grad():
        model = HybridLM(cfg)
        for p in model.parameters():
            p.normal_(0, 0.02)
    save_model(model, path, dtype=torch.bfloat16, max_shard_bytes=256 * 1024**2)
    return cfg


def size(path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def record(subhead: str, body: str, section: str = "## Upcycling"):
    """Replace (or append) `subhead` and its text inside `section` of bench/RESULTS.md, in one write;
    the other sections are left as they are."""
    path = ROOT / "bench" / "RESULTS.md"
    lines = path.read_text().splitlines() if path.exists() else []
    if section not in lines:
        lines += ["", section, ""] if lines else [section, ""]
    s = lines.index(section)
    e = next((j for j in range(s + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
    block, new = lines[s + 1:e], [subhead, "", *body.strip("\n").splitlines(), ""]
    if subhead in block:
        i = block.index(subhead)
        j = next((k for k in range(i + 1, len(block)) if block[k].startswith(("### ", "## "))), len(block))
        block[i:j] = new
    else:
        while block and not block[-1].strip():
            block.pop()
        block += ["", *new]
    lines[s + 1:e] = block
    path.write_text("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--granularity", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--pattern", default="M-M*-M-M-M-M-")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pre-touch-gb", type=float, default=3.0)
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        dense_checkpoint(tmp / "dense", a.hidden, a.ffn, a.pattern, a.vocab)
        runs = {"as is": [], "pre-touched": []}  # per round: {step: (wall s, process CPU s)}

        def timed(fn, warm_bytes):
            os.sync()  # no dirty pages of the previous step throttle this one
            if warm_bytes:  # touch and free that much memory: the next allocations find host-backed pages
                torch.ones(warm_bytes, dtype=torch.uint8)
            w, c = time.perf_counter(), time.process_time()
            r = fn()
            return (time.perf_counter() - w, time.process_time() - c), r

        for r in range(a.repeats):  # interleaved so load spikes hit every step
            for mode, rounds in runs.items():
                warm = 0 if mode == "as is" else int(a.pre_touch_gb * 2**30)
                t_copy, _ = timed(lambda: copy_checkpoint(tmp / "dense", tmp / "copy"), warm)
                t_up, rep = timed(lambda: upcycle(tmp / "dense", tmp / "moe", a.experts, a.granularity, a.top_k), warm)
                t_out, _ = timed(lambda: copy_checkpoint(tmp / "moe", tmp / "copy_moe"), warm)
                t_cp, _ = timed(lambda: shutil.copytree(tmp / "moe", tmp / "cp_moe"), warm)
                rounds.append({"copy": t_copy, "up": t_up, "out": t_out, "cp": t_cp, "rep": rep})
                src_mb, out_mb = size(tmp / "dense") / 2**20, size(tmp / "moe") / 2**20
                for d in ("copy", "copy_moe", "moe", "cp_moe"):  # keep the disk footprint of one round
                    shutil.rmtree(tmp / d)
    lines = [f"- {time.strftime('%Y-%m-%d')} {platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}: "
             f"dense {src_mb:.0f} MB bf16 (H={a.hidden}, F={a.ffn}, `{a.pattern}`, vocab {a.vocab}) -> N={a.experts} "
             f"G={a.granularity} T={a.top_k} ({out_mb:.0f} MB, {out_mb / src_mb:.2f}x the bytes); {a.repeats} interleaved "
             f"rounds of copy_checkpoint(dense) / upcycle / copy_checkpoint(output) / `shutil.copytree`(output) in one "
             f"process, `os.sync()` before each step; best wall time (process CPU time). Two settings per round: *as "
             f"is*, and *pre-touched*: {a.pre_touch_gb:g} GiB allocated, touched and freed (untimed) before each step."]
    for mode, rounds in runs.items():
        best = {k: min(r[k][0] for r in rounds) for k in ("copy", "up", "out", "cp")}
        cpu = {k: min(r[k][1] for r in rounds) for k in ("copy", "up", "out", "cp")}
        rep = min(rounds, key=lambda r: r["up"][0])["rep"]
        sec, dev = rep["seconds"], rep["deviation"]
        med = sorted(r["up"][0] / r["copy"][0] for r in rounds)[len(rounds) // 2]
        lines.append(
            f"  - {mode}: copy(dense) {best['copy']:.2f}s ({cpu['copy']:.2f}s CPU); upcycle {best['up']:.2f}s "
            f"({cpu['up']:.2f}s CPU; deviation check {sec['deviation_check_overlapped']:.2f}s on its own thread, "
            f"overlapped); copy(output) {best['out']:.2f}s; copytree(output) {best['cp']:.2f}s. "
            f"**upcycle / copy(dense) {best['up'] / best['copy']:.2f}x** (median of rounds {med:.2f}x), "
            f"upcycle / copy(output) {best['up'] / best['out']:.2f}x, upcycle / copytree(output) "
            f"{best['up'] / best['cp']:.2f}x. Rounds (copy, upcycle, copy output, copytree) s: "
            + "; ".join(", ".join(f"{r[k][0]:.2f}" for k in ("copy", "up", "out", "cp")) for r in rounds))
    lines.append(f"  - deviation (1x{dev['seq_len']} random tokens, dense and upcycled streams layer by layer): max "
                 f"|dlogit| {dev['max_abs_logit_diff']:.2g}, worst layer MoE-vs-MLP rel "
                 f"{max(x['rel_out_diff'] for x in dev['layers']):.1e}")
    line = "\n".join(lines)
    print(line)
    if not a.no_record:
        record(SUBHEAD, line)


if __name__ == "__main__":
    main()
