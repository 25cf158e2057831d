"""Hybridize quality and serving cost (issue 57 Deliver 3): a Llama trained here from scratch, turned into
Mamba-2 / Gated DeltaNet hybrids with 1/4 (and 1/8) of its attention layers kept.

1. An 8-layer Llama (hidden --hidden, 4 query / 2 KV heads) trained --src-steps steps of --src-batch x
   --src-seq-len tokens on the shipped corpus's train split (data/corpus/train.txt.gz) with a
   --repeat-share of its --repeat-words-word chunks written twice, so that copying needs a layer that looks back
   and more than layer 0 can matter; held-out loss on the valid split (valid.txt.gz, same transform; the shipped tasks are drawn from it
   and nothing here trains on it). --src-dir: train the source there once and reuse it in later runs.
   Per attention layer: the KL to the source when that layer alone is replaced (--select kl's figure).
2. At each --keeps point (2: 1/4 attention, 1: 1/8), for each mixer and each --seeds seed (the new mixers' init
   and the data order), the same distillation budget (--steps optimizer steps, lr, data) for the key arms:
   `kl` (--init attention, --select kl), `random` (--init random on kl's layers), `even` (--init attention,
   evenly spaced layers); at 1/4, first seed only: `transfer` (unless --transfer 0: kl's layers, --steps // 3
   stage-one transfer steps, then the rest distillation). Loss-vs-tokens rows at each --curve-keeps point: the
   attention-init and the random-init arm (seed 0, kl's layers) after each --curve step count (separate runs,
   each its own lr schedule; the --steps point is the arm itself).
3. Held-out loss of each; task accuracy (remodel_cloze, remodel_nextphrase on plain text, through lm-eval and
   transformers: pipelines.training.tasks.run_tasks; --task-limit items per task, None: all) of the source
   and of the arms of --task-seeds (lm-eval on CPU is the slow part).
4. Inference state bytes (`remodel inspect`'s memory_bytes) at each --contexts length, source vs the `kl`
   hybrids; eval tokens/s of one forward over one random sequence of that length (no grad, best of 2, CPU).
Writes bench/hybridize.json (after each point, so a stopped run keeps what it measured) and
bench/results/hybridize.md (tables: bench/hybridize_report.py; --from-json rewrites it from a JSON).
    nice -n 10 python bench/bench_hybridize.py [--src-steps 400 --steps 30 --seeds 0,1 --keeps 2,1 --curve 10,30,90]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from hybridize_report import LAYERS, write_md  # noqa: E402
from remodel.models.config import ModelConfig  # noqa: E402
from remodel.models.load import load_model, save_model  # noqa: E402
from remodel.models.model import HybridLM, init_weights  # noqa: E402
from remodel.pipelines.commands.hybridize import hybridize  # noqa: E402
from remodel.pipelines.commands.inspection import inspect  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path  # noqa: E402
from remodel.pipelines.training import train as T  # noqa: E402
from remodel.pipelines.training.evaluate import evaluate  # noqa: E402
from remodel.pipelines.training.tasks import run_tasks  # noqa: E402

TASKS = ["remodel_cloze", "remodel_nextphrase"]


def repeated(text: str, words: int, share: float, seed: int = 0) -> str:
    """Each line cut into `words`-word chunks, a `share` of them (by seed) written twice in a row: text whose
    second copies only a layer that looks back (an induction / copy head) can predict, so that more than the
    first layer can matter to the source and a replaced layer's cost shows (--repeat-words 0: the text as is)."""
    if not words:
        return text
    rng, out = random.Random(seed), []
    for line in text.splitlines():
        w = line.split()
        chunks = [" ".join(w[i:i + words]) for i in range(0, len(w), words)]
        out.append(" ".join(f"{c} {c}" if rng.random() < share else c for c in chunks))
    return "\n".join(out) + "\n"


def source(d: Path, a) -> Path:
    """Write the train / valid splits (the corpus's own, with --repeat-words chunks repeated; valid.txt.gz, which
    the shipped tasks are drawn from, is never trained on) and train the 8-layer Llama from scratch, or reuse
    --src-dir's (its settings are not checked: pass the ones that trained it); -> its directory."""
    train, valid = embedded_corpus()
    for name, f in (("train.txt", train), ("valid.txt", valid)):
        with gzip.open(f, "rt", encoding="utf-8") as g:
            (d / name).write_text(repeated(g.read(), a.repeat_words, a.repeat_share))
    lines = (d / "train.txt").read_text().splitlines(keepends=True)
    (d / "distill.txt").write_text("".join(lines[:a.distill_lines]))  # the arms' data: enough tokens, less to tokenize
    home = Path(a.src_dir) if a.src_dir else d
    if (home / "src" / "config.json").is_file():
        return home / "src"
    cfg = ModelConfig(vocab_size=2048, hidden_size=a.hidden, pattern="*-" * LAYERS, tie_word_embeddings=True,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=a.hidden // 4,
                      intermediate_size=2 * a.hidden, mlp_act="silu", mlp_gated=True, rope_theta=10000.0)
    save_model(init_weights(HybridLM(cfg), seed=2), home / "init", overwrite=True)
    for f in embedded_tokenizer_path().iterdir():
        shutil.copy(f, home / "init" / f.name)
    T.train(str(home / "init"), str(home / "src"), data=str(d / "train.txt"), steps=a.src_steps,
            seq_len=a.src_seq_len, batch=a.src_batch, warmup=a.src_steps // 20, lr=a.src_lr, log_every=0,
            checkpoint_every=10**6)
    return home / "src"


