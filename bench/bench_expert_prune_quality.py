"""Expert pruning quality without retraining, on the shipped trained MoE (data/embedded_moe, 8 routed
experts per MoE layer, top-4): held-out perplexity after pruning with the routed expert rankings
(routed-output reconstruction, the default; the per-expert routed-contribution sum) vs frequency-only vs
random (compress/expert_scores.py rank_experts).

One activation calibration run (compress.importance.score_model) on the TRAIN split gives every score;
each method only changes the expert ranking (`layers.i.experts`), so the cases differ in nothing else.
Cases: experts 8 -> 6, 8 -> 4 (ranked by the method), and expert FFN -50% (moe_intermediate_size / 2:
channels by their router-weighted contribution for both routed methods, by plain activation over routed
tokens for frequency, random = compress.baselines.random_scores channels), plus experts 8 -> 6 with
expert FFN -50% together. Held-out: the VALID split, fixed token count (pipelines.training.evaluate.evaluate).

    python bench/bench_expert_prune_quality.py [--samples 256 --eval-tokens 32768 --threads 1] [--write]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from remodel.compress.baselines import random_scores  # noqa: E402
from remodel.compress.expert_scores import rank_experts  # noqa: E402
from remodel.compress.importance import score_model  # noqa: E402
from remodel.compress.prune import plan_keep, prune_model  # noqa: E402
from remodel.models.load import load_model  # noqa: E402
from remodel.pipelines.data.data import batches, embedded_corpus, embedded_moe_path, load_texts, pack  # noqa: E402
from remodel.pipelines.training.evaluate import evaluate  # noqa: E402

SECTION = "## Expert pruning quality (no retraining)"
METHODS = ("reconstruction", "contribution", "frequency")


def cases(cfg):
    E, F = cfg.n_routed_experts, cfg.moe_intermediate_size
    return [(f"experts {E} -> {E * 3 // 4}", {"experts": E * 3 // 4}),
            (f"experts {E} -> {E // 2}", {"experts": E // 2}),
            ("expert FFN -50%", {"expert_ffn_size": F // 2}),
            (f"experts {E} -> {E * 3 // 4} + expert FFN -50%", {"experts": E * 3 // 4, "expert_ffn_size": F // 2})]


def compare(model_dir, samples=256, seq_len=256, eval_tokens=32768, seeds=3, batch=16):
    """{unpruned_ppl, calib_tokens, eval_tokens, rows: [{case, targets, contribution, frequency, random: [..]}]}"""
    from transformers import AutoTokenizer

    train, valid = embedded_corpus()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    calib = pack(load_texts(train), tok, seq_len, max_tokens=samples * seq_len)
    held_out = pack(load_texts(valid), tok, seq_len, max_tokens=eval_tokens)
    model = load_model(model_dir).float().eval()
    cfg = model.cfg
    with torch.no_grad():
        act, _ = score_model(model, list(batches(calib, 8)), loss_increase=True, loss_batches=1)

    def ppl(scores, targets):
        pruned = prune_model(model, plan_keep(cfg, scores, targets))
        return evaluate(pruned, held_out, seq_len=seq_len, batch=batch)["ppl"]

    ranked = {m: rank_experts(act, cfg, m) for m in METHODS}
    rows = []
    for name, t in cases(cfg):
        r = {"case": name, "targets": t}
        for m in METHODS:
            r[m] = ppl(ranked[m], t)
        rnd = []
        for s in range(seeds):
            sc = rank_experts(act, cfg, "random", seed=s)
            if "expert_ffn_size" in t:  # random channels too (the expert ranking alone leaves them as act)
                rs = random_scores(cfg, s)
                sc.update({k: v for k, v in rs.items() if k.endswith("expert_ffn")})
            rnd.append(ppl(sc, t))
        r["random"] = rnd
        r["random_mean"] = sum(rnd) / len(rnd)
        r["routed_best"] = r["reconstruction"] < r["frequency"] and r["reconstruction"] < r["random_mean"]
        rows.append(r)
        print(f"{name:36s} " + "  ".join(f"{m} {r[m]:8.2f}" for m in METHODS)
              + f"  random mean {r['random_mean']:8.2f} {['%.2f' % x for x in rnd]}", flush=True)
    base = evaluate(model, held_out, seq_len=seq_len, batch=batch)["ppl"]
    return {"unpruned_ppl": base, "calib_tokens": int(calib.numel()), "eval_tokens": int(held_out.numel()),
            "seeds": seeds, "rows": rows}


def write_section(text: str, path=ROOT / "bench" / "RESULTS.md"):
    """Replace this bench's section of RESULTS.md (or append it), leaving the others as they are."""
    old = path.read_text() if path.exists() else ""
    start = old.find(SECTION)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + len(SECTION))
        new = old[:start] + text + ("\n" + old[end + 1:] if end >= 0 else "")
    path.write_text(new.rstrip("\n") + "\n")


