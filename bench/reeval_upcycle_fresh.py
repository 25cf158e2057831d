"""Held-out loss of every final model in a bench_upcycle_fresh --work folder on a larger held-out set: the
bench's curves use --valid-blocks (64 there), whose noise is the size of the gaps it reports.

    python bench/reeval_upcycle_fresh.py WORK [--blocks 512] [--out bench/upcycle_fresh_reeval.json]
Prints each arm against the dense arm and writes the JSON (arm folder -> loss, plus the settings)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_upcycle_fresh as fresh  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--blocks", type=int, default=512, help="held-out blocks of 256 tokens (first N of valid.txt)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "upcycle_fresh_reeval.json")
    r = ap.parse_args(argv)
    a = fresh._args(["--work", str(r.work), "--valid-blocks", str(r.blocks)])
    blocks = fresh.valid_blocks(r.work / "dense", a)
    arms = ["dense"] + sorted(p.name for p in r.work.glob("arm-*") if (p / "model.safetensors").is_file())
    loss = {n: fresh.eval_loss(r.work / n, blocks, a) for n in arms}
    base = loss["arm-dense"]
    for n, v in loss.items():
        print(f"{n:40s} {v:.4f} {v - base:+.4f}")
    r.out.write_text(json.dumps({"work": str(r.work), "blocks": int(blocks.shape[0]), "seq_len": a.seq_len,
                                 "loss": loss, "vs_arm_dense": {n: v - base for n, v in loss.items()}}, indent=1))


if __name__ == "__main__":
    main()
