"""The exhaustive held-out bound for Mamba heads (issue 55): every group-even set of one layer's heads removed,
the rest of the model pruned as magnitude prunes it, each measured on the held-out tokens. Its minimum is the best
any criterion could do there given magnitude's choice elsewhere (data/embedded: layer 0 holds all the cost; the
other layers' heads cost below 0.002 nats each, bench/results/head_criteria_mamba.md); each criterion's own
layer-0 set is placed in that ranking.

    python bench/bench_head_sets.py [--layer 0 --samples 32 --seq-len 256 --eval-tokens 16384] [--write]
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_head_scores import MODEL, cuts  # noqa: E402
from remodel.compress.baselines import weight_scores  # noqa: E402
from remodel.compress.head_criteria import gate_criteria  # noqa: E402
from remodel.compress.head_loo import HeadMask, loo_scores, loo_units, loss_from  # noqa: E402
from remodel.compress.importance import score_model  # noqa: E402
from remodel.compress.prune import plan_keep  # noqa: E402
from remodel.models.load import load_model  # noqa: E402
from remodel.models.trunk import start  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus, load_texts, pack  # noqa: E402

OUT = ROOT / "bench" / "head_sets.json"


def removed(cfg, scores, t) -> dict:
    """{layer: the head indices plan_keep drops for targets t}."""
    keep = plan_keep(cfg, scores, t)
    return {i: sorted(set(range(len(ch))) - set(keep[f"layers.{i}.mamba_heads"].tolist()))
            for i, _, ch in loo_units(cfg)}


def set_loss(model, store, batches, drop: dict) -> float:
    """Held-out loss with drop[layer]'s heads removed in every layer at once (as pruning removes them)."""
    chans = {i: ch for i, _, ch in loo_units(model.cfg)}
    masks = [HeadMask(model.layers[i], torch.cat([chans[i][h] for h in hs])) for i, hs in drop.items() if hs]
    try:
        return loss_from(model, 0, store, batches, None)
    finally:
        for m in masks:
            m.remove()


def candidate_sets(cfg, layer: int, per_group: int) -> list[tuple[int, ...]]:
    """Every set removing `per_group` heads of each of the layer's groups."""
    n = [len(ch) for i, _, ch in loo_units(cfg) if i == layer][0]
    G = cfg.mamba.n_groups
    r = n // G
    groups = [itertools.combinations(range(g * r, (g + 1) * r), per_group) for g in range(G)]
    return [tuple(h for part in combo for h in part) for combo in itertools.product(*groups)]


def criteria(model, calib, seeds) -> dict:
    cfg = model.cfg
    act, _ = score_model(model, calib, loss_increase=False)
    out = {"activation": act, "magnitude": weight_scores(cfg, "magnitude", model.state_dict().items())}
    gates = gate_criteria(model, calib)
    for name in ("out_act_w", "fisher", "taylor"):
        out[name] = loo_scores(cfg, act, gates[name])
    out.update({f"random{s}": weight_scores(cfg, "random", seed=s) for s in range(seeds)})
    return out


@torch.no_grad()
def run(layer, samples, seq_len, eval_tokens, seeds, batch) -> dict:
    from transformers import AutoTokenizer

    train, valid = embedded_corpus()
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    calib = list(pack(load_texts(train), tok, seq_len, max_tokens=samples * seq_len).split(batch))
    held = list(pack(load_texts(valid), tok, seq_len, max_tokens=eval_tokens).split(batch))
    model = load_model(MODEL).float().eval()
    cfg = model.cfg
    with torch.enable_grad():
        crit = criteria(model, calib, seeds)
    store = [start(cfg, model.embed(ids)) for ids in held]
    res = {}
    for cut, t in cuts(cfg).items():
        mag = removed(cfg, crit["magnitude"], t)
        per_group = len(mag[layer]) // cfg.mamba.n_groups
        losses = {s: set_loss(model, store, held, {**mag, layer: list(s)}) for s in candidate_sets(cfg, layer, per_group)}
        order = sorted(losses, key=losses.get)
        rows = {}
        for name, sc in crit.items():
            s = tuple(removed(cfg, sc, t)[layer])
            rows[name] = {"set": list(s), "loss": losses[s], "rank": order.index(s) + 1}
        res[cut] = {"sets": len(order), "best": {"set": list(order[0]), "loss": losses[order[0]]},
                    "worst": {"set": list(order[-1]), "loss": losses[order[-1]]},
                    "median": losses[order[len(order) // 2]], "criteria": rows,
                    "all": {",".join(map(str, s)): losses[s] for s in order}}
        print(cut, json.dumps({k: v for k, v in res[cut].items() if k != "all"}), flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layer", type=int, default=0, help="the Mamba layer whose head sets are enumerated")
    ap.add_argument("--samples", type=int, default=32, help="calibration sequences (train split) for the criteria")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens (valid split)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--write", action="store_true", help="write bench/head_sets.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    res = {"cuts": run(a.layer, a.samples, a.seq_len, a.eval_tokens, a.seeds, a.batch), "settings": vars(a),
           "seconds": round(time.time() - t0, 1), "date": str(datetime.date.today())}
    print(f"seconds {res['seconds']}")
    if a.write:
        OUT.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
