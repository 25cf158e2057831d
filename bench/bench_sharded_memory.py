"""Per-rank peak memory of a sharded distillation against the same run in one process (issue 16).

A hybrid whose fp32 training state (weights + grads + AdamW moments, 16 B/param) is over 2 GB is
distilled from a teacher of the same size: once in one process, then under `torchrun --nproc-per-node 4`
as DP 2 x TP 2 and as DP 4. Each run loads, trains, writes a checkpoint and exports; the peak RSS of
every rank over the whole run (pipelines.training.metrics.PeakRSS, the kernel's high-water mark) is compared with
the one-process peak. Every run uses the same allocator policy, REMODEL_MMAP_THRESHOLD=1 MiB (the sharded
runs' default; one process defaults to 16 MiB, see pipelines.distributed.runtime.return_freed_memory), so the ratio
compares like with like. Prints JSON (also bench/sharded_memory.json).

    python bench/bench_sharded_memory.py [--hidden 1024] [--blocks 5] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from remodel.models.config import ModelConfig  # noqa: E402
from remodel.models.load import save_model  # noqa: E402
from remodel.models.model import HybridLM, init_weights  # noqa: E402
from remodel.models.params import count_params  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path  # noqa: E402
from rehearsal_56b import distill  # noqa: E402


def config(hidden: int, blocks: int) -> ModelConfig:
    """`blocks` x "M*-M-M*-": deep and narrow, so the state, not one layer's transient buffers, dominates."""
    return ModelConfig(vocab_size=8192, hidden_size=hidden, pattern="M*-M-M*-" * blocks, tie_word_embeddings=False,
                       num_attention_heads=hidden // 64, num_key_value_heads=4, head_dim=64,
                       intermediate_size=4 * hidden, mamba_num_heads=2 * hidden // 64, mamba_head_dim=64, n_groups=2,
                       ssm_state_size=64, chunk_size=64)


def build(path: Path, cfg: ModelConfig, seed: int):
    save_model(init_weights(HybridLM(cfg), seed=seed), path, family="nemotron_h", aux_from=embedded_tokenizer_path(),
               dtype=torch.bfloat16)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=5, help="repeats of the 8-layer pattern")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    os.environ["REMODEL_MMAP_THRESHOLD"] = str(1 << 20)  # inherited by every run, see the module doc
    root = a.out or Path(tempfile.mkdtemp(prefix="sharded-memory-"))
    root.mkdir(parents=True, exist_ok=True)
    cfg = config(a.hidden, a.blocks)
    build(root / "teacher", cfg, 1)
    build(root / "student", cfg, 0)
    n = count_params(cfg)["total"]
    a.data, a.steps, a.seq_len, a.batch = embedded_corpus()[0], 2, 64, 4
    runs = {"one_process": distill(root, "one", root / "teacher", root / "student", a, 1, 1),
            "dp2_tp2": distill(root, "dp2tp2", root / "teacher", root / "student", a, 4, 2),
            "dp4": distill(root, "dp4", root / "teacher", root / "student", a, 4, 1)}
    one = max(runs["one_process"]["rss_mb"][0].values())
    res = {"machine": "2-core CPU VM, 24 GiB, gloo", "mmap_threshold": 1 << 20, "params_each": n, "fp32_train_state_gb": 16 * n / 1e9,
           "flags": {"steps": 2, "seq_len": 64, "batch": 4, "checkpoint_every": 2},
           "runs": {k: {kk: v[kk] for kk in ("rc", "seconds", "rss_mb")} for k, v in runs.items()},
           "ratio_max_rank_vs_one_process": {k: max(max(m.values()) for m in runs[k]["rss_mb"].values()) / one
                                             for k in ("dp2_tp2", "dp4")}}
    print(json.dumps(res, indent=1))
    (REPO / "bench" / "sharded_memory.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
