"""Make the embedded MoE (data/embedded_moe): data/embedded upcycled to 8 experts (G=4 virtual groups,
top-4, Nemotron-H sigmoid router, exact at init) and trained further on the shipped KJV corpus.

    python data/make_embedded_moe.py                   # writes data/embedded_moe (overwrites it)
    python data/make_embedded_moe.py --tokens 262144 --out /tmp/moe

Steps: an fp32 copy of data/embedded (so the upcycled model starts equal to the dense one to ~1e-6);
pipelines.commands.upcycle.upcycle; pipelines.training.train.train on the whole train split (the trainer caches it as a
token set under $REMODEL_CACHE) with the same settings as bench/bench_upcycle_quality.py's MoE arm;
save in bfloat16 (like data/embedded), reload, and evaluate the *shipped* weights in fp32 on the whole
valid split, ours and transformers' (must agree within 1e-3). README.md and train_log.json record it.
bench/bench_upcycle_quality.py --ship DIR ships its MoE arm through `ship` below (same run, same result).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see data/train_embedded.py

import torch  # noqa: E402

from remodel.models.load import load_config, load_model, save_model  # noqa: E402
from remodel.pipelines.data.data import DATA_DIR, embedded_corpus, embedded_tokenizer_path  # noqa: E402
from remodel.pipelines.training.evaluate import evaluate  # noqa: E402
from remodel.pipelines.training.train import train  # noqa: E402
from remodel.pipelines.commands.upcycle import upcycle  # noqa: E402

EMBEDDED = DATA_DIR / "embedded"
# the recipe (bench/bench_upcycle_quality.py uses the same defaults)
RECIPE = {"experts": 8, "granularity": 4, "top_k": 4, "tokens": 1_572_864, "seq_len": 256, "batch": 8,
          "lr": 1e-3, "seed": 0}


def upcycle_embedded(tmp: Path, experts: int, granularity: int, top_k: int, seed: int) -> dict:
    """tmp/dense: fp32 copy of data/embedded; tmp/moe: its exact upcycle. -> upcycle's report."""
    save_model(load_model(EMBEDDED), tmp / "dense", dtype=torch.float32, aux_from=EMBEDDED)
    return upcycle(tmp / "dense", tmp / "moe", experts=experts, granularity=granularity, top_k=top_k, router="sigmoid",
                   exact=True, seed=seed)


def train_arm(tmp: Path, name: str, data, recipe: dict, checkpoint_every: int) -> dict:
    """Continue tmp/name on `data` into tmp/name-trained with the training values of `recipe` (RECIPE's
    keys: tokens, seq_len, batch, lr, seed), keeping every checkpoint (for curves)."""
    t = time.time()
    r = recipe
    rep = train(tmp / name, tmp / f"{name}-trained", data=data, tokens=r["tokens"], seq_len=r["seq_len"],
                batch=r["batch"], lr=r["lr"], seed=r["seed"], eval_data=embedded_corpus()[1],
                checkpoint_every=checkpoint_every, keep_last=0, log_every=0)
    rep["wall_s"] = time.time() - t
    return rep


def ship(trained: Path, out: Path, record: dict) -> dict:
    """Save `trained` in bf16 at `out`, evaluate the shipped weights (ours and transformers', fp32, all
    valid tokens), write train_log.json and README.md there. -> the log."""
    save_model(load_model(trained), out, dtype=torch.bfloat16, aux_from=EMBEDDED, overwrite=True)
    valid = embedded_corpus()[1]
    ours = evaluate(out, valid, seq_len=record["seq_len"], batch=8)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, trust_remote_code=False).eval()
    hf_eval = evaluate(_HFWrap(hf, load_config(out)), valid, seq_len=record["seq_len"], batch=8,
                       tokenizer=_tokenizer())
    if abs(hf_eval["loss"] - ours["loss"]) > 1e-3:
        raise SystemExit(f"transformers disagrees: {hf_eval['loss']} vs {ours['loss']}")
    cfg = load_config(out)
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    log = {**record, "pattern": cfg.pattern, "saved_dtype": "bfloat16", "valid_tokens": ours["tokens"],
           "valid_loss": round(ours["loss"], 5), "valid_ppl": round(ours["ppl"], 4),
           "valid_loss_transformers": round(hf_eval["loss"], 5), "files": files, "torch": torch.__version__,
           "machine": platform.machine()}
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    (out / "README.md").write_text(readme(log))
    return log


class _HFWrap(torch.nn.Module):
    """transformers' model behind our forward(ids) -> logits, for pipelines.training.evaluate."""

    def __init__(self, hf, cfg):
        super().__init__()
        self.hf, self.cfg = hf, cfg

    def forward(self, ids):
        return self.hf(input_ids=ids).logits


