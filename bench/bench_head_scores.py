"""Head criteria vs what a head costs (issue 55): held-out quality with 25% and 50% of the recurrent mixers' heads
removed (no retraining), each head criterion against magnitude, 5 random seeds and the measured oracle, plus each
criterion's per-layer Spearman rank correlation with the oracle and the pruned model's loss on the calibration
tokens themselves (`calib_loss`: the loss the oracle measures; a criterion that wins there but not held out is
fitted to the calibration set).

Three models: `--model embedded` (data/embedded: its Mamba heads, 25% and 50% removed), `--model nemotron_h` (a
Nemotron-H-shaped model trained here from scratch: data/embedded's layout with 3 Mamba layers of 16 heads in 4
groups; heads 16 -> 12 and 16 -> 8) and `--model gdn` (a
Qwen3.5-shaped model trained here from scratch on the train split: 3 Gated DeltaNet + 1 attention layers, 4 key x
8 value heads; value heads 8 -> 4 (25% is no valid count: value heads come in whole key-head groups), key-head
groups 4 -> 3 and 4 -> 2 with their value heads).

Oracle (`loo`): every unit removed alone (as pruning removes it: compress/head_loo.py), its calibration loss
increase. Candidates, all on the same calibration tokens (train split):
  activation_measured  the default since 2026-12-06 (compress/head_loo.measured_scores): activation, with GDN
                key-head groups ranked by their loo cost on the first 4 calibration batches (on Mamba: activation)
  activation    the default before (score_model). In the stored JSON, measured before the switch, Mamba heads were read
                at the in_proj x segment (now `score --method activation_in`); since, at out_proj's input (out_act_w,
                as GDN already was)
  activation_in that former site (score_model(in_sites=True); on GDN the same as activation)
  magnitude     the head's weight norms (compress/baselines.py)
  taylor, taylor_abs, out_act, out_act_w, fisher, taylor2, fisher_act   compress/head_criteria.py (a gate per
                sequence on out_proj's input, one backward per batch)
  greedy        set-level oracle per layer: units removed one at a time, the cheapest given those already removed
                re-measured each time, groups kept even; a unit's score is how late it goes
Held-out oracle (a cheating bound, not a criterion): `loo_heldout` and `greedy_heldout`, the same measured on the
held-out tokens the table reports: what ranking heads by their own held-out cost (resp. a greedy set choice) gets
there. Where costs do not add (half a Mamba group removed) it is no bound: bench/bench_head_sets.py enumerates
the sets.
`spearman` is with the calibration loo, `spearman_heldout` with the held-out one.
Each per-unit value ranks the heads through compress.head_loo.loo_scores (the scores file `prune` reads).

After distillation (`--distill-steps K`, issue 55's "before and after a short distillation"): each pruned model of
the criteria in --distill-criteria (default: the default, magnitude and every random seed) is distilled K steps
from the unpruned model on the train split (pipelines.training.train, as bench_expert_prune_quality.py's
`criteria` mode; same data, lr and seed for every criterion), then its held-out loss; --no-oracle skips the oracle
and the gate criteria (their before-distillation figures are in the default run). Written to
bench/head_scores[_gdn|_nemotron_h]_distill.json.

`--distill-criteria loo,greedy,fisher,...,greedy_heldout --tag _criteria` distils the other rows too (results for
every criterion: bench/results/head_criteria_*.md; bench/head_distill_report.py joins the two JSONs); `--trained
DIR` reuses the scratch model an earlier run trained with the same flags.

    python bench/bench_head_scores.py [--model embedded|gdn|nemotron_h] [--samples 64 --seq-len 256
        --eval-tokens 32768] [--distill-steps 40 --no-oracle] [--trained DIR] [--tag SUFFIX] [--write]
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
from remodel.compress.head_criteria import gate_criteria, spearman, unit_values as per_unit  # noqa: E402
from remodel.compress.head_loo import HeadMask, head_costs, loo_scores, loo_units, loss_from, measured_scores  # noqa: E402
from remodel.compress.importance import score_model  # noqa: E402
from remodel.compress.prune import plan_keep, prune_model  # noqa: E402
from remodel.models.load import load_model  # noqa: E402
from remodel.models.trunk import start  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus, load_texts, pack  # noqa: E402
from remodel.pipelines.training.evaluate import evaluate  # noqa: E402

MODEL = ROOT / "data" / "embedded"
JSON = {"embedded": ROOT / "bench" / "head_scores.json", "gdn": ROOT / "bench" / "head_scores_gdn.json",
        "nemotron_h": ROOT / "bench" / "head_scores_nemotron_h.json"}
SHORT = {"mamba_heads_loo": "h", "lin_v_heads_loo": "v", "lin_k_heads_loo": "k"}
GDN_HF = dict(model_type="qwen3_5_text", vocab_size=2048, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
              linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"])


NEMOTRON_HF = dict(mamba_num_heads=16, n_groups=4, ssm_state_size=16, num_attention_heads=4, num_key_value_heads=2,
                   layers_block_type=["linear_attention", "mlp"] * 2 + ["full_attention", "mlp"]
                   + ["linear_attention", "mlp"])  # over data/embedded's config: 3 Mamba layers, 16 heads each


def scratch_hf(kind: str, hidden: int) -> dict:
    """The HF config of the model --model `kind` trains: Qwen3.5-shaped GDN (key/value head dim hidden / 8) or
    Nemotron-H-shaped (data/embedded's config with NEMOTRON_HF: 16 Mamba heads of dim hidden / 8, 4 groups)."""
    if kind == "gdn":
        return dict(GDN_HF, hidden_size=hidden, intermediate_size=2 * hidden, linear_key_head_dim=hidden // 8,
                    linear_value_head_dim=hidden // 8)
    base = json.loads((MODEL / "config.json").read_text())
    return dict(base, **NEMOTRON_HF, hidden_size=hidden, intermediate_size=3 * hidden, mamba_head_dim=hidden // 8,
                head_dim=hidden // 4)


def scratch(root: Path, kind: str, steps: int, hidden: int, seq_len: int = 128, batch: int = 8) -> Path:
    """ROOT/scratch-trained: the model scratch_hf(kind, hidden) describes, trained from random weights on the
    train split."""
    from remodel.models.hf import config_from_hf
    from remodel.models.load import save_model
    from remodel.models.model import HybridLM, init_weights
    from remodel.pipelines.data.data import embedded_tokenizer_path
    from remodel.pipelines.training.train import train

    hf = scratch_hf(kind, hidden)
    init = save_model(init_weights(HybridLM(config_from_hf(hf)), std=0.02, seed=0), root / "scratch",
                      family=hf["model_type"], aux_from=embedded_tokenizer_path())
    train(init, root / "scratch-trained", embedded_corpus()[0], steps=steps, seq_len=seq_len, batch=batch,
          lr=3e-3, seed=0, log_every=0, checkpoint_every=10**9, keep_last=1)
    return root / "scratch-trained"


def unit_groups(cfg, name: str) -> int:
    """How many equal groups prune keeps even among a layer's units of `name` (Mamba heads: n_groups; GDN value
    heads: one group per key head; key-head groups: free)."""
    if name == "mamba_heads_loo":
        return cfg.mamba.n_groups
    return cfg.gated_deltanet.linear_num_key_heads if name == "lin_v_heads_loo" else 1


def cuts(cfg) -> dict:
    """{label: prune targets}: 25% and 50% of the units removed (GDN: value heads 50%, key-head groups 25/50%)."""
    names = {n for _, n, _ in loo_units(cfg)}
    if "mamba_heads_loo" in names:
        G, nh = cfg.mamba.n_groups, cfg.mamba.mamba_num_heads
        return {f"-{int(f * 100)}%": {"mamba_heads": round(nh * (1 - f) / G) * G} for f in (0.25, 0.5)}
    hk, hv = cfg.gated_deltanet.linear_num_key_heads, cfg.gated_deltanet.linear_num_value_heads
    return {"value -50%": {"linear_value_heads": hv // 2}, "key -25%": {"linear_key_heads": hk - hk // 4},
            "key -50%": {"linear_key_heads": hk // 2}}


UNIT = {"mamba_heads": "mamba_heads_loo", "linear_value_heads": "lin_v_heads_loo", "linear_key_heads": "lin_k_heads_loo"}


def greedy_steps(cfg) -> dict:
    """{unit name: how many units greedy removes per layer}: the most any cut removes."""
    count, out = {name: len(chans) for _, name, chans in loo_units(cfg)}, {}
    for t in cuts(cfg).values():
        for k, v in t.items():
            out[UNIT[k]] = max(out.get(UNIT[k], 1), count[UNIT[k]] - v)
    return out


@torch.no_grad()
def greedy(model, batches, loo: dict, steps: dict):
    """Per layer and unit kind: `steps[name]` units removed one by one, each time the one whose removal (with those
    already removed) costs least, among the groups holding the most units (every cut keeps the groups even, as
    prune does; the first step is the LOO cost, given in `loo`); -> {`layers.i.<name>`: the step a unit went,
    units never removed score highest}."""
    cfg, out, done = model.cfg, {}, 0
    store = [start(cfg, model.embed(ids)) for ids in batches]
    for i, name, chans in loo_units(cfg):
        for j in range(done, i):
            store = [model.layers[j](x, None) for x in store]
        done, key = i, f"layers.{i}.{name}"
        n, G = len(chans), unit_groups(cfg, name)
        r, gone = n // G, [int(loo[key].argmin())]
        for _ in range(steps.get(name, 1) - 1):
            losses, left = {}, [sum(h // r == g and h not in gone for h in range(n)) for g in range(G)]
            for h in (h for h in range(n) if h not in gone and left[h // r] == max(left)):
                m = HeadMask(model.layers[i], torch.cat([chans[k] for k in gone + [h]]))
                try:
                    losses[h] = loss_from(model, i, store, batches, None)
                finally:
                    m.remove()
            gone.append(min(losses, key=losses.get))
        score = torch.full((n,), float(n))
        score[gone] = torch.arange(len(gone), dtype=torch.float32)
        out[key] = score
    return out


def criteria(model, batches, seeds, held, oracle=True):
    """{name: (scores file dict, {unit key: per-unit value})}, the LOO costs and the seconds each took (without
    `oracle`: activation, magnitude and random only, no costs)."""
    cfg, sec, out = model.cfg, {}, {}
    t = time.time()
    act, _ = score_model(model, batches, loss_increase=False)
    sec["activation"] = time.time() - t
    t = time.time()
    measured = measured_scores(model, act, batches)  # the default: key-head groups by their cost on the loss batches
    sec["activation_measured (key groups' loo on the loss batches)"] = time.time() - t
    plain = {"activation_measured": measured, "activation": act,
             "magnitude": weight_scores(cfg, "magnitude", model.state_dict().items())}
    plain.update({f"random{s}": weight_scores(cfg, "random", seed=s) for s in range(seeds)})
    out = {k: (v, per_unit(cfg, v)) for k, v in plain.items()}
    if not oracle:
        return out, {}, {}, sec
    inn, _ = score_model(model, batches, loss_increase=False, in_sites=True)  # the kinds' former default sites
    out["activation_in"] = (inn, per_unit(cfg, inn))
    t = time.time()
    costs, _ = head_costs(model, batches)
    sec["loo"] = time.time() - t
    t = time.time()
    extra = {"loo": costs, **gate_criteria(model, batches)}
    sec["gate criteria (seven: one backward)"] = time.time() - t
    t = time.time()
    extra["greedy"] = greedy(model, batches, costs, greedy_steps(cfg))
    sec["greedy"] = time.time() - t
    t = time.time()
    held_costs, _ = head_costs(model, held)
    extra["loo_heldout"] = held_costs
    extra["greedy_heldout"] = greedy(model, held, held_costs, greedy_steps(cfg))
    sec["held-out oracle (loo + greedy)"] = time.time() - t
    out.update({name: (loo_scores(cfg, act, v), v) for name, v in extra.items()})
    return out, costs, held_costs, sec


def prune_rows(model, methods, costs, held_costs, calib, blocks, a) -> dict:
    """{criterion: held-out loss / ppl and calibration loss at every cut, Spearman with the oracles}."""
    cfg, rows = model.cfg, {}
    for name, (sc, value) in methods.items():
        r = {"loss": {}, "ppl": {}, "calib_loss": {}}
        for cut, t in cuts(cfg).items():
            pruned = prune_model(model, plan_keep(cfg, sc, t))
            ev = evaluate(pruned, blocks, seq_len=a.seq_len, batch=a.batch)
            r["loss"][cut], r["ppl"][cut] = ev["loss"], ev["ppl"]
            r["calib_loss"][cut] = evaluate(pruned, calib, seq_len=a.seq_len, batch=a.batch)["loss"]  # scored tokens
        r["spearman"] = {f"{k.split('.')[1]}{SHORT[k.split('.')[2]]}": spearman(value[k], costs[k]) for k in costs}
        r["spearman_heldout"] = {f"{k.split('.')[1]}{SHORT[k.split('.')[2]]}": spearman(value[k], held_costs[k])
                                 for k in held_costs}
        rows[name] = r
        print(f"{name:12s} " + " ".join(f"{c} {v:.4f} ({r['calib_loss'][c]:.4f})" for c, v in r["loss"].items())
              + "  rho " + " ".join(f"{v:+.2f}" for v in r["spearman"].values()), flush=True)
    return rows


def distill_rows(model_dir, model, methods, rows, blocks, a) -> None:
    """rows[name]["distilled"] = {cut: held-out loss after a.distill_steps steps of distillation from model_dir},
    for the criteria a.distill_criteria names ("random": every seed); the same data, lr and seed for each."""
    from remodel.models.load import save_model
    from remodel.pipelines.training.train import train

    cfg, family = model.cfg, json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    wanted, done = a.distill_criteria.split(","), {}
    for name, (sc, _) in methods.items():
        if name not in wanted and not ("random" in wanted and name.startswith("random")):
            continue
        rows[name]["distilled"] = {}
        for cut, t in cuts(cfg).items():
            keep = plan_keep(cfg, sc, t)
            key = repr({k: v.tolist() for k, v in keep.items()})  # criteria keeping the same units give the same pruned model: distilled once
            if key in done:
                rows[name]["distilled"][cut] = done[key]
                continue
            with tempfile.TemporaryDirectory() as tmp:
                d = save_model(prune_model(model, keep), Path(tmp) / "pruned", family=family,
                               aux_from=model_dir, dtype=torch.float32)
                train(d, Path(tmp) / "kd", embedded_corpus()[0], teacher_dir=model_dir, steps=a.distill_steps,
                      seq_len=a.distill_seq_len, batch=a.distill_batch, lr=a.distill_lr, seed=a.distill_seed,
                      log_every=0, checkpoint_every=10**9, keep_last=1)
                kd = load_model(Path(tmp) / "kd").float().eval()
                rows[name]["distilled"][cut] = evaluate(kd, blocks, seq_len=a.seq_len, batch=a.batch)["loss"]
                done[key] = rows[name]["distilled"][cut]
        print(f"{name:12s} distilled " + " ".join(f"{c} {rows[name]['loss'][c]:.4f} -> {v:.4f}"
                                                  for c, v in rows[name]["distilled"].items()), flush=True)


def run(model_dir, a):
    from transformers import AutoTokenizer

    train, valid = embedded_corpus()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    calib = pack(load_texts(train), tok, a.seq_len, max_tokens=a.samples * a.seq_len)
    blocks = pack(load_texts(valid), tok, a.seq_len, max_tokens=a.eval_tokens)
    model = load_model(model_dir).float().eval()
    methods, costs, held_costs, sec = criteria(model, list(calib.split(a.batch)), a.seeds,
                                               list(blocks.split(a.batch)), oracle=not a.no_oracle)
    base = evaluate(model, blocks, seq_len=a.seq_len, batch=a.batch)
    rows = prune_rows(model, methods, costs, held_costs, calib, blocks, a)
    if a.distill_steps:
        t = time.time()
        distill_rows(model_dir, model, methods, rows, blocks, a)
        sec["distillation"] = time.time() - t
    return {"model": str(model_dir), "unpruned_loss": base["loss"], "unpruned_ppl": base["ppl"],
            "cuts": cuts(model.cfg), "calibration_tokens": int(calib.numel()), "eval_tokens": int(blocks.numel()),
            "seeds": a.seeds, "seconds": {k: round(v, 1) for k, v in sec.items()},
            "oracle_costs": {k: c.tolist() for k, c in costs.items()},
            "oracle_costs_heldout": {k: c.tolist() for k, c in held_costs.items()}, "rows": rows}


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def verdict(res) -> dict:
    """{criterion: {wins: below magnitude and every random seed at every cut, mean_loss, mean_rho,
    beats_magnitude: mean loss below magnitude's and mean Spearman above it}} (not for magnitude and random)."""
    rows, out = res["rows"], {}
    mag = rows["magnitude"]
    for name, r in rows.items():
        if name == "magnitude" or name.startswith("random") or name.endswith("_heldout"):
            continue
        wins = all(r["loss"][c] < mag["loss"][c] and all(r["loss"][c] < rows[f"random{s}"]["loss"][c]
                                                         for s in range(res["seeds"])) for c in res["cuts"])
        ml, mr = mean(r["loss"].values()), mean(r["spearman"].values())
        out[name] = {"wins": wins, "mean_loss": ml, "mean_rho": mr,
                     "mean_rho_heldout": mean(r["spearman_heldout"].values()),
                     "beats_magnitude": ml < mean(mag["loss"].values()) and mr > mean(mag["spearman"].values())}
    return out


def table(res, metric="loss") -> str:
    cuts_, rows = list(res["cuts"]), res["rows"]
    fmt = (lambda v: f"{v:.4f}") if metric == "loss" else (lambda v: f"{v:.2f}")
    lines = [f"| criterion | " + " | ".join(f"{metric} {c}" for c in cuts_)
             + " | Spearman with loo (" + " ".join(rows["loo"]["spearman"]) + ") | mean rho | rho held-out loo |",
             "|---|" + "---|" * len(cuts_) + "---|---|---|"]
    rnd = [n for n in rows if n.startswith("random")]
    for n in (n for n in rows if n not in rnd):
        rho = list(rows[n]["spearman"].values())
        lines.append(f"| {n} | " + " | ".join(fmt(rows[n][metric][c]) for c in cuts_) + " | "
                     + " ".join(f"{v:+.2f}" for v in rho) + f" | {mean(rho):+.2f} | "
                     + f"{mean(rows[n]['spearman_heldout'].values()):+.2f} |")
    lo = {c: min(rows[n][metric][c] for n in rnd) for c in cuts_}
    hi = {c: max(rows[n][metric][c] for n in rnd) for c in cuts_}
    rho = [mean(rows[n]["spearman"].values()) for n in rnd]
    lines.append(f"| random ({len(rnd)} seeds) | " + " | ".join(f"{fmt(lo[c])}-{fmt(hi[c])}" for c in cuts_)
                 + f" | | {min(rho):+.2f}..{max(rho):+.2f} | |")
    return "\n".join(lines)


def distill_verdict(res, default="activation") -> dict:  # the JSONs on record distilled activation
    """{cut: {when: {default, magnitude, random min/max/spread, below_magnitude, below_every_seed}}}, when =
    before / after the distillation, for the criteria that were distilled; `spread_after/before`: how much of the
    random seeds' spread is left."""
    rows, out = res["rows"], {}
    rnd = [n for n in rows if n.startswith("random")]
    for c in res["cuts"]:
        cell = {}
        for when, key in (("before", "loss"), ("after", "distilled")):
            seeds = [rows[n][key][c] for n in rnd]
            d, m = rows[default][key][c], rows["magnitude"][key][c]
            cell[when] = {"default": d, "magnitude": m, "random_min": min(seeds), "random_max": max(seeds),
                          "random_mean": mean(seeds), "spread": max(seeds) - min(seeds),
                          "below_magnitude": d < m, "below_every_seed": d < min(seeds)}
        cell["spread_after/before"] = cell["after"]["spread"] / cell["before"]["spread"]
        out[c] = cell
    return out


def distill_table(res) -> str:
    """Held-out loss before -> after the distillation per cut: every distilled criterion, the seeds' range."""
    cuts_, rows = list(res["cuts"]), res["rows"]
    done = [n for n in rows if "distilled" in rows[n]]
    rnd = [n for n in done if n.startswith("random")]
    lines = ["| criterion | " + " | ".join(f"loss {c} before -> after" for c in cuts_) + " |",
             "|---|" + "---|" * len(cuts_)]
    for n in (n for n in done if n not in rnd):
        lines.append(f"| {n} | " + " | ".join(f"{rows[n]['loss'][c]:.4f} -> {rows[n]['distilled'][c]:.4f}"
                                               for c in cuts_) + " |")
    rng = lambda key, c: f"{min(rows[n][key][c] for n in rnd):.4f}-{max(rows[n][key][c] for n in rnd):.4f}"
    lines.append(f"| random ({len(rnd)} seeds) | " + " | ".join(f"{rng('loss', c)} -> {rng('distilled', c)}"
                                                              for c in cuts_) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=tuple(JSON), default="embedded",
                    help="data/embedded's Mamba heads, or a Qwen3.5-shaped GDN / Nemotron-H-shaped Mamba model "
                         "trained here first")
    ap.add_argument("--samples", type=int, default=64, help="calibration sequences (train split)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens (valid split)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128, help="--model gdn / nemotron_h: hidden size")
    ap.add_argument("--train-steps", type=int, default=300, help="--model gdn / nemotron_h: training steps (8 x 128 tokens)")
    ap.add_argument("--distill-steps", type=int, default=0,
                    help="distil each pruned model this many steps from the unpruned one (0: none)")
    ap.add_argument("--distill-criteria", default="activation,magnitude,random",
                    help="comma list of the criteria whose pruned models are distilled (random: every seed)")
    ap.add_argument("--distill-batch", type=int, default=4)
    ap.add_argument("--distill-seq-len", type=int, default=256)
    ap.add_argument("--distill-lr", type=float, default=3e-4)
    ap.add_argument("--distill-seed", type=int, default=0, help="the distillation's seed (data order), 0 in the JSON")
    ap.add_argument("--trained", help="--model gdn / nemotron_h: a model an earlier run trained (same flags), "
                    "instead of training it again")
    ap.add_argument("--tag", default="", help="suffix of the JSON name (e.g. _criteria), to keep an earlier one")
    ap.add_argument("--no-oracle", action="store_true",
                    help="activation, magnitude and random only: no loo, gate criteria, greedy or Spearman")
    ap.add_argument("--write", action="store_true", help="write bench/head_scores[_gdn|_nemotron_h][_distill].json "
                    "(RESULTS.md by hand)")
    a = ap.parse_args()
    if a.distill_steps < 0:
        ap.error(f"--distill-steps must be >= 0, got {a.distill_steps}")
    if a.trained and not (Path(a.trained) / "config.json").is_file():
        ap.error(f"--trained {a.trained}: no config.json there")
    torch.set_num_threads(1)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        if a.trained:
            model_dir, train_s = Path(a.trained), 0.0
        elif a.model != "embedded":
            model_dir = scratch(Path(tmp), a.model, a.train_steps, a.hidden)
            train_s = round(time.time() - t0, 1)
        else:
            model_dir, train_s = MODEL, 0.0
        res = run(model_dir, a)
    res["seconds"].update(train=train_s, total=round(time.time() - t0, 1))
    res["wins"] = {} if a.no_oracle else verdict(res)
    if a.distill_steps and "distilled" in res["rows"]["activation"]:
        res["distilled"] = distill_verdict(res)
    res["date"] = str(datetime.date.today())
    res["machine"] = f"{platform.machine()}, torch {torch.__version__}, 1 thread"
    res["settings"] = vars(a)
    metric = "ppl" if a.model == "embedded" else "loss"
    print(f"unpruned loss {res['unpruned_loss']:.4f} ppl {res['unpruned_ppl']:.2f}")
    if not a.no_oracle:
        print(f"{table(res, metric)}\nverdict: {json.dumps(res['wins'], indent=None)}")
    if "distilled" in res:
        print(f"{distill_table(res)}\ndistilled: {json.dumps(res['distilled'], indent=None)}")
    print(f"seconds: {res['seconds']}")
    if a.write:
        out_path(a).write_text(json.dumps(res, indent=1) + "\n")


def out_path(a) -> Path:
    """bench/head_scores[_gdn|_nemotron_h][_distill[_seedS]][TAG].json."""
    tail = "_distill" + (f"_seed{a.distill_seed}" if a.distill_seed else "") if a.distill_steps else ""
    return JSON[a.model].with_name(JSON[a.model].stem + tail + a.tag + ".json")


if __name__ == "__main__":
    main()
