"""Dry run of `search` over a released config of any family at full depth on CPU: score, plan, search, export.

The checkpoint is synthetic: a shipped config (models/configs, e.g. granite-4.0-h-small, falcon-h1-34b,
bamba-9b) with every width divided by SCALE (bench/dry_run_56b.py's scale_widths: hidden, Mamba width, FFN,
expert and shared FFN, attention width, vocab; the expert count, top-k, layer pattern and multipliers kept),
random weights, bf16, written in the config's own family. The budget is the job's (--params-b, e.g. 20 for
Granite 4.0-H-Small 32B -> 20B) as the same fraction of the miniature's parameters; plan's grid uses the
width divisors / SCALE. `search` scores the model, prunes plan's first --top shapes, ranks them by held-out
loss (random weights: the ranking is noise; the run measures path, time and memory) and exports the pick in
the source's family, which transformers loads (parameter count and logits checked). Prints one JSON object.

    python bench/dry_run_family.py --name granite-4.0-h-small --params-b 20 [--scale 32] [--top 3] [--out DIR]
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dry_run_56b import check_export, cpu_seconds, peak_rss_mb, reference, scale_widths  # noqa: E402
from dry_run_super import search_parser  # noqa: E402
from remodel.models.hf import default_family  # noqa: E402
from remodel.models.load import save_model  # noqa: E402
from remodel.models.model import HybridLM, init_weights  # noqa: E402
from remodel.models.params import count_params  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path  # noqa: E402


def scaled(name: str, scale: int):
    """(source config, miniature config, family): the miniature keeps the source's pattern and counts."""
    src = reference(name)
    return src, scale_widths(src, scale), default_family(src)


def build(cfg, family: str, path: Path, seed: int = 0):
    """A random-weight (std 0.02) bf16 checkpoint of cfg in `family`, with the embedded tokenizer's files."""
    save_model(init_weights(HybridLM(cfg), std=0.02, seed=seed), path, family=family,
               aux_from=embedded_tokenizer_path(), overwrite=True, dtype=torch.bfloat16)


def _args():
    ap = search_parser(__doc__.split("\n")[0])  # dry_run_super's options
    ap.add_argument("--name", required=True, help="a shipped config (remodel inspect NAME)")
    ap.add_argument("--params-b", type=float, required=True, help="the full-scale budget in billions")
    return ap.parse_args()


def main():
    a = _args()
    from remodel.pipelines.commands.search import search_job

    t0 = time.time()
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="dry-run-family-"))
    root.mkdir(parents=True, exist_ok=True)
    ckpt, out = root / f"synthetic-{a.name}", root / "searched"
    src, cfg, family = scaled(a.name, a.scale)
    full, mini = count_params(src), count_params(cfg)
    budget = mini["total"] * a.params_b * 1e9 / full["total"]
    opts = {"divisors": {"hidden_size": max(1, 256 // a.scale), "ffn_size": max(1, 512 // a.scale),
                         "expert_ffn_size": max(1, 512 // a.scale), "shared_expert_size": max(1, 512 // a.scale)}}
    build(cfg, family, ckpt)
    train_txt, _ = embedded_corpus()
    rep = search_job(ckpt, out, train_txt, params=budget, plan_options=opts, top=a.top, candidates=a.candidates,
                     distill_tokens=a.distill_tokens, score_samples=a.samples, seq_len=a.seq_len, batch=a.batch,
                     eval_tokens=a.eval_tokens, overwrite=True, progress=False)
    pick = rep["pick"]
    res = {"name": a.name, "family": family, "scale": a.scale,
           "source_full": {"params": full["total"], "active_params": full["active"]},
           "source_mini": {"params": mini["total"], "active_params": mini["active"], "layers": cfg.num_layers,
                           "hidden": cfg.hidden_size},
           "budget": {"full_scale_b": a.params_b, "mini": int(budget)},
           "search": [{k: r.get(k) for k in ("plan_rank", "loss_rank", "shape", "params", "loss", "chosen")}
                      for r in rep["candidates"]],
           "pick": {"shape": pick["shape"], "layers": len(pick["pattern"]), "widths": pick["widths"],
                    "params": pick["params"], "params_fraction": round(pick["params"] / mini["total"], 4)},
           "export": check_export(out), "wall_seconds": round(time.time() - t0, 1),
           "cpu_seconds": round(cpu_seconds(), 1), "peak_rss_mb": round(peak_rss_mb(), 1),
           "load_average": [round(x, 2) for x in os.getloadavg()]}
    assert res["export"]["transformers_params"] == pick["params"], res["export"]
    print(json.dumps(res, indent=2))
    if not a.out:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
