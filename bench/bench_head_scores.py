"""Mamba head criteria vs what a head costs (issue 55): held-out perplexity of data/embedded with 25% and 50% of
its Mamba heads removed (no retraining), each head criterion against magnitude, 5 random seeds and the measured
oracle, plus each criterion's per-layer Spearman rank correlation with the oracle and the pruned model's loss on
the calibration tokens themselves (`calib_loss`: the loss the oracle measures; a criterion that wins there but
not held out is fitted to the calibration set).

Oracle (`loo`): every head removed alone (as pruning removes it: compress/head_loo.py), its calibration loss
increase. Candidates, all on the same calibration tokens (train split):
  activation    the current default: the in_proj x segment's mean |x| x the out_proj column norm (`mamba_x`)
  magnitude     the head's in_proj / out_proj weight norm (compress/baselines.py)
  taylor        first order: -dL/dg of a gate g = 1 on each head's out_proj input (one backward), summed
  taylor_abs    the same, |dL/dg| per batch summed (Molchanov et al.)
  out_act       mean |y| per channel at the out_proj input (the gated norm's output), L2 over samples and channels
  out_act_w     out_act per channel x that channel's out_proj column norm (Wanda), L2 over the head
  greedy        set-level oracle per layer: heads removed one at a time, the cheapest given those already
                removed re-measured each time, groups kept even; a head's score is how late it goes
Each per-head value ranks the heads through compress.head_loo.loo_scores (the scores file `prune` reads).

    python bench/bench_head_scores.py [--samples 64 --seq-len 256 --eval-tokens 32768] [--write]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from remodel.compress.baselines import weight_scores  # noqa: E402
from remodel.compress.head_loo import HeadMask, head_costs, loo_scores, loss_from  # noqa: E402
from remodel.compress.importance import head_weight, lm_loss_sums, score_model  # noqa: E402
from remodel.compress.prune import plan_keep, prune_model  # noqa: E402
from remodel.models.load import load_model  # noqa: E402
from remodel.models.model import scale_embedding  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus, load_texts, pack  # noqa: E402
from remodel.pipelines.training.evaluate import evaluate  # noqa: E402

MODEL = ROOT / "data" / "embedded"
SECTION = "## Mamba head criteria vs the measured cost (bench/bench_head_scores.py)"
JSON = ROOT / "bench" / "head_scores.json"


def mamba_layers(cfg):
    return [i for i, c in enumerate(cfg.pattern) if c == "M"]


def out_proj_gates(model, fn):
    """Run fn() with a pre-hook on every Mamba out_proj; -> {layer: gate [nh] (requires grad)} and what the hook
    saw: {layer: [sum over batches of (mean |y| per channel over the sequence) ** 2 summed over samples]}."""
    cfg, gates, acc, handles = model.cfg, {}, {}, []
    hd = cfg.mamba.mamba_head_dim
    for i in mamba_layers(cfg):
        gates[i] = torch.ones(cfg.mamba.mamba_num_heads, requires_grad=True)

        def pre(module, args, i=i):
            y = args[0]
            a = y.detach().float().abs().mean(1).square().sum(0)  # [inner]
            acc[i] = acc.get(i, 0) + a
            return (y * gates[i].repeat_interleave(hd).to(y.dtype),)
        handles.append(model.layers[i].mixer.out_proj.register_forward_pre_hook(pre))
    try:
        fn(gates)
    finally:
        for h in handles:
            h.remove()
    return gates, acc


def gate_criteria(model, batches):
    """taylor, taylor_abs, out_act, out_act_w per Mamba layer: one forward and one backward per batch."""
    cfg, W = model.cfg, head_weight(model)
    signed, absolute = {}, {}

    def run(gates):
        for ids in batches:
            with torch.enable_grad():
                h, _ = model.hidden(ids)
                s, n = lm_loss_sums(h, W, ids)
                (s / n).backward()
            for i, g in gates.items():
                signed[i] = signed.get(i, 0) - g.grad.clone()
                absolute[i] = absolute.get(i, 0) + g.grad.abs()
                g.grad = None
    for p in model.parameters():
        p.requires_grad_(False)
    _, acc = out_proj_gates(model, run)
    nh, hd = cfg.mamba.mamba_num_heads, cfg.mamba.mamba_head_dim
    out = {"taylor": signed, "taylor_abs": absolute, "out_act": {}, "out_act_w": {}}
    for i, a in acc.items():
        act = a.sqrt()
        col = model.layers[i].mixer.out_proj.weight.detach().float().norm(dim=0)
        out["out_act"][i] = act.view(nh, hd).norm(dim=1)
        out["out_act_w"][i] = (act * col).view(nh, hd).norm(dim=1)
    return out


@torch.no_grad()
def greedy(model, batches, loo: dict, steps: int):
    """Per layer: `steps` heads removed one by one, each time the one whose removal (with those already removed)
    costs least, among the groups holding the most heads (so every cut keeps the groups even, as prune does; the
    first step is the LOO cost, given in `loo`); -> {layer: score [nh]}: the step a head went, heads never
    removed score highest."""
    cfg, out = model.cfg, {}
    nh, hd, G = cfg.mamba.mamba_num_heads, cfg.mamba.mamba_head_dim, cfg.mamba.n_groups
    r = nh // G
    store = [scale_embedding(cfg, model.embed(ids)) for ids in batches]
    done = 0
    for i in mamba_layers(cfg):
        for j in range(done, i):
            store = [model.layers[j](x, None) for x in store]
        done, gone = i, [int(loo[f"layers.{i}.mamba_heads_loo"].argmin())]
        for _ in range(steps - 1):
            losses, left = {}, [sum(h // r == g and h not in gone for h in range(nh)) for g in range(G)]
            for h in (h for h in range(nh) if h not in gone and left[h // r] == max(left)):  # as prune: even groups
                m = HeadMask(model.layers[i], torch.cat([torch.arange(k * hd, (k + 1) * hd) for k in gone + [h]]))
                try:
                    losses[h] = loss_from(model, i, store, batches, None)
                finally:
                    m.remove()
            gone.append(min(losses, key=losses.get))
        score = torch.full((nh,), float(nh))
        score[gone] = torch.arange(len(gone), dtype=torch.float32)
        out[i] = score
    return out


def spearman(a, b) -> float:
    ra, rb = (t.argsort().argsort().double() for t in (a, b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp(min=1e-30))


def per_head(cfg, scores):
    return {i: scores[f"layers.{i}.mamba_x"].float().norm(dim=1) for i in mamba_layers(cfg)}


def criteria(model, batches, seeds, steps):
    """{name: (scores file dict, {layer: per-head value})} and the seconds each took."""
    cfg, sec = model.cfg, {}
    t = time.time()
    act, _ = score_model(model, batches, loss_increase=False)
    sec["activation"] = time.time() - t
    out = {"activation": act}
    out["magnitude"] = weight_scores(cfg, "magnitude", model.state_dict().items())
    for s in range(seeds):
        out[f"random{s}"] = weight_scores(cfg, "random", seed=s)
    t = time.time()
    costs, _ = head_costs(model, batches)
    sec["loo"] = time.time() - t
    out["loo"] = loo_scores(cfg, act, costs)
    t = time.time()
    extra = gate_criteria(model, batches)
    sec["taylor (all four: one backward)"] = time.time() - t
    t = time.time()
    extra["greedy"] = greedy(model, batches, costs, steps)
    sec["greedy"] = time.time() - t
    for name, v in extra.items():
        out[name] = loo_scores(cfg, act, {f"layers.{i}.mamba_heads_loo": x for i, x in v.items()})
    return out, costs, sec


def run(samples, seq_len, eval_tokens, seeds, batch):
    from transformers import AutoTokenizer

    train, valid = embedded_corpus()
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    calib = pack(load_texts(train), tok, seq_len, max_tokens=samples * seq_len)
    blocks = pack(load_texts(valid), tok, seq_len, max_tokens=eval_tokens)
    model = load_model(MODEL)
    cfg = model.cfg
    batches = list(calib.split(batch))
    G, nh = cfg.mamba.n_groups, cfg.mamba.mamba_num_heads
    cuts = {f"-{int(f * 100)}%": round(nh * (1 - f) / G) * G for f in (0.25, 0.5)}
    methods, costs, sec = criteria(model, batches, seeds, nh - min(cuts.values()))
    base = evaluate(model, blocks, seq_len=seq_len, batch=batch)["ppl"]
    oracle = {i: costs[f"layers.{i}.mamba_heads_loo"] for i in mamba_layers(cfg)}
    rows = {}
    for name, sc in methods.items():
        r = {"ppl": {}, "calib_loss": {}, "spearman": {}}
        for cut, k in cuts.items():
            pruned = prune_model(model, plan_keep(cfg, sc, {"mamba_heads": k}))
            r["ppl"][cut] = evaluate(pruned, blocks, seq_len=seq_len, batch=batch)["ppl"]
            r["calib_loss"][cut] = evaluate(pruned, calib, seq_len=seq_len, batch=batch)["loss"]  # the scored tokens
        ph = per_head(cfg, sc)
        r["spearman"] = {str(i): spearman(ph[i], oracle[i]) for i in oracle}
        rows[name] = r
        print(f"{name:12s} " + " ".join(f"{c} {v:8.2f} ({r['calib_loss'][c]:.4f})" for c, v in r["ppl"].items())
              + "  rho " + " ".join(f"{v:+.2f}" for v in r["spearman"].values()), flush=True)
    return {"unpruned_ppl": base, "cuts": cuts, "calibration_tokens": int(calib.numel()),
            "eval_tokens": int(blocks.numel()), "seeds": seeds, "seconds": {k: round(v, 1) for k, v in sec.items()},
            "oracle_costs": {str(i): c.tolist() for i, c in oracle.items()}, "rows": rows}


def verdict(res) -> dict:
    """{criterion: below magnitude and below every random seed at both cuts}."""
    rows, out = res["rows"], {}
    for name, r in rows.items():
        if name == "magnitude" or name.startswith("random"):
            continue
        out[name] = all(r["ppl"][c] < rows["magnitude"]["ppl"][c] and
                        all(r["ppl"][c] < rows[f"random{s}"]["ppl"][c] for s in range(res["seeds"]))
                        for c in res["cuts"])
    return out


def table(res) -> str:
    cuts, rows = list(res["cuts"]), res["rows"]
    lines = ["| criterion | " + " | ".join(f"ppl {c} ({res['cuts'][c]} heads)" for c in cuts)
             + " | Spearman with loo, layers " + ", ".join(rows["loo"]["spearman"]) + " | mean |",
             "|---|" + "---|" * len(cuts) + "---|---|"]
    rnd = [n for n in rows if n.startswith("random")]
    shown = [n for n in rows if n not in rnd]
    for n in shown:
        rho = list(rows[n]["spearman"].values())
        lines.append(f"| {n} | " + " | ".join(f"{rows[n]['ppl'][c]:.2f}" for c in cuts) + " | "
                     + " ".join(f"{v:+.2f}" for v in rho) + f" | {sum(rho) / len(rho):+.2f} |")
    lo = {c: min(rows[n]["ppl"][c] for n in rnd) for c in cuts}
    hi = {c: max(rows[n]["ppl"][c] for n in rnd) for c in cuts}
    rho = [sum(rows[n]["spearman"].values()) / len(rows[n]["spearman"]) for n in rnd]
    lines.append(f"| random ({len(rnd)} seeds) | " + " | ".join(f"{lo[c]:.2f}-{hi[c]:.2f}" for c in cuts)
                 + f" | | {min(rho):+.2f}..{max(rho):+.2f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64, help="calibration sequences (train split)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens (valid split)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--write", action="store_true",
                    help=f"write bench/{JSON.name} (the RESULTS.md section is written by hand from it)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    res = run(a.samples, a.seq_len, a.eval_tokens, a.seeds, a.batch)
    res["seconds"]["total"] = round(time.time() - t0, 1)
    res["wins"] = verdict(res)
    res["date"] = str(datetime.date.today())
    res["machine"] = f"{platform.machine()}, torch {torch.__version__}, 1 thread"
    print(f"unpruned {res['unpruned_ppl']:.2f}\n{table(res)}\nwins: {res['wins']}\nseconds: {res['seconds']}")
    if a.write:
        JSON.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
