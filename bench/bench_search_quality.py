"""Search's pick against the uniform-width cut of the same size, on the embedded model at 60% params.

1. `search` (pipelines/commands/search.py) on the embedded checkpoint, DATA = the corpus' train file, budget
   60% of the parameters: scores on the train part, every candidate of plan's 2% window pruned and
   ranked by loss on the held-out 20th documents of the train file, the best `--candidates`
   distilled for `--tokens` tokens (teacher = the embedded model) and re-ranked.
2. The uniform-width baseline: the same fraction cut on every searched width axis (hidden, FFN; Mamba
   heads to the nearest multiple of n_groups), no depth cut, the largest such cut within the same
   budget (it keeps at least as many parameters as the pick), pruned with the same scores and
   distilled on the same data with the same tokens, lr and seed.
3. Both (and both before distillation) evaluated on every token of the corpus' valid file, which
   neither the search nor the distillation saw.

    python bench/bench_search_quality.py [--tokens 131072] [--candidates 3] [--lr 1e-3] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remodel.models.load import load_config  # noqa: E402
from remodel.models.params import count_params  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus, load_texts  # noqa: E402
from remodel.pipelines.commands.prune import prune  # noqa: E402
from remodel.pipelines.commands.search import search_job  # noqa: E402
from remodel.pipelines.training.evaluate import evaluate  # noqa: E402
from remodel.pipelines.training.train import train  # noqa: E402

EMBEDDED = Path(__file__).resolve().parents[1] / "data" / "embedded"


def uniform_targets(cfg, budget: float) -> tuple[float, dict, int]:
    """Largest single fraction f (steps of 0.5%) cut from hidden, FFN and Mamba heads that fits `budget`."""
    for k in range(1, 200):
        f = k / 200
        nh = max(cfg.mamba.n_groups, cfg.mamba.n_groups * round(cfg.mamba.mamba_num_heads * (1 - f) / cfg.mamba.n_groups))
        t = {"hidden_size": round(cfg.hidden_size * (1 - f)), "ffn_size": round(cfg.mlp.intermediate_size * (1 - f)),
             "mamba_heads": nh}
        n = count_params(cfg.replace(hidden_size=t["hidden_size"], intermediate_size=t["ffn_size"],
                                     mamba_num_heads=nh))["total"]
        if n <= budget:
            return f, t, n
    raise AssertionError("no uniform cut fits")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fraction", type=float, default=0.6)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--candidates", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default=None, help="keep the outputs here (default: a temporary folder)")
    a = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.time()
    train_txt, valid_txt = embedded_corpus()
    cfg = load_config(EMBEDDED)
    budget = a.fraction * count_params(cfg)["total"]
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench-search-"))
    root.mkdir(parents=True, exist_ok=True)
    kw = dict(seq_len=a.seq_len, batch=a.batch)

    rep = search_job(EMBEDDED, root / "search", train_txt, params=budget, candidates=a.candidates,
                 distill_tokens=a.tokens, overwrite=True, lr=a.lr, progress=False, **kw)
    pick = rep["pick"]
    t_search = time.time() - t0

    f, targets, n_uni = uniform_targets(cfg, budget)
    prune(EMBEDDED, root / "uniform", scores_dir=root / "search" / "scores", overwrite=True, **targets)
    split = root / "train-split"  # the search's distillation data: the train file less its held-out 20ths
    shutil.rmtree(split, ignore_errors=True)
    load_texts(train_txt, split_valid=True)[0].save_to_disk(str(split))
    urep = train(root / "uniform", root / "uniform-distilled", split, teacher_dir=EMBEDDED, tokens=a.tokens,
                 lr=a.lr, seed=0, log_every=0, checkpoint_every=10**9, keep_last=1, overwrite=True, **kw)

    ev = lambda d: evaluate(d, valid_txt, seq_len=a.seq_len, batch=a.batch)  # noqa: E731
    src = ev(EMBEDDED)
    uni_before, uni_after = ev(root / "uniform"), ev(root / "uniform-distilled")
    pick_after = ev(root / "search")
    # the pick before distillation, re-pruned from the same scores (same targets as in the report)
    row = next(r for r in rep["candidates"] if r["chosen"])
    prune(EMBEDDED, root / "pick-pruned", scores_dir=root / "search" / "scores", overwrite=True, **row["prune_targets"])
    pick_before = ev(root / "pick-pruned")
    out = {
        "machine": f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "budget": int(budget), "source": {"params": count_params(cfg)["total"], "valid_ppl": src["ppl"]},
        "distill": {"tokens": urep["tokens"], "steps": urep["steps"], "lr": a.lr, "seq_len": a.seq_len,
                    "batch": a.batch},
        "search": {"candidates_evaluated": len(rep["candidates"]), "distilled": rep["distilled"],
                   "seconds": round(t_search, 1), "table": [
                       {k: r.get(k) for k in ("plan_rank", "loss_rank", "shape", "params", "ppl", "distilled_ppl",
                                              "chosen")} for r in rep["candidates"]]},
        "pick": {"shape": pick["shape"], "params": pick["params"], "valid_ppl_pruned": pick_before["ppl"],
                 "valid_ppl_distilled": pick_after["ppl"], "heldout_ppl_pruned": pick["ppl"],
                 "heldout_ppl_distilled": pick["distilled_ppl"]},
        "uniform": {"fraction": f, "targets": targets, "params": n_uni, "valid_ppl_pruned": uni_before["ppl"],
                    "valid_ppl_distilled": uni_after["ppl"]},
        "pick_better": pick_after["ppl"] < uni_after["ppl"],
        "seconds": round(time.time() - t0, 1),
    }
    print(json.dumps(out, indent=2))
    if not a.out:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
