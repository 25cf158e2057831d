"""Exhaustive held-out bounds for recurrent-mixer heads (issue 55): every admissible set of heads measured on the
held-out tokens, ranked, and each criterion's own set placed in that ranking. Its minimum is the best any criterion
could do.

`--model embedded` (Mamba heads): every group-even set of one layer's heads removed, the rest of the model pruned as
magnitude prunes it (data/embedded: layer 0 holds all the cost; the other layers' heads cost below 0.002 nats
each, bench/results/head_criteria_mamba.md).
`--model gdn` (Gated DeltaNet key-head groups): the Qwen3.5-shaped model bench_head_scores.py --model gdn trains
(same seed and steps: its figures line up with bench/head_scores_gdn.json), every whole-model set of key-head
groups (4 -> 3: 4^3 = 64 sets, 4 -> 2: 6^3 = 216), all layers at once as pruning removes them; each set also
measured on the calibration tokens (the exhaustive calibration search is itself a criterion, `exhaustive_calib`).

`--calib-sizes 16,...,256 --model-dir DIR` (gdn): the calibration side only, at several calibration sizes
(held-out set losses reused from --held-from, the same model checked by its unpruned loss); `--paired-from` then
adds each picked set's paired held-out difference to the best random seed's, with standard errors.

    python bench/bench_head_sets.py [--model embedded|gdn] [--layer 0 --samples 32 --seq-len 256
        --eval-tokens 16384] [--hidden 128 --train-steps 400 --model-dir DIR] [--write]
        [--calib-sizes 16,32,64,128,256 --calib-out JSON] [--paired-from JSON]
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_head_scores import MODEL, cuts, scratch  # noqa: E402
from remodel.compress.baselines import weight_scores  # noqa: E402
from remodel.compress.head_criteria import gate_criteria  # noqa: E402
from remodel.compress.head_loo import HeadMask, head_costs, loo_scores, loo_units, loss_from  # noqa: E402
from remodel.compress.importance import score_model  # noqa: E402
from remodel.compress.prune import plan_keep, prune_model  # noqa: E402
from remodel.models.load import load_model  # noqa: E402
from remodel.models.trunk import start  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus, load_texts, pack  # noqa: E402
from remodel.pipelines.training.evaluate import evaluate  # noqa: E402

OUT = {"embedded": ROOT / "bench" / "head_sets.json", "gdn": ROOT / "bench" / "head_sets_gdn.json"}
KEY = "lin_k_heads"  # GDN key-head groups: plan_keep's keep name; their LOO units are KEY + "_loo"


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


# ---- Gated DeltaNet key-head groups: every whole-model set ------------------------------------------------


def key_units(cfg) -> list[tuple[int, list[torch.Tensor]]]:
    """(layer, out_proj input channels of each key-head group) of every GDN layer."""
    return [(i, ch) for i, name, ch in loo_units(cfg) if name == KEY + "_loo"]


def key_removed(cfg, scores, t) -> tuple:
    """The key-head groups plan_keep drops for targets t: one sorted tuple per GDN layer."""
    keep = plan_keep(cfg, scores, t)
    return tuple(tuple(sorted(set(range(len(ch))) - set(keep[f"layers.{i}.{KEY}"].tolist())))
                 for i, ch in key_units(cfg))


@torch.no_grad()
def all_sets(model, store, batches, units, options, i0=0, prefix=()) -> dict:
    """{(removed groups per layer): mean loss} for every combination of `options` over `units`. Each layer's mask
    is attached while that layer runs and the residual stream carried on: the same as all masks at once (a mask
    changes only its own layer), with each prefix computed once."""
    if not units:
        return {prefix: loss_from(model, i0, store, batches, None)}
    (i, chans), rest = units[0], units[1:]
    for j in range(i0, i):
        store = [model.layers[j](x, None) for x in store]
    out = {}
    for s in options:
        m = HeadMask(model.layers[i], torch.cat([chans[g] for g in s]))
        try:
            nxt = [model.layers[i](x, None) for x in store]
        finally:
            m.remove()
        out.update(all_sets(model, nxt, batches, rest, options, i + 1, prefix + (s,)))
    return out


def gdn_criteria(model, calib, seeds) -> dict:
    """{name: scores file}: the default, magnitude, the random seeds, loo (the calibration oracle) and two gate
    criteria, as bench_head_scores.py builds them."""
    cfg = model.cfg
    act, _ = score_model(model, calib, loss_increase=False)
    out = {"activation": act, "magnitude": weight_scores(cfg, "magnitude", model.state_dict().items())}
    costs, _ = head_costs(model, calib)
    out["loo"] = loo_scores(cfg, act, costs)
    gates = gate_criteria(model, calib)
    for name in ("out_act", "taylor"):
        out[name] = loo_scores(cfg, act, gates[name])
    out.update({f"random{s}": weight_scores(cfg, "random", seed=s) for s in range(seeds)})
    return out


def rank(losses: dict, s) -> int:
    """1 + how many sets are strictly below set s (ties share a rank)."""
    return 1 + sum(v < losses[s] for v in losses.values())


def check_masking(model, store, held, blocks, s, loss, seq_len, batch) -> dict:
    """Set s removed three ways: all masks attached at once, and pruned (prune_model); vs all_sets' `loss`."""
    cfg, units = model.cfg, key_units(model.cfg)
    masks = [HeadMask(model.layers[i], torch.cat([ch[g] for g in gs])) for (i, ch), gs in zip(units, s)]
    try:
        at_once = loss_from(model, 0, store, held, None)
    finally:
        for m in masks:
            m.remove()
    hk = cfg.gated_deltanet.linear_num_key_heads
    r = cfg.gated_deltanet.linear_num_value_heads // hk
    keep = {}
    for (i, _), gs in zip(units, s):
        kept = [g for g in range(hk) if g not in gs]
        keep[f"layers.{i}.{KEY}"] = torch.tensor(kept)
        keep[f"layers.{i}.lin_v_heads"] = torch.tensor([g * r + j for g in kept for j in range(r)])
    pruned = evaluate(prune_model(model, keep), blocks, seq_len=seq_len, batch=batch)["loss"]
    return {"set": [list(g) for g in s], "carried": loss, "masks_at_once": at_once, "pruned": pruned}


