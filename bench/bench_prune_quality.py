"""Pruning quality without retraining: held-out perplexity of the embedded model pruned with
activation importance vs weight magnitude vs random selection (compress/baselines.py).

Activation scores are calibrated on the TRAIN split of the embedded corpus through `pipelines.commands.score`
(whole mode, loss_increase on the first 4 batches); magnitude and random scores come from the same
function (method='magnitude' / 'random'). Every case prunes the unpruned model in memory from those
scores (compress.prune.plan_keep + prune_model, what `remodel prune` writes) and evaluates the VALID
split (pipelines.training.evaluate.evaluate, fixed token count). Depth: activation ranks layers by loss_increase
(the prune default when the scores have it); the cos-based block importance is shown as a second row.

    python bench/bench_prune_quality.py [--samples 1024 --eval-tokens 32768 --seeds 3 --threads 2] [--write]
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

from remodel.compress.prune import plan_keep, prune_model  # noqa: E402
from remodel.compress.scores import load_scores  # noqa: E402
from remodel.models.load import load_model  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus, load_texts, pack  # noqa: E402
from remodel.pipelines.commands.score import score  # noqa: E402
from remodel.pipelines.training.evaluate import evaluate  # noqa: E402

MODEL = ROOT / "data" / "embedded"
SECTION = "## Pruning quality (no retraining)"


def cases(cfg):
    F, H, nh, L = cfg.mlp.intermediate_size, cfg.hidden_size, cfg.mamba.mamba_num_heads, cfg.num_layers
    G = cfg.mamba.n_groups
    heads = lambda frac: round(nh * (1 - frac) / G) * G  # noqa: E731  (a multiple of n_groups)
    return [("FFN -25%", {"ffn_size": F * 3 // 4}), ("FFN -50%", {"ffn_size": F // 2}),
            ("hidden -25%", {"hidden_size": H * 3 // 4}), ("hidden -50%", {"hidden_size": H // 2}),
            ("Mamba heads -25%", {"mamba_heads": heads(0.25)}), ("Mamba heads -50%", {"mamba_heads": heads(0.5)}),
            ("drop 25% of layers", {"num_layers": L - L // 4})]


def ppl(model, scores, targets, blocks, batch):
    pruned = prune_model(model, plan_keep(model.cfg, scores, targets))
    return evaluate(pruned, blocks, seq_len=blocks.shape[1], batch=batch)["ppl"]


def run(samples, seq_len, eval_tokens, seeds, batch, tmp):
    from transformers import AutoTokenizer

    train, valid = embedded_corpus()
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    blocks = pack(load_texts(valid), tok, seq_len, max_tokens=eval_tokens)
    model = load_model(MODEL)
    t0 = time.time()
    rep = score(MODEL, train, tmp / "activation", samples=samples, seq_len=seq_len, batch=batch, mode="whole",
                progress=False)
    calib_s = time.time() - t0
    methods = {"activation": load_scores(tmp / "activation")[0]}
    score(MODEL, None, tmp / "magnitude", method="magnitude")
    methods["magnitude"] = load_scores(tmp / "magnitude")[0]
    for s in range(seeds):
        score(MODEL, None, tmp / f"random{s}", method="random", seed=s)
        methods[f"random{s}"] = load_scores(tmp / f"random{s}")[0]
    base = evaluate(model, blocks, seq_len=seq_len, batch=batch)["ppl"]
    rows = []
    for name, t in cases(model.cfg):
        r = {"case": name, "targets": t}
        for m, sc in methods.items():
            r[m] = ppl(model, sc, t, blocks, batch)
        if "num_layers" in t:  # the activation run's other depth metric: 1 - cos(x_in, x_out)
            cos = {k: v for k, v in methods["activation"].items() if k != "loss_increase"}
            r["activation_block_importance"] = ppl(model, cos, t, blocks, batch)
            L = model.cfg.num_layers
            r["dropped"] = {m: sorted(set(range(L)) - set(plan_keep(model.cfg, sc, t)["layers"].tolist()))
                            for m, sc in [("activation", methods["activation"]), ("activation_block_importance", cos),
                                          ("magnitude", methods["magnitude"])]}
        rnd = [r[f"random{s}"] for s in range(seeds)]
        r["random"] = {"mean": sum(rnd) / len(rnd), "min": min(rnd), "max": max(rnd), "seeds": rnd}
        for s in range(seeds):
            del r[f"random{s}"]
        r["activation_best"] = r["activation"] < r["magnitude"] and r["activation"] < r["random"]["min"]
        rows.append(r)
        print(f"{name:20s} act {r['activation']:9.2f}  mag {r['magnitude']:9.2f}  random {r['random']['mean']:9.2f}"
              f" ({r['random']['min']:.2f}-{r['random']['max']:.2f})", flush=True)
    calib = {"samples": rep["samples"], "seq_len": seq_len, "tokens": rep["tokens"], "seconds": round(calib_s, 1)}
    return {"unpruned_ppl": base, "calibration": calib,
            "eval_tokens": int(blocks.numel()), "seeds": seeds, "rows": rows}


def table(res) -> str:
    lines = ["| case | target | activation | magnitude | random mean (min-max, %d seeds) | activation best? |"
             % res["seeds"], "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        (k, v), = r["targets"].items()
        act = f"{r['activation']:.2f}"
        if "activation_block_importance" in r:
            act += f" (loss_increase; 1-cos: {r['activation_block_importance']:.2f})"
        rnd = r["random"]
        best = "yes" if r["activation_best"] else (
            "no: " + ", ".join(x for x, worse in (("magnitude", r["magnitude"] <= r["activation"]),
                                                   ("random", rnd["min"] <= r["activation"])) if worse) + " lower")
        lines.append(f"| {r['case']} | `{k}={v}` | {act} | {r['magnitude']:.2f} | {rnd['mean']:.2f} "
                     f"({rnd['min']:.2f}-{rnd['max']:.2f}) | {best} |")
    return "\n".join(lines)


def write_section(text: str, path=ROOT / "bench" / "RESULTS.md"):
    """Replace this bench's section of RESULTS.md (or append it), leaving the others as they are."""
    old = path.read_text() if path.exists() else ""
    start = old.find(SECTION)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + len(SECTION))
        new = old[:start] + text + (old[end + 1:] if end >= 0 else "")
    path.write_text(new.rstrip("\n") + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1024,
                    help="calibration sequences (train split); `remodel score`'s default")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens (valid split)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write", action="store_true", help=f"put the table into bench/RESULTS.md ({SECTION})")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        res = run(a.samples, a.seq_len, a.eval_tokens, a.seeds, a.batch, Path(tmp))
    res["seconds"] = round(time.time() - t0, 1)
    tab = table(res)
    print(f"\nunpruned held-out ppl {res['unpruned_ppl']:.2f}\n{tab}\n")
    print(json.dumps(res, indent=1))
    if a.write:
        c = res["calibration"]
        head = (f"{SECTION}\n\nbench/bench_prune_quality.py, {datetime.date.today()}, {platform.machine()} "
                f"{a.threads} thread(s) on a 2-core CPU shared with other jobs, torch {torch.__version__}, fp32. "
                f"Model: data/embedded (`M-M*M-M-`, hidden 256, FFN 768, 8 Mamba heads x 32 in 2 groups, 3.36M "
                f"params). Activation scores from {c['samples']} x {c['seq_len']} train-split tokens "
                f"(`remodel score` defaults otherwise: mean |X| over sequence, L2 over samples, FFN and "
                f"Mamba-head units times the L2 norm of the down_proj / out_proj column they feed; depth by "
                f"loss_increase on 4 batches); magnitude and random (seeds 0..{a.seeds - 1}) from "
                f"`score(..., method=...)`. Held-out perplexity on the first {res['eval_tokens']:,} valid-split "
                f"tokens (seq {a.seq_len}), no retraining; unpruned **{res['unpruned_ppl']:.2f}**. Mamba heads "
                f"are pruned group-aware (the same count kept in each of the 2 groups). Total run "
                f"{res['seconds']:.0f} s.\n\n")
        dropped = [r for r in res["rows"] if "dropped" in r]
        tail = "".join(f"\nLayers dropped ({r['case']}): " + "; ".join(f"{m} {v}" for m, v in r["dropped"].items())
                       + ".\n" for r in dropped)
        worse = [r["case"] for r in res["rows"] if not r["activation_best"]]
        verdict = (f"\nActivation importance gives the lowest perplexity (below magnitude and below every random seed) "
                   f"in {len(res['rows']) - len(worse)} of {len(res['rows'])} cases"
                   + (f"; **not** in: {', '.join(worse)} (see the table: there it lies within the spread of the "
                      f"random seeds and/or above magnitude).\n" if worse else ".\n"))
        write_section(head + tab + "\n" + verdict + tail)


if __name__ == "__main__":
    main()