def loss(path, d: Path, a) -> float:
    return round(evaluate(path, d / "valid.txt", seq_len=a.seq_len, batch=16, max_tokens=a.eval_tokens)["loss"], 4)


def tasks(path, a) -> dict:
    """{task: {acc, stderr, n}} of the shipped tasks on the checkpoint at `path` (lm-eval via transformers);
    stderr: the binomial sqrt(p (1 - p) / (n - 1)), what lm-eval reports for a mean, also under --task-limit."""
    if a.task_limit == 0:
        return {}
    out = {}
    for t, r in run_tasks(path, TASKS, limit=a.task_limit or None).items():
        p, n = r["acc"], r.get("samples") or a.task_limit
        out[t] = {"acc": round(p, 4), "stderr": round((p * (1 - p) / max(n - 1, 1)) ** 0.5, 4), "n": n}
    return out


def one(d: Path, src: Path, name: str, opts: dict, a, evals: bool = True) -> dict:
    """One hybridize run (written to d/name): {loss, kept, seconds, tokens, tasks}; the report under 'report'."""
    kw = dict(mixer=opts.pop("mixer"), data=str(d / "distill.txt"), seq_len=a.seq_len, batch=8, lr=a.lr,
              train=dict(warmup=5, log_every=0, checkpoint_every=10**6))
    t0 = time.perf_counter()
    rep = hybridize(src, d / name, **opts, **kw)
    steps = opts["steps"] + opts.get("transfer_steps", 0)
    r = {"loss": loss(d / name, d, a), "kept": rep["attention_kept"], "seconds": round(time.perf_counter() - t0, 1),
         "tokens": steps * 8 * a.seq_len, "seed": opts.get("seed", 0)}
    if evals and r["seed"] in a.task_seeds:
        r["tasks"] = tasks(d / name, a)
    print(f"{name}: {r}", flush=True)
    return r | {"report": rep}


def point(d: Path, src: Path, mixer: str, keep: int, seeds: list, a) -> dict:
    """The arms at one (mixer, kept) point: {arm: [per-seed results], init_loss, kl_per_layer}."""
    out = {"kl": [], "random": [], "even": [], "transfer": []}
    for seed in seeds:
        base = dict(mixer=mixer, seed=seed, steps=a.steps)
        ev = str(keep) in a.task_keeps.split(",")
        r = one(d, src, f"{mixer}_{keep}_kl_{seed}", dict(base, keep_attention=keep, select="kl", init="attention"), a,
                ev)
        rep = r.pop("report")
        out["kl"].append(r)
        if seed == seeds[0]:
            out["kl_per_layer"] = [round(x, 4) for x in rep["kl_per_layer"]]
            out["init_loss"] = loss(d / f"{mixer}_{keep}_kl_{seed}.init", d, a)
        for arm, opts in (("random", dict(init="random", keep_layers=r["kept"])),
                          ("even", dict(keep_attention=keep, select="even", init="attention"))):
            out[arm].append(one(d, src, f"{mixer}_{keep}_{arm}_{seed}", dict(base, **opts), a, ev))
            out[arm][-1].pop("report")
        if seed == seeds[0] and a.transfer and keep == LAYERS // 4:
            t = a.steps // 3
            out["transfer"].append(one(d, src, f"{mixer}_{keep}_transfer_{seed}", dict(
                base, init="attention", keep_layers=r["kept"], transfer_steps=t, steps=a.steps - t), a, evals=False))
            out["transfer"][-1].pop("report")
    return out


def curve(d: Path, src: Path, key: str, pt: dict, a) -> dict:
    """{init: {steps: {tokens, loss}}} at the point `key` (mixer/kept): the attention-init (kl arm) and the
    random-init arm (first seed, kl's layers) after each --curve step count; --steps: the arm already run."""
    mixer, keep = key.split("/")
    out = {}
    for init, arm in (("attention", "kl"), ("random", "random")):
        first, out[init] = pt[arm][0], {}
        for n in map(int, a.curve.split(",")):
            r = first if n == a.steps else one(d, src, f"{mixer}_{keep}_curve_{init}_{n}", dict(
                mixer=mixer, seed=first["seed"], steps=n, keep_layers=first["kept"], init=init), a, evals=False)
            out[init][n] = {"tokens": r["tokens"], "loss": r["loss"]}
    return out


