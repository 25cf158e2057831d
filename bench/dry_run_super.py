"""Dry run of the Nemotron 3 Super 120B-A12B -> ~75B job at full depth on CPU: score, plan, search, export.

The checkpoint is synthetic: the public Super layer pattern (88 layers: 40 M, 40 E, 8 *, from
models/configs/nemotron-3-super-120b-a12b.json) with every width divided by SCALE (default 32), via
bench/dry_run_56b.py's scale_widths: hidden 4096 -> 128, Mamba 128 x 64 -> 8 x 32 (8 groups, state
128 -> 4), attention 32/2 heads x 128 -> 16/1 x 8, vocab 131072 -> 4096, LatentMoE latent 1024 -> 32,
expert FFN 2688 -> 84, shared expert 5376 -> 168; 512 experts, top-22, kept (a count, not a width).
Random weights, bf16 on disk, with the public MTP head (one '*E' step, models/mtp.py) at the same widths:
scoring runs it on the calibration data and ranks its own units, and the export keeps it pruned
(check_mtp: every mtp.* tensor of the output equals the source head pruned by the plan's keep set, its
logits match, inspect's MTP count equals the tensors written).

The budget is the job's, scaled by the ratio of the miniature's counts to the full model's:
  params        = scaled total  x 75e9 / total(Super)    (the "prune 120B to 70-80B" request)
  active params = scaled active x 10e9 / active(Super)   (a 75B-A10B class: the active budget binds too)
  axes          = experts, expert FFN, latent, hidden, depth, width divisors / SCALE like the 56B run.
Plan ranks the grid by arithmetic; search scores the model once, prunes plan's first `--top` shapes,
ranks them by held-out loss (random weights: the ranking is noise, the run measures the path, time
and memory) and exports the pick, which transformers loads. Prints one JSON object.

    python bench/dry_run_super.py [--scale 32] [--top 3] [--candidates 1] [--distill-tokens 0] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dry_run_56b import (build_checkpoint, check_export, check_refusals, counts, cpu_seconds,  # noqa: E402
                         peak_rss_mb, reference, scale_widths)
from remodel.models.params import count_params  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus  # noqa: E402
from remodel.pipelines.commands.plan import plan  # noqa: E402

SUPER = "nemotron-3-super-120b-a12b"
PARAMS_B, ACTIVE_B = 75e9, 10e9
AXES = ("experts", "expert_ffn_size", "latent_size", "hidden_size", "depth")


def scaled_config(scale: int):
    """The Super structure with every width / scale (expert count and top-k kept)."""
    return scale_widths(reference(SUPER), scale)


def scaled_budget(cfg, scale: int, params=PARAMS_B, active=ACTIVE_B) -> dict:
    """The full-scale budgets as the same fractions of the miniature's total and active counts."""
    full, mini = count_params(reference(SUPER)), count_params(cfg)
    return {"params": mini["total"] * params / full["total"], "active_params": mini["active"] * active / full["active"],
            "plan_options": {"axes": AXES, "divisors": {"hidden_size": 256 // scale, "expert_ffn_size": 512 // scale,
                                                        "latent_size": max(1, 256 // scale)}}}


@torch.no_grad()
def check_mtp(ckpt: Path, out: Path, scores: Path, pick: dict) -> dict:
    """The pick's MTP head: in OUT, equal to the source's head pruned with the keep set plan_keep gives
    for the pick (its MTP blocks ranked by their own scores), MTP logits against that, counts."""
    from safetensors import safe_open

    from remodel.compress.prune import plan_keep, prune_model
    from remodel.compress.scores import load_scores
    from remodel.models.load import load_model

    tensors, _ = load_scores(scores)
    src = load_model(ckpt)
    keep = plan_keep(src.cfg, tensors, pick["prune_targets"], "nemotron_h")
    want, got = prune_model(src, keep), load_model(out)
    mine, theirs = got.state_dict(), want.state_dict()
    names = [n for n in theirs if n.startswith("mtp.")]
    equal = all(mine[n].shape == theirs[n].shape and torch.equal(mine[n], theirs[n]) for n in names)
    ids = torch.randint(0, src.cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    diff = (got.forward_mtp(ids)[1][0] - want.forward_mtp(ids)[1][0]).abs().max().item()
    hf = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            hf.update({k: fh.get_slice(k).get_shape() for k in fh.keys() if k.startswith("mtp.")})
    res = {"hf_mtp_tensors": len(hf),
           "mtp_params_written": sum(torch.Size(v).numel() for k, v in hf.items() if not k.endswith("correction_bias")),
           "inspect_mtp_params": count_params(got.cfg)["mtp"]["total"],
           "mtp_params_source": count_params(src.cfg)["mtp"]["total"],
           "equals_source_head_pruned": equal, "max_abs_mtp_logit_diff": diff,
           "own_scores": "mtp.layers.1.expert_contribution" in tensors}
    e = keep.get("mtp.layers.1.experts")
    if e is not None:  # the old stand-in: the last trunk MoE layer's ranking
        last = tensors[f"layers.{src.cfg.pattern.rindex('E')}.experts"]
        res["mtp_experts_differ_from_stand_in"] = int((~torch.isin(e, last.argsort(descending=True)[:len(e)])).sum())
    return res


def row(c: dict) -> dict:
    """A plan candidate, short."""
    return {"rank": c["rank"], "layers": c["num_layers"], "counts": counts(c["pattern"], "ME*"),
            "changed": c["changed"], "params": c["params"], "active_params": c["active_params"]}


def summary(scale: int, cfg, b: dict, d: dict, rep: dict, checks: dict) -> dict:
    """The printed JSON: source, budget, plan, search, pick, then the checks (export, MTP, refusals, phases)."""
    src, pick = count_params(cfg), rep["pick"]
    return {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "scale": scale,
        "source": {"layers": cfg.num_layers, "counts": counts(cfg.pattern, "ME*"), "params": src["total"],
                   "active_params": src["active"], "mtp_params": src["mtp"]["total"], "hidden": cfg.hidden_size,
                   "latent": cfg.moe.moe_latent_size, "experts": cfg.moe.n_routed_experts,
                   "expert_ffn": cfg.moe.moe_intermediate_size, "shared": cfg.moe.moe_shared_expert_intermediate_size,
                   "vocab": cfg.vocab_size},
        "budget": {"params": int(b["params"]), "active_params": int(b["active_params"]), "axes": list(AXES),
                   "full_scale": {"params": PARAMS_B, "active_params": ACTIVE_B}},
        "plan": {"grid": d["grid"], "window": d["window"], "maximal": d["maximal"],
                 "top": [row(c) for c in d["candidates"]]},
        "search": {"evaluated": len(rep["candidates"]), "distilled": rep["distilled"],
                   "table": [{k: r.get(k) for k in ("plan_rank", "loss_rank", "shape", "params", "active_params",
                                                     "loss", "distilled_loss", "chosen")} for r in rep["candidates"]]},
        "pick": {"shape": pick["shape"], "layers": len(pick["pattern"]), "counts": counts(pick["pattern"], "ME*"),
                 "widths": pick["widths"], "params": pick["params"], "active_params": pick["active_params"],
                 "params_fraction": round(pick["params"] / src["total"], 4),
                 "active_fraction": round(pick["active_params"] / src["active"], 4)},
        **checks}


def search_parser(description=None) -> argparse.ArgumentParser:
    """The dry runs' common options (bench/dry_run_family.py adds its own to these)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--scale", type=int, default=32)
    ap.add_argument("--top", type=int, default=3, help="plan candidates pruned and ranked by loss")
    ap.add_argument("--candidates", type=int, default=1, help="of those, distilled")
    ap.add_argument("--distill-tokens", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4, help="calibration sequences for scoring")
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--out", default=None, help="keep the outputs here (default: a temporary folder)")
    return ap


def main():
    a = search_parser().parse_args()
    from remodel.pipelines.commands.score import score
    from remodel.pipelines.commands.search import search_job

    t0, phases = time.time(), {}

    def mark(name, t):
        phases[name] = {"seconds": round(time.time() - t, 1), "cpu_seconds_so_far": round(cpu_seconds(), 1),
                        "peak_rss_mb_so_far": round(peak_rss_mb(), 1)}

    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="dry-run-super-"))
    root.mkdir(parents=True, exist_ok=True)
    ckpt, scores, out = root / "synthetic-super", root / "scores", root / "searched-75b"
    train_txt, _ = embedded_corpus()
    cfg = scaled_config(a.scale)
    b = scaled_budget(cfg, a.scale)
    budget = {"params": b["params"], "active_params": b["active_params"]}

    t = time.time()
    build_checkpoint(cfg, ckpt)
    mark("build", t)
    refused = check_refusals(ckpt, root, train_txt, cfg)

    t = time.time()
    score(ckpt, train_txt, scores, samples=a.samples, seq_len=a.seq_len, batch=a.batch, loss_batches=1,
          overwrite=True, progress=False)
    mark("score", t)

    t = time.time()
    d = plan(ckpt, **budget, scores=scores, top=a.top, verbose=False, **b["plan_options"])
    mark("plan", t)

    t = time.time()
    rep = search_job(ckpt, out, train_txt, **budget, plan_options=b["plan_options"], top=a.top, candidates=a.candidates,
                 distill_tokens=a.distill_tokens, scores_dir=scores, seq_len=a.seq_len, batch=a.batch,
                 eval_tokens=a.eval_tokens, overwrite=True, progress=False)
    mark("search (prune, rank, export)", t)

    t = time.time()
    export = check_export(out)
    mark("transformers load + logits", t)

    t = time.time()
    mtp = check_mtp(ckpt, out, scores, next(r for r in rep["candidates"] if r["chosen"]))
    mark("MTP head check", t)

    res = summary(a.scale, cfg, b, d, rep, {"export": export, "mtp": mtp, "refused": refused, "phases": phases})
    res.update(wall_seconds=round(time.time() - t0, 1), cpu_seconds=round(cpu_seconds(), 1),
               load_average=[round(x, 2) for x in os.getloadavg()], peak_rss_mb=round(peak_rss_mb(), 1))
    print(json.dumps(res, indent=2))
    if not a.out:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
