"""Which Mamba heads matter: the activation selection for mamba_heads=6 and 4 on the embedded model and
every single-head swap of it (one kept head of one group of one layer replaced by a dropped head of
the same group), each evaluated on the first 32,768 valid-split tokens. Calibration as in
bench/bench_prune_quality.py with `remodel score` defaults (1024 x 256 train-split tokens). Prints
the perplexity of each neighbour and the best one; ~6 min on 1 thread.

    python bench/bench_prune_head_swaps.py
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from remodel.compress.prune import plan_keep, prune_model  # noqa: E402
from remodel.compress.scores import load_scores  # noqa: E402
from remodel.models.load import load_model  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus, load_texts, pack  # noqa: E402
from remodel.pipelines.commands.score import score  # noqa: E402
from remodel.pipelines.training.evaluate import evaluate  # noqa: E402

MODEL = ROOT / "data" / "embedded"


def swaps(keep: dict, groups: int, per_group: int):
    """(layer key, head out, head in, new keep) for every single-head swap within a group."""
    for k, v in keep.items():
        if "mamba_heads" not in k:
            continue
        kept = v.tolist()
        for g in range(groups):
            mine = [h for h in kept if h // per_group == g]
            others = [h for h in range(g * per_group, (g + 1) * per_group) if h not in mine]
            for out in mine:
                for inn in others:
                    yield k, out, inn, {**keep, k: torch.tensor(sorted([h for h in kept if h != out] + [inn]))}


def main():
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    train, valid = embedded_corpus()
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    blocks = pack(load_texts(valid), tok, 256, max_tokens=32768)
    model = load_model(MODEL)
    cfg = model.cfg
    tmp = Path(tempfile.mkdtemp())
    score(MODEL, train, tmp / "a", samples=1024, seq_len=256, batch=16, mode="whole", progress=False)
    scores = load_scores(tmp / "a")[0]

    def ev(keep):
        return evaluate(prune_model(model, keep), blocks, seq_len=256, batch=16)["ppl"]

    per_group = cfg.mamba.mamba_num_heads // cfg.mamba.n_groups
    for heads in (cfg.mamba.mamba_num_heads * 3 // 4, cfg.mamba.mamba_num_heads // 2):
        keep = plan_keep(cfg, scores, {"mamba_heads": heads})
        base = ev(keep)
        print(heads, "activation", round(base, 3),
              {k: v.tolist() for k, v in keep.items() if "mamba_heads" in k}, flush=True)
        best = (base, None)
        for k, out, inn, k2 in swaps(keep, cfg.mamba.n_groups, per_group):
            p = ev(k2)
            print(f"  {k} swap {out}->{inn}: {p:.3f}", flush=True)
            if p < best[0]:
                best = (p, (k, out, inn))
        print(heads, "best single swap", best, flush=True)


if __name__ == "__main__":
    main()