def table(res) -> str:
    lines = ["| case | target | reconstruction | contribution (sum) | frequency | random mean (%d seeds: values) | "
             "reconstruction lowest? |" % res["seeds"], "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        tgt = ", ".join(f"`{k}={v}`" for k, v in r["targets"].items())
        lost = [x for x, worse in (("frequency", r["frequency"] <= r["reconstruction"]),
                                   ("random mean", r["random_mean"] <= r["reconstruction"])) if worse]
        best = "yes" if r["routed_best"] else "no: " + ", ".join(lost) + " not higher"
        lines.append(f"| {r['case']} | {tgt} | {r['reconstruction']:.2f} | {r['contribution']:.2f} | {r['frequency']:.2f} "
                     f"| {r['random_mean']:.2f} ({', '.join('%.2f' % x for x in r['random'])}) | {best} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(embedded_moe_path()))
    ap.add_argument("--samples", type=int, default=256, help="calibration sequences (train split)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens (valid split)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write", action="store_true", help=f"put the table into bench/RESULTS.md ({SECTION})")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.time()
    res = compare(Path(a.model), a.samples, a.seq_len, a.eval_tokens, a.seeds)
    res["seconds"] = round(time.time() - t0, 1)
    tab = table(res)
    print(f"\nunpruned held-out ppl {res['unpruned_ppl']:.2f}\n{tab}\n")
    print(json.dumps(res, indent=1))
    if a.write:
        write_section(section(a, res, tab))


def section(a, res, tab) -> str:
    """This bench's RESULTS.md section from the arguments and the result of one run."""
    model = Path(a.model).resolve()
    model = model.relative_to(ROOT) if model.is_relative_to(ROOT) else a.model
    head = (f"{SECTION}\n\n`python bench/bench_expert_prune_quality.py --samples {a.samples} --eval-tokens "
            f"{a.eval_tokens} --write`, {datetime.date.today()}, {platform.machine()} {a.threads} thread(s) on a "
            f"2-core CPU shared with other jobs, torch {torch.__version__}, fp32. Model: {model} (the shipped "
            f"trained MoE, 8 routed experts per MoE layer, top-4, upcycled: experts come in near-duplicate "
            f"pairs). One activation calibration run on {res['calib_tokens']:,} train-split tokens; the methods "
            f"differ only in the ranking (compress/expert_scores.py rank_experts). *reconstruction* (the default): "
            f"greedy elimination of the experts whose removal, their tokens re-routed as the pruned router does, "
            f"moves the layer's routed output least (compress/expert_select.py); *contribution*: sum over tokens "
            f"of router weight x ||expert output||, each expert alone; *frequency*: routed-token count; random "
            f"seeds 0..{a.seeds - 1}. Expert FFN channels: router-weighted contribution (|w h| x ||down_proj "
            f"column||) for the two routed methods, plain activation over routed tokens for frequency, random for "
            f"the random rows. Held-out perplexity on the first {res['eval_tokens']:,} valid-split tokens (seq "
            f"{a.seq_len}), no retraining; unpruned **{res['unpruned_ppl']:.2f}**. Total run {res['seconds']:.0f} s. "
            f"Checked by tests/test_expert_prune_quality.py (64 x 256 calibration, 16,384 held-out tokens).\n\n")
    worse = [r["case"] for r in res["rows"] if not r["routed_best"]]
    verdict = (f"\nRouted-output reconstruction gives a lower perplexity than frequency and than the random mean "
               f"in {len(res['rows']) - len(worse)} of {len(res['rows'])} cases"
               + (f"; **not** in: {', '.join(worse)}.\n" if worse else ".\n"))
    return head + tab + "\n" + verdict


if __name__ == "__main__":
    main()