@torch.no_grad()
def tokens_per_s(path, n: int, reps: int = 2) -> float:
    """One forward over one sequence of n random ids, no grad: best of `reps`, tokens / second."""
    model = load_model(path).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        model(ids)
        best = min(best, time.perf_counter() - t0)
    return round(n / best, 1)


def serving(models: dict, contexts: list) -> dict:
    """{model: {ctx: {cache bytes, kv, state, tokens/s}}} for each named checkpoint."""
    out = {}
    for name, path in models.items():
        out[name] = {}
        for n in contexts:
            m = inspect(str(path), seq_len=n)["memory_bf16"]
            out[name][n] = {"cache_bytes": m["cache"], "kv_cache": m["kv_cache"],
                            "state": m["cache"] - m["kv_cache"], "tokens_per_s": tokens_per_s(path, n)}
            print(f"serving {name} {n}: {out[name][n]}", flush=True)
    return out


def args():
    ap = argparse.ArgumentParser()
    for flag, typ, default in (("--hidden", int, 128), ("--src-steps", int, 400), ("--src-lr", float, 1e-2),
                               ("--src-seq-len", int, 128), ("--src-batch", int, 16), ("--steps", int, 30),
                               ("--seq-len", int, 128), ("--lr", float, 5e-3), ("--eval-tokens", int, 8192),
                               ("--task-limit", int, 100), ("--repeat-words", int, 24), ("--repeat-share", float, 0.5),
                               ("--distill-lines", int, 200), ("--transfer", int, 0)):
        ap.add_argument(flag, type=typ, default=default)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--task-seeds", default="0", help="the seeds whose arms get task accuracy (slow on CPU)")
    ap.add_argument("--task-keeps", default="2,1", help="the --keeps points whose arms get task accuracy")
    ap.add_argument("--mixers", default="mamba2,gdn")
    ap.add_argument("--keeps", default="2,1", help="attention layers kept (of 8): 2 is 1/4, 1 is 1/8")
    ap.add_argument("--curve", default="10,30,90", help="step counts of the loss-vs-tokens rows")
    ap.add_argument("--curve-keeps", default="2", help="the --keeps points that get loss-vs-tokens rows")
    ap.add_argument("--contexts", default="4096")
    ap.add_argument("--src-dir", help="train the source here, or reuse the one already there")
    ap.add_argument("--out", default=str(ROOT / "bench" / "hybridize.json"))
    ap.add_argument("--md", default=str(ROOT / "bench" / "results" / "hybridize.md"))
    ap.add_argument("--from-json", help="write --md from this JSON without running")
    return ap.parse_args()


def save(res: dict, a, t0: float) -> None:
    """bench/hybridize.json (atomic), stamped with the wall time so far, machine, date and command."""
    res.update(wall_s=round(time.perf_counter() - t0, 1), machine=f"{platform.machine()} {os.cpu_count()} cores (CPU, "
               f"torch threads {torch.get_num_threads()})", date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               command="nice -n 10 python bench/bench_hybridize.py " + " ".join(sys.argv[1:]))
    tmp = Path(a.out + ".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(a.out)


def main():
    a = args()
    a.task_seeds = [int(x) for x in a.task_seeds.split(",")]
    if a.from_json:
        return write_md(json.loads(Path(a.from_json).read_text()), a.md)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        reused = bool(a.src_dir) and (Path(a.src_dir) / "src" / "config.json").is_file()
        src = source(d, a)
        res = {"source_loss": loss(src, d, a), "source_tasks": tasks(src, a), "points": {}, "curve": {},
               "settings": vars(a), "source_seconds": round(time.perf_counter() - t0, 1),
               "source_reused": reused}
        print(f"source: {res['source_loss']} {res['source_tasks']}", flush=True)
        seeds = [int(x) for x in a.seeds.split(",")]
        for mixer in a.mixers.split(","):  # arms, serving, then curves: partial results survive a stop
            for keep in map(int, a.keeps.split(",")):
                res["points"][f"{mixer}/{keep}"] = point(d, src, mixer, keep, seeds, a)
                save(res, a, t0)
        models = {"source": src, **{f"{k} kl": d / f"{k.replace('/', '_')}_kl_{seeds[0]}" for k in res["points"]}}
        res["serving"] = serving(models, [int(x) for x in a.contexts.split(",")])
        save(res, a, t0)
        for keep in a.curve_keeps.split(",") if a.curve else ():  # 1/4 first: a stopped run keeps it
            for mixer in a.mixers.split(","):
                key = f"{mixer}/{keep}"
                res["curve"][key] = curve(d, src, key, res["points"][key], a)
                save(res, a, t0)
    write_md(res, a.md)


if __name__ == "__main__":
    main()