def _tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(embedded_tokenizer_path(), trust_remote_code=False)


def readme(log: dict) -> str:
    size = sum(log["files"].values())
    return f"""# Embedded MoE checkpoint

data/embedded (the dense default, `M-M*M-M-`) upcycled to a fine-grained mixture of experts and trained
further on the shipped King James Bible corpus. The trained MoE of `tests/test_embedded.py` and of the
expert-pruning experiments. Loads with `transformers.AutoModelForCausalLM.from_pretrained("data/embedded_moe")`
(no trust_remote_code); `pipelines.data.data.embedded_moe_path()` locates it.

| | |
|---|---|
| pattern | `{log["pattern"]}` (each MLP `-` of the dense model is now a MoE layer `E`) |
| upcycling | `upcycle(dense_fp32, out, {log["experts"]}, {log["granularity"]}, {log["top_k"]}, router="sigmoid", exact=True, seed={log["seed"]})`: {log["experts"]} experts of {log["expert_size"]} (G={log["granularity"]} virtual groups), top-{log["top_k"]}, normalised sigmoid router (Nemotron-H), exact at init (max abs logit diff {log["init_max_abs_logit_diff"]:.1e}) |
| parameters | {log["params_total"]:,} total, {log["params_active"]:,} active per token |
| weights | bfloat16, {size / 1e6:.2f} MB on disk in all |
| training | pipelines.training.train.train: {log["tokens_trained"]:,} tokens ({log["steps"]} steps of {log["batch"]}x{log["seq_len"]}) of the whole train split, seed {log["seed"]}, AdamW lr {log["lr"]:g} (warm-up {log["warmup_steps"]} steps, cosine to {log["lr"] / 10:g}), wd 0.1, clip 1.0, load-balancing loss 1e-2; {log["train_minutes"]} min on CPU ({log["threads"]} thread, shared machine) |
| final train loss | {log["final_train_loss"]:.4f} (mean of the last 20 steps) |
| held-out loss / perplexity | {log["valid_loss"]} / {log["valid_ppl"]} on all {log["valid_tokens"]:,} valid tokens (seq {log["seq_len"]}, shipped bf16 weights evaluated in fp32); the dense start: {log["valid_loss_at_init"]} |
| via transformers | {log["valid_loss_transformers"]} |

Made by{" (the MoE arm of the upcycling-quality bench, shipped from that run)" if "bench" in log["command"] else ""}:

    {log["command"]}

Reproduce the MoE alone (same settings, same result up to CPU kernel nondeterminism):

    python data/make_embedded_moe.py

The dense model continued on the same tokens, with the held-out curves of both, is in bench/RESULTS.md
("Quality after further training") and bench/upcycle_quality.json / .png.
"""


def record_of(up: dict, rep: dict, args: dict, command: str) -> dict:
    """The figures ship() records, from upcycle's and the trainer's reports."""
    hist = rep["history"] if "history" in rep else []
    last = [h["lm"] if "lm" in h else h["loss"] for h in hist[-20:]]
    return {**args, "command": command, "expert_size": up["expert_size"],
            "init_max_abs_logit_diff": up["deviation"]["max_abs_logit_diff"],
            "params_total": up["params"]["moe_total"], "params_active": up["params"]["moe_active"],
            "tokens_trained": rep["tokens"], "steps": rep["steps"], "warmup_steps": min(100, rep["steps"] // 10),
            "train_minutes": round(rep["wall_s"] / 60, 1), "threads": torch.get_num_threads(),
            "final_train_loss": sum(last) / len(last) if last
            else (rep.get("last_step_losses") or {}).get("total", rep.get("final_loss")),  # older reports: final_loss
            "valid_loss_at_init": round(rep["eval"]["before"]["loss"], 5)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(DATA_DIR / "embedded_moe"))
    for k, v in RECIPE.items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    import tempfile
    args = {k: getattr(a, k) for k in RECIPE}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        up = upcycle_embedded(tmp, a.experts, a.granularity, a.top_k, a.seed)
        rep = train_arm(tmp, "moe", embedded_corpus()[0], args, 10**9)
        cmd = "python " + " ".join(["data/make_embedded_moe.py"] + sys.argv[1:])
        log = ship(tmp / "moe-trained", Path(a.out), record_of(up, rep, args, cmd))
    print(f"wrote {a.out}: held-out loss {log['valid_loss']} (transformers {log['valid_loss_transformers']})")


if __name__ == "__main__":
    main()
