"""Upcycling quality: the embedded dense model vs its upcycled MoE, each trained further on the same tokens,
with the held-out loss measured along the way (a curve, not one point).

1. An fp32 copy of data/embedded (dense relu2 hybrid `M-M*M-M-`, shipped in bf16): with fp32 weights the
   expert scale s = G^(1/3) rounds at fp32, so the MoE starts equal to the dense model (to ~1e-6).
2. upcycle(..., router="sigmoid", exact=True): Nemotron-H's normalised sigmoid router, virtual groups.
3. pipelines.training.train.train on both, same `--tokens` (default 1.5M: about 1.5 epochs of the whole train split;
   `--stride k` keeps every k-th chapter only), same seed and data order, batch, lr schedule (linear
   warm-up, cosine to lr/10 over the whole run); the trainer adds the load-balancing loss (1e-2) for the
   MoE only. Each run keeps a checkpoint every tokens/`--evals` tokens; after it, every checkpoint's weights
   are evaluated on the whole valid split: one uninterrupted run per arm, its curve read off its checkpoints
   (the points before the end are mid-schedule, at a higher learning rate than the end).
Writes bench/upcycle_quality.json (numbers) and .png (both curves); prints a markdown block and records it
under "## Upcycling" in bench/RESULTS.md unless --no-record. `--ship DIR` also ships the trained MoE
through data/make_embedded_moe.py (bf16, README, log): data/embedded_moe was made that way.
    python bench/bench_upcycle_quality.py [--tokens 1572864 --evals 12 --lr 1e-3 --ship data/embedded_moe]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from bench_upcycle import record  # noqa: E402
from remodel.data.make_embedded_moe import RECIPE, record_of, ship, train_arm, upcycle_embedded  # noqa: E402
from remodel.models.load import load_model  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path, load_texts, pack  # noqa: E402
from remodel.pipelines.training.evaluate import evaluate  # noqa: E402
from remodel.pipelines.training.train_state import list_checkpoints, read_full, read_meta, run_dir_for  # noqa: E402

SUBHEAD = "### Quality after further training (bench/bench_upcycle_quality.py)"
OUT_JSON, OUT_PNG = ROOT / "bench" / "upcycle_quality.json", ROOT / "bench" / "upcycle_quality.png"


def train_data(tmp: Path, stride: int) -> Path:
    """The whole train split, or every `stride`-th chapter of it in a temporary file."""
    train_txt = embedded_corpus()[0]
    if stride == 1:
        return train_txt
    with gzip.open(train_txt, "rt", encoding="utf-8") as f:
        chapters = [line for line in f if line.strip()]
    (tmp / "train.txt").write_text("".join(chapters[::stride]), encoding="utf-8")
    return tmp / "train.txt"


def curve(start: Path, run_dir: Path, blocks: torch.Tensor, tokens_per_step: int, batch: int) -> list[list]:
    """[[tokens trained, held-out loss]] of every checkpoint in run_dir (weights loaded into `start`'s model)."""
    out = []
    for ckpt in list_checkpoints(run_dir):
        model = load_model(start)
        sd = {k[len("model."):]: v for k, v in read_full(ckpt).items()}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        names = dict(model.named_parameters())
        assert not unexpected and not [k for k in missing if k in names], (missing, unexpected)
        step = read_meta(ckpt)["step"]
        out.append([step * tokens_per_step, evaluate(model, blocks, batch=batch)["loss"]])
        print(f"  {ckpt.name}: {out[-1][0]:,} tokens, held-out loss {out[-1][1]:.5f}", flush=True)
    return out


def merge(res: dict, name: str) -> dict:
    """`res` plus the other arm's results from OUT_JSON when a run with the same settings wrote them."""
    try:
        old = json.loads(OUT_JSON.read_text())
    except (OSError, ValueError):
        return res
    key = lambda args: {k: v for k, v in args.items() if k not in ("arm", "ship", "no_record")}  # noqa: E731
    if key(old.get("args", {})) == key(res["args"]):
        for other in set(old.get("curves", {})) - {name} - set(res["curves"]):
            res["curves"][other], res[other] = old["curves"][other], old[other]
            res.setdefault("commands", {})[other] = old["command"]
    return res


def crossover(dense: list, moe: list) -> str:
    """Where the MoE's held-out loss first goes below the dense model's (same token counts), if it does."""
    gaps = [(t, m - d) for (t, d), (_, m) in zip(dense, moe) if t > 0]
    below = [t for t, g in gaps if g < 0]
    if not below:
        return "the MoE does not overtake the dense model at any measured point"
    stays = all(g < 0 for t, g in gaps if t >= below[0])
    return (f"the MoE first goes below the dense model at {below[0]:,} tokens"
            + (" and stays below" if stays else " (not at every later point)"))


def plot(res: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, label in (("dense", "dense (continued)"), ("moe", res["moe_label"])):
        t, l = zip(*res["curves"][name])
        ax.plot([x / 1e6 for x in t], l, marker="o", label=label)
    ax.set_xlabel("tokens trained after the dense pretraining (M)")
    ax.set_ylabel(f"held-out loss (nats/token, {res['valid_tokens']:,} tokens)")
    ax.set_title("Upcycled MoE vs continued dense, same tokens (data/embedded)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(res: dict) -> list[str]:
    rows = ["| tokens | dense held-out loss | MoE held-out loss | MoE - dense |", "|---|---|---|---|"]
    for (t, d), (_, m) in zip(res["curves"]["dense"], res["curves"]["moe"]):
        rows.append(f"| {t:,} | {d:.5f} | {m:.5f} | {m - d:+.5f} |")
    return rows


def body(a, res: dict, up: dict) -> str:
    d, m = res["dense"], res["moe"]
    prm = up["params"]
    others = "".join(f"; {k} arm: `{c}`" for k, c in res.get("commands", {}).items())
    return "\n".join([
        f"- {time.strftime('%Y-%m-%d')} {platform.machine()}, {os.cpu_count()} cpus shared with other jobs, torch "
        f"{torch.__version__}, {torch.get_num_threads()} thread, fp32. Command: `{res['command']}`{others}. Source: "
        f"data/embedded (`M-M*M-M-`, relu2 FFN 768, {prm['dense'] / 1e6:.3f}M params) as fp32. Upcycled: "
        f"N={a.experts} G={a.granularity} T={a.top_k} (expert size {up['expert_size']}, {prm['moe_total'] / 1e6:.3f}M "
        f"total / {prm['moe_active'] / 1e6:.3f}M active), sigmoid router + norm_topk_prob (Nemotron-H), exact at "
        f"init (max |dlogit| {up['deviation']['max_abs_logit_diff']:.1e}).",
        f"- Both trained with pipelines.training.train.train on the same {d['tokens']:,} tokens in the same order "
        f"({'the whole train split' if a.stride == 1 else f'every {a.stride}th chapter'}, {d['data_tokens']:,} "
        f"tokens, {d['epochs']:.2f} epochs; {d['steps']} steps of {a.batch}x{a.seq_len}, seed {a.seed}), AdamW lr "
        f"{a.lr:g} (warm-up {min(100, d['steps'] // 10)} steps, cosine to {a.lr / 10:g} over the whole run), wd 0.1, "
        f"clip 1.0; the MoE adds the load-balancing loss (1e-2). Held-out loss of each arm's checkpoint every "
        f"{res['checkpoint_every'] * a.batch * a.seq_len:,} tokens, on all {res['valid_tokens']:,} valid tokens "
        f"(seq {a.seq_len}). Numbers: `bench/upcycle_quality.json`; plot: `bench/upcycle_quality.png`.",
        "",
        *table(res),
        "",
        f"- **{res['crossover']}**; at the end MoE - dense = {res['final_gap']:+.4f} nats (ppl "
        f"{m['eval']['after']['ppl']:.2f} vs {d['eval']['after']['ppl']:.2f}). Train tok/s {d['tokens_per_s']:.0f} "
        f"dense, {m['tokens_per_s']:.0f} MoE (shared CPU, noisy). Whole bench {res['wall_s']:.0f} s.",
    ])


def main():
    ap = argparse.ArgumentParser()
    for k, v in RECIPE.items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    ap.add_argument("--evals", type=int, default=12, help="held-out evaluations along each run")
    ap.add_argument("--stride", type=int, default=1, help="train on every k-th chapter of the train split")
    ap.add_argument("--threads", type=int, default=1, help="1: two threads stall 4-5x on a busy 2-core machine")
    ap.add_argument("--ship", default=None, help="also ship the trained MoE to this folder (data/make_embedded_moe)")
    ap.add_argument("--arm", choices=("both", "moe", "dense"), default="both",
                    help="train one arm only (two processes in parallel); the second to finish merges the "
                    "other's results from bench/upcycle_quality.json (same settings only) and reports")
    ap.add_argument("--no-record", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.time()
    from transformers import AutoTokenizer
    blocks = pack(load_texts(embedded_corpus()[1]), AutoTokenizer.from_pretrained(embedded_tokenizer_path()),
                  a.seq_len)
    res = {"command": "python bench/bench_upcycle_quality.py " + " ".join(sys.argv[1:]), "args": vars(a),
           "valid_tokens": blocks.numel(), "moe_label": f"MoE N{a.experts} G{a.granularity} T{a.top_k}",
           "curves": {}, "machine": platform.machine(), "torch": torch.__version__}
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = train_data(tmp, a.stride)
        up = upcycle_embedded(tmp, a.experts, a.granularity, a.top_k, a.seed)
        steps = -(-a.tokens // (a.batch * a.seq_len))
        res["checkpoint_every"] = every = max(1, steps // a.evals)
        for name in ("moe", "dense") if a.arm == "both" else (a.arm,):  # the MoE first: it is the one shipped
            runs[name] = r = train_arm(tmp, name, data, {k: getattr(a, k) for k in RECIPE}, every)
            res["curves"][name] = [[0, r["eval"]["before"]["loss"]]] + curve(
                tmp / name, run_dir_for(tmp / f"{name}-trained"), blocks, r["tokens_per_step"], a.batch)
            res[name] = {k: r[k] for k in ("steps", "tokens", "data_tokens", "epochs", "final_loss", "tokens_per_s",
                                           "wall_s", "eval")}
            res = merge(res, name)
            OUT_JSON.write_text(json.dumps(res, indent=1) + "\n")  # partial results survive a cut-off run
            if name == "moe" and a.ship:
                log = ship(tmp / "moe-trained", Path(a.ship), record_of(up, r, {k: getattr(a, k) for k in RECIPE},
                                                                        res["command"]))
                print(f"shipped {a.ship}: held-out loss {log['valid_loss']}", flush=True)
    if not {"moe", "dense"} <= set(res["curves"]):
        print(f"{a.arm} arm done; the other arm's process reports")
        return
    d, m = res["dense"], res["moe"]
    assert (m["steps"], m["tokens"], m["data_tokens"]) == (d["steps"], d["tokens"], d["data_tokens"])
    res["final_gap"] = m["eval"]["after"]["loss"] - d["eval"]["after"]["loss"]
    res["crossover"] = crossover(res["curves"]["dense"], res["curves"]["moe"])
    res["wall_s"] = time.time() - t0
    OUT_JSON.write_text(json.dumps(res, indent=1) + "\n")
    plot(res, OUT_PNG)
    text = body(a, res, up)
    print(text)
    if not a.no_record:
        record(SUBHEAD, text)


if __name__ == "__main__":
    main()