def set_name(s) -> str:
    """'0|1,2|3': the groups removed in each GDN layer, layers apart by '|'."""
    return "|".join(",".join(map(str, g)) for g in s)


def summary(losses: dict, cal: dict, chosen: dict) -> dict:
    """One cut: the ranking of every set held out, and each criterion's set (and the calibration-best set) in it."""
    order = sorted(losses, key=losses.get)
    chosen = {**chosen, "exhaustive_calib": min(cal, key=cal.get)}
    rows = {n: {"set": set_name(s), "loss": losses[s], "rank": rank(losses, s), "calib_loss": cal[s],
                "calib_rank": rank(cal, s)} for n, s in chosen.items()}
    return {"sets": len(order), "best": {"set": set_name(order[0]), "loss": losses[order[0]]},
            "worst": {"set": set_name(order[-1]), "loss": losses[order[-1]]},
            "median": losses[order[len(order) // 2]], "criteria": rows,
            "all": {set_name(s): [losses[s], cal[s]] for s in order}}


@torch.no_grad()
def run_gdn(model_dir, samples, seq_len, eval_tokens, seeds, batch) -> dict:
    from transformers import AutoTokenizer

    train, valid = embedded_corpus()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    calib_t = pack(load_texts(train), tok, seq_len, max_tokens=samples * seq_len)
    blocks = pack(load_texts(valid), tok, seq_len, max_tokens=eval_tokens)
    calib, held = list(calib_t.split(batch)), list(blocks.split(batch))
    model = load_model(model_dir).float().eval()
    cfg, sec, res, check = model.cfg, {}, {}, None
    t = time.time()
    with torch.enable_grad():
        crit = gdn_criteria(model, calib, seeds)
    sec["criteria"] = time.time() - t
    units, hk = key_units(cfg), cfg.gated_deltanet.linear_num_key_heads
    store = [start(cfg, model.embed(ids)) for ids in held]
    cstore = [start(cfg, model.embed(ids)) for ids in calib]
    for cut, tg in ((c, tg) for c, tg in cuts(cfg).items() if "linear_key_heads" in tg):
        t = time.time()
        options = list(itertools.combinations(range(hk), hk - tg["linear_key_heads"]))
        losses = all_sets(model, store, held, units, options)
        sec[f"{cut} held-out sets"] = time.time() - t
        cal = all_sets(model, cstore, calib, units, options)
        sec[f"{cut} calibration sets"] = time.time() - t - sec[f"{cut} held-out sets"]
        res[cut] = summary(losses, cal, {n: key_removed(cfg, sc, tg) for n, sc in crit.items()})
        print(cut, json.dumps({k: v for k, v in res[cut].items() if k != "all"}), flush=True)
        if tg["linear_key_heads"] == hk // 2:
            s = key_removed(cfg, crit["activation"], tg)
            check = check_masking(model, store, held, blocks, s, losses[s], seq_len, batch)
            print("masking check", check, flush=True)
    return {"cuts": res, "masking_check": check, "unpruned_loss": loss_from(model, 0, store, held, None),
            "seconds": {k: round(v, 1) for k, v in sec.items()}}


# ---- Calibration size (issue 55): the same sets' calibration losses on more tokens --------------------------


def spearman(a: list, b: list) -> float:
    """Rank correlation of two equally long lists (ties broken by position: the losses are floats)."""
    ra, rb = (torch.tensor(x, dtype=torch.float64).argsort().argsort().double() for x in (a, b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


@torch.no_grad()
def token_losses(model, held, s) -> torch.Tensor:
    """Per-token held-out loss [sequences, seq_len - 1] with set s removed (all masks at once)."""
    masks = [HeadMask(model.layers[i], torch.cat([ch[g] for g in gs])) for (i, ch), gs in zip(key_units(model.cfg), s)]
    try:
        out = [torch.nn.functional.cross_entropy(model(ids)[:, :-1].transpose(1, 2).double(), ids[:, 1:],
                                                  reduction="none") for ids in held]
    finally:
        for m in masks:
            m.remove()
    return torch.cat(out)


def paired_noise(model, held, sets: dict, best) -> dict:
    """Each named set's held-out loss minus the held-out-best set's, with the paired standard error of that mean
    difference per token and per sequence (tokens of one sequence are correlated: the per-sequence SE is the
    honest one)."""
    base, out = token_losses(model, held, best), {}
    for name, s in sets.items():
        d = token_losses(model, held, s) - base
        seq = d.mean(1)
        out[name] = {"set": set_name(s), "diff": float(d.mean()), "se_token": float(d.std() / d.numel() ** 0.5),
                     "se_sequence": float(seq.std() / len(seq) ** 0.5)}
    return out


def parse_set(name: str) -> tuple:
    return tuple(tuple(int(g) for g in part.split(",")) for part in name.split("|"))


def chunk_measure(model, chunk, units, options: dict) -> tuple[dict, dict]:
    """One calibration chunk: ({cut: {set: loss}}, loo costs) -- both means over the chunk's tokens."""
    cstore = [start(model.cfg, model.embed(ids)) for ids in chunk]
    cal = {cut: all_sets(model, cstore, chunk, units, opts) for cut, opts in options.items()}
    costs, _ = head_costs(model, chunk)
    return cal, costs


def size_summary(model, calib_n, acc, held_cuts, targets) -> dict:
    """One calibration size: the criteria from its first calib_n batches (activation) and its chunks' weighted
    loo costs and set losses; each criterion's set ranked among every set held out; Spearman(calib, held)."""
    cfg, n = model.cfg, acc["n"]
    act, _ = score_model(model, acc["batches"][:calib_n], loss_increase=False)
    costs = {k: v / n for k, v in acc["costs"].items()}
    crit = {"activation": act, "magnitude": weight_scores(cfg, "magnitude", model.state_dict().items()),
            "loo": loo_scores(cfg, act, costs)}
    crit.update({f"random{s}": weight_scores(cfg, "random", seed=s) for s in range(acc["seeds"])})
    out = {}
    for cut, tg in targets.items():
        held = {parse_set(k): v[0] for k, v in held_cuts[cut]["all"].items()}
        cal = {s: v / n for s, v in acc["cal"][cut].items()}
        row = summary(held, cal, {name: key_removed(cfg, sc, tg) for name, sc in crit.items()})
        keys = list(held)
        row["spearman_calib_held"] = spearman([cal[k] for k in keys], [held[k] for k in keys])
        out[cut] = row
    return out


def noise_sets(held_cut: dict) -> tuple:
    """(the held-out-best set, {name: set}: the next two held-out sets and every criterion's set at 8k tokens)."""
    order = list(held_cut["all"])
    sets = {f"held-out #{k + 1}": parse_set(order[k]) for k in (1, 2)}
    sets.update({n: parse_set(r["set"]) for n, r in held_cut["criteria"].items() if n not in ("out_act", "taylor")})
    return parse_set(order[0]), sets


@torch.no_grad()
def run_calib(model_dir, sizes, seq_len, seeds, batch, held_json, out_path) -> dict:
    """Criteria and every set's calibration loss at each calibration size (a prefix of the train split, measured
    chunk by chunk and pooled); held-out losses reused from held_json (same model: unpruned loss checked)."""
    from transformers import AutoTokenizer

    ref = json.loads(Path(held_json).read_text())
    train, valid = embedded_corpus()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    calib_t = pack(load_texts(train), tok, seq_len, max_tokens=sizes[-1] * seq_len)
    if len(calib_t) < sizes[-1]:
        raise SystemExit(f"--calib-sizes: the train split holds {len(calib_t)} sequences of {seq_len}")
    blocks = pack(load_texts(valid), tok, seq_len, max_tokens=int(ref["settings"]["eval_tokens"]))
    held, model = list(blocks.split(batch)), load_model(model_dir).float().eval()
    cfg, units, hk = model.cfg, key_units(model.cfg), model.cfg.gated_deltanet.linear_num_key_heads
    base = loss_from(model, 0, [start(cfg, model.embed(ids)) for ids in held], held, None)
    if abs(base - ref["unpruned_loss"]) > 1e-5:
        raise SystemExit(f"--held-from: unpruned held-out loss {base:.6f} != {ref['unpruned_loss']:.6f} (other model)")
    targets = {c: tg for c, tg in cuts(cfg).items() if "linear_key_heads" in tg}
    options = {c: list(itertools.combinations(range(hk), hk - tg["linear_key_heads"])) for c, tg in targets.items()}
    t0 = time.time()
    res = {"unpruned_loss": base, "noise": {c: paired_noise(model, held, *noise_sets(ref["cuts"][c])[::-1])
                                            for c in targets}, "sizes": {}, "seconds": {}}
    res["seconds"]["noise"] = round(time.time() - t0, 1)
    res["settings"] = {"calib_sizes": sizes, "seq_len": seq_len, "batch": batch, "seeds": seeds,
                       "model_dir": str(model_dir), "held_from": str(held_json)}
    print("noise", json.dumps(res["noise"]), flush=True)
    batches = list(calib_t[:sizes[-1]].split(batch))
    acc = {"n": 0, "cal": {c: {} for c in targets}, "costs": {}, "batches": batches, "seeds": seeds}
    for lo, hi in zip([0] + sizes[:-1], sizes):
        cal, costs = chunk_measure(model, batches[lo // batch:hi // batch], units, options)
        w = hi - lo
        for c in targets:
            for k, v in cal[c].items():
                acc["cal"][c][k] = acc["cal"][c].get(k, 0.0) + w * v
        for k, v in costs.items():
            acc["costs"][k] = acc["costs"].get(k, 0.0) + w * v
        acc["n"] += w
        res["sizes"][str(hi)] = size_summary(model, hi // batch, acc, ref["cuts"], targets)
        res["seconds"][str(hi)] = round(time.time() - t0, 1)
        print(hi, json.dumps({c: {k: v for k, v in r.items() if k != "all"} for c, r in res["sizes"][str(hi)].items()}),
              flush=True)
        if out_path:
            tmp = Path(str(out_path) + ".tmp")
            tmp.write_text(json.dumps(res, indent=1) + "\n")
            tmp.replace(out_path)
    return res


@torch.no_grad()
def paired_vs_seed(model_dir, calib_json: Path, seq_len, batch) -> dict:
    """After --calib-sizes: each set a criterion picked at any calibration size vs the best random seed's set,
    paired held out (per-token and per-sequence standard errors); added to calib_json as `paired_vs_best_seed`."""
    from transformers import AutoTokenizer

    res = json.loads(calib_json.read_text())
    ref = json.loads(Path(res["settings"]["held_from"]).read_text())
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    blocks = pack(load_texts(embedded_corpus()[1]), tok, seq_len, max_tokens=int(ref["settings"]["eval_tokens"]))
    held, model, out = list(blocks.split(batch)), load_model(model_dir).float().eval(), {}
    for cut in ref["cuts"]:
        rows = [r[cut]["criteria"] for r in res["sizes"].values()]
        seeds = {n: x for n, x in rows[0].items() if n.startswith("random")}
        best = min(seeds, key=lambda n: seeds[n]["loss"])
        sets = {f"{n} ({x['set']})": parse_set(x["set"]) for r in rows for n, x in r.items()
                if n in ("activation", "loo", "exhaustive_calib")}
        sets[f"held-out best ({ref['cuts'][cut]['best']['set']})"] = parse_set(ref["cuts"][cut]["best"]["set"])
        out[cut] = {"seed": best, **paired_noise(model, held, sets, parse_set(seeds[best]["set"]))}
        print(cut, json.dumps(out[cut]), flush=True)
    res["paired_vs_best_seed"] = out
    tmp = Path(str(calib_json) + ".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(calib_json)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=tuple(OUT), default="embedded",
                    help="data/embedded's Mamba heads (one layer's sets), or GDN key-head groups of the "
                         "Qwen3.5-shaped model bench_head_scores.py --model gdn trains (every whole-model set)")
    ap.add_argument("--layer", type=int, default=0,
                    help="--model embedded: the Mamba layer whose head sets are enumerated")
    ap.add_argument("--samples", type=int, default=32, help="calibration sequences (train split) for the criteria")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens (valid split)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128, help="--model gdn: hidden size")
    ap.add_argument("--train-steps", type=int, default=400, help="--model gdn: training steps (8 x 128 tokens)")
    ap.add_argument("--model-dir", type=Path, help="--model gdn: a model already trained so (skips training)")
    ap.add_argument("--write", action="store_true", help="write bench/head_sets[_gdn].json")
    ap.add_argument("--calib-sizes", help="--model gdn: e.g. 32,128,256 calibration sequences: only the calibration "
                                          "side is measured (held-out losses from --held-from); needs --model-dir")
    ap.add_argument("--held-from", type=Path, default=OUT["gdn"], help="--calib-sizes: the held-out run's JSON")
    ap.add_argument("--calib-out", type=Path, help="--calib-sizes: JSON written after each size")
    ap.add_argument("--paired-from", type=Path, help="a --calib-out JSON: add each picked set vs the best seed's, "
                                                     "paired held out (needs --model-dir)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    if a.paired_from:
        paired_vs_seed(a.model_dir, a.paired_from, a.seq_len, a.batch)
        return
    if a.calib_sizes:
        sizes = sorted(int(x) for x in a.calib_sizes.split(","))
        if a.model != "gdn" or not a.model_dir or any(x % a.batch for x in sizes):
            raise SystemExit("--calib-sizes: needs --model gdn, --model-dir, and sizes that are multiples of --batch")
        res = run_calib(a.model_dir, sizes, a.seq_len, a.seeds, a.batch, a.held_from, a.calib_out)
        print(f"seconds {res['seconds']}")
        return
    if a.model == "embedded":
        res = {"cuts": run(a.layer, a.samples, a.seq_len, a.eval_tokens, a.seeds, a.batch)}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = a.model_dir or scratch(Path(tmp), "gdn", a.train_steps, a.hidden)
            train_s = 0.0 if a.model_dir else round(time.time() - t0, 1)
            res = run_gdn(model_dir, a.samples, a.seq_len, a.eval_tokens, a.seeds, a.batch)
        res["seconds"]["train"] = train_s
    total = round(time.time() - t0, 1)
    res.update(settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
               seconds=total if a.model == "embedded" else {**res["seconds"], "total": total},
               date=str(datetime.date.today()))
    print(f"seconds {res['seconds']}")
    if a.write:
        OUT[a.model].write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
