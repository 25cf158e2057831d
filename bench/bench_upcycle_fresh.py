"""Upcycling against continued dense training on fresh data (issue 29): does an upcycled MoE beat the dense
model it came from when both keep training on tokens neither has seen?

1. Corpus: the Python sources of the packages installed beside this interpreter (its purelib), files sorted
   by path, each hashed (sha256); the manifest (paths, sizes, hashes, one digest of the list) is written.
   Split by file: a file's hash puts it in held-out (--valid-pct), pretraining or fresh (the rest, half
   each), so no file is in two splits. Files over 512 KB are skipped (generated tables).
2. A byte-level BPE tokenizer (data/make_tokenizer.py's recipe, --vocab) trained on the first 20 MB of
   the pretraining split.
3. A dense hybrid (`M-M*M-M-`, hidden 256, relu2 FFN 1024: data/embedded's shape) pretrained on
   --pretrain-tokens of the pretraining split, held-out loss read at every checkpoint ("flattened": the last
   interval gained < 1% of the first).
4. Arms on --arm-tokens of the fresh split only, same batches and order: dense continued; for each shape
   (coarse: N=8 experts of the full FFN, top-2; fine-grained: N=32 in virtual groups of G=4, top-8, the same
   active width; fine-top4: N=32, G=4, top-4, one group per token, the dense model's active width and FLOPs;
   fine-e16: fine with twice the copies, N=64) naive upcycling (R=0, exact) and Drop-Upcycling at each
   --drop-ratios. The paper's recipe (arXiv 2410.07524): learning rate reset to the pretraining peak, cosine
   decay, load-balancing loss 1e-2.
   Held-out loss at every checkpoint; training FLOPs per arm (3 x the trainer's forward count x tokens);
   the trainer's MoE figures (load balance, router entropy, same-shard expert cosine) at the end.
Writes bench/upcycle_fresh.json and .png and prints the table. Not in CI: sized for < 90 min on the 2-core
VM at the defaults; --smoke runs every step at toy sizes in a few minutes.

    python bench/bench_upcycle_fresh.py [--corpus-mb 80] [--hidden 256] [--pretrain-tokens 6M] [--arm-tokens 2M]
                                        [--drop-ratios 0.5 0.25] [--shapes coarse fine] [--routers sigmoid ...]
                                        [--jobs 2] [--work DIR [--reuse [--no-dense]]] [--smoke]
--jobs trains arms side by side (the cores split between them); --reuse keeps --work's corpus, tokenizer and
pretrained model; --no-dense adds arms to --work's earlier run, reusing its dense arms; --only picks arms by
name; --seed changes the data order.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from bench_upcycle_quality import curve  # noqa: E402
from remodel.models.config import ModelConfig  # noqa: E402
from remodel.models.load import load_model, save_model  # noqa: E402
from remodel.models.model import HybridLM, init_weights  # noqa: E402
from remodel.pipelines.commands.upcycle import upcycle  # noqa: E402
from remodel.pipelines.training.metrics import forward_flops_per_token  # noqa: E402
from remodel.pipelines.training.train import train  # noqa: E402
from remodel.upcycle.virtual_groups import ROUTER_MODES  # noqa: E402

OUT_JSON, OUT_PNG = ROOT / "bench" / "upcycle_fresh.json", ROOT / "bench" / "upcycle_fresh.png"
SHAPES = {"coarse": dict(experts=8, granularity=1, top_k=2), "fine": dict(experts=32, granularity=4, top_k=8),
          "fine-top4": dict(experts=32, granularity=4, top_k=4),  # one virtual group per token: ~1x dense FLOPs
          "fine-e16": dict(experts=64, granularity=4, top_k=8)}  # fine's active width, twice the copies (E=16)
MAX_FILE = 512 * 1024


def corpus(out: Path, mb: float, valid_pct: int) -> dict:
    """pretrain.txt / fresh.txt / valid.txt under `out` from the installed packages' .py files; -> manifest."""
    root = Path(sysconfig.get_paths()["purelib"])
    files = sorted(p for p in root.rglob("*.py") if p.is_file() and p.stat().st_size <= MAX_FILE)
    splits = {k: open(out / f"{k}.txt", "w", encoding="utf-8") for k in ("pretrain", "fresh", "valid")}
    rows, total, budget = [], 0, mb * 2**20
    for p in files:
        raw = p.read_bytes()
        h = hashlib.sha256(raw).hexdigest()
        v = int(h[:8], 16) % 100
        split = "valid" if v < valid_pct else ("pretrain" if v % 2 else "fresh")
        splits[split].write(raw.decode("utf-8", errors="replace") + "\n")
        rows.append([str(p.relative_to(root)), len(raw), h, split])
        total += len(raw)
        if total >= budget:
            break
    for f in splits.values():
        f.close()
    listing = hashlib.sha256("\n".join(f"{r[0]} {r[2]}" for r in rows).encode()).hexdigest()
    return {"root": str(root), "files": len(rows), "bytes": total, "list_sha256": listing,
            "bytes_by_split": {k: (out / f"{k}.txt").stat().st_size for k in splits}, "rows": rows}


def tokenizer(text: Path, out: Path, vocab: int) -> int:
    """data/make_tokenizer.py's byte-level BPE, trained on the first 20 MB of `text`; -> its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    eot = "<|endoftext|>"
    with open(text, encoding="utf-8") as f:
        lines = f.read(20 * 2**20).splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab, special_tokens=[eot], show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eot, eos_token=eot, pad_token=eot,
                                   unk_token=None, clean_up_tokenization_spaces=False, model_max_length=10**6)
    fast.save_pretrained(out)
    return len(fast)


def dense_model(path: Path, vocab: int, tok_dir: Path, hidden: int):
    """A fresh dense hybrid of data/embedded's shape at `hidden` (FFN 4 x hidden, hidden / 32 Mamba heads of
    64 channels: Mamba width 2 x hidden), saved with the tokenizer."""
    w = dict(hidden_size=hidden, intermediate_size=4 * hidden, mamba_num_heads=hidden // 32, mamba_head_dim=64)
    cfg = ModelConfig(vocab_size=vocab, pattern="M-M*M-M-", num_attention_heads=4, num_key_value_heads=1,
                      head_dim=64, n_groups=2, ssm_state_size=64, chunk_size=128, mlp_act="relu2", **w)
    save_model(init_weights(HybridLM(cfg), seed=0), path, aux_from=tok_dir, dtype=torch.float32)


def run_arm(start: Path, out: Path, data: Path, tokens: int, a, evals: int) -> dict:
    """Train `start` on `data` into `out`, a checkpoint every tokens/evals; -> report + held-out curve."""
    steps = max(1, tokens // (a.batch * a.seq_len))
    t = time.time()
    rep = train(start, out, data=str(data), tokens=tokens, seq_len=a.seq_len, batch=a.batch, lr=a.lr, seed=a.seed,
                lb_coeff=1e-2, checkpoint_every=max(1, steps // evals), keep_last=0, log_every=0)
    wall = time.time() - t
    blocks = valid_blocks(start, a)
    run_dir = out.parent / f"{out.name}.run"
    pts = [[0, eval_loss(start, blocks, a)]] + curve(start, run_dir, blocks, a.batch * a.seq_len, a.batch)
    model = load_model(start)
    flops = 3 * forward_flops_per_token(model, a.seq_len) * steps * a.batch * a.seq_len
    moe = (rep or {}).get("moe") or {}
    last = {lb: {k: v[-1] for k, v in d.items() if k != "step" and v} for lb, d in moe.get("layers", {}).items()}
    return {"curve": pts, "final_loss": pts[-1][1], "train_flops": flops, "wall_s": round(wall, 1),
            "params": sum(p.numel() for p in model.parameters()), "moe_final": last,
            "moe_initial": moe.get("initial")}


_BLOCKS: dict = {}


def valid_blocks(model_dir: Path, a):
    """The held-out split packed once with the run's tokenizer (every arm shares it)."""
    if "v" not in _BLOCKS:
        from remodel.pipelines.data.data import load_texts, pack
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_dir)
        _BLOCKS["v"] = pack(load_texts(str(a.work / "valid.txt")), tok, a.seq_len, max_tokens=a.valid_blocks * a.seq_len)
    return _BLOCKS["v"]


def eval_loss(model_dir: Path, blocks, a) -> float:
    from remodel.pipelines.training.evaluate import evaluate
    return evaluate(load_model(model_dir), blocks, batch=a.batch)["loss"]


def arm_name(shape: str, router: str, r: float) -> str:
    """An arm's name: shape, router (when not the sigmoid default) and drop ratio."""
    return f"{shape}-R{r:g}" if router == "sigmoid" else f"{shape}-{router}-R{r:g}"


def arms(a, dense: Path) -> dict:
    """Dense continued, then each shape x router x drop ratio upcycled from the pretrained dense model, same
    tokens; the dense model again at the costliest arm's FLOPs. --jobs workers train arms side by side;
    --no-dense takes the dense arms from --work's earlier arms_partial.json."""
    fresh, jobs, dev = a.work / "fresh.txt", {"dense": (dense, a.arm_tokens)}, {}
    moe = [(s, rt, r) for s in a.shapes for rt in a.routers for r in [0.0] + list(a.drop_ratios)]
    unknown = sorted(set(a.only) - {arm_name(*m) for m in moe})
    if unknown:
        raise SystemExit(f"--only: no such arm {unknown} in --shapes x --routers x --drop-ratios")
    moe = [m for m in moe if not a.only or arm_name(*m) in a.only]
    done = json.loads((a.work / "arms_partial.json").read_text()) if a.no_dense else {}
    if a.no_dense and "dense" not in done:
        raise SystemExit(f"--no-dense: {a.work / 'arms_partial.json'} holds no dense arm")
    _refuse_stale([p for n in (arm_name(*m) for m in moe) for p in (a.work / n, a.work / f"arm-{n}")])
    for shape, router, r in moe:
        name = arm_name(shape, router, r)
        exact = r == 0 and ROUTER_MODES[router][1]  # the unnormalised routers are close, never exact
        up = upcycle(dense, a.work / name, **SHAPES[shape], router=router, exact=exact, drop_ratio=r)
        jobs[name], dev[name] = (a.work / name, a.arm_tokens), up.get("deviation")
    fl = {k: forward_flops_per_token(load_model(p), a.seq_len) for k, (p, _) in jobs.items()}
    ratio = max(fl.values()) / fl["dense"]
    if ratio > 1:  # the dense model trained on as many FLOPs as the costliest arm: losses at equal FLOPs
        jobs["dense-equal-flops"] = (dense, int(a.arm_tokens * ratio))
    step = a.batch * a.seq_len
    for k in [k for k in ("dense", "dense-equal-flops") if k in done and k in jobs]:
        had, need = done[k]["curve"][-1][0], max(1, jobs[k][1] // step) * step
        if had == need or (k != "dense" and had > need):  # dense: the same tokens; at least the FLOPs: as many or more
            jobs.pop(k)
    res = {k: v for k, v in done.items() if k not in jobs}
    _refuse_stale([out_dir(a, k, n) for k, (_, n) in jobs.items()])
    with ProcessPoolExecutor(a.jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_die_with_parent) as pool:
        futs = {pool.submit(_arm_job, start, out_dir(a, k, n), fresh, n, a): k for k, (start, n) in jobs.items()}
        for f in as_completed(futs):
            k = futs[f]
            res[k] = f.result()
            if k in dev:
                res[k]["init_deviation"] = dev[k]
            (a.work / "arms_partial.json").write_text(json.dumps(res))  # a run cut short keeps what finished
            print(f"{k}: final held-out {res[k]['final_loss']:.4f} ({res[k]['wall_s']:.0f} s)", flush=True)
    return res


def _refuse_stale(paths: list[Path]):
    """Stop before any work when an earlier run left these outputs in --work."""
    stale = [str(p) for p in paths if p.exists()]
    if stale:
        raise SystemExit(f"--work holds an earlier run's arms ({', '.join(stale)}): use a fresh --work or remove them")


def out_dir(a, name: str, tokens: int) -> Path:
    """An arm's output folder; the equal-FLOPs dense arm's names its token count (runs differ in it)."""
    return a.work / (f"arm-{name}-{tokens}" if name == "dense-equal-flops" else f"arm-{name}")


def _die_with_parent():
    """A worker ends with the bench (Linux prctl PR_SET_PDEATHSIG): a killed run leaves no arm training."""
    try:
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)
    except OSError:
        pass


def _arm_job(start: Path, out: Path, data: Path, tokens: int, a) -> dict:
    """One arm in a worker process, with its share of the cores."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // a.jobs))
    return run_arm(start, out, data, tokens, a, a.evals)


def pretrain(a) -> tuple[dict, dict, int]:
    """Corpus, tokenizer and the pretrained dense model under a.work (-> manifest, pretraining run, vocab);
    with --reuse, a folder's earlier ones (its corpus.json and pretrain.json)."""
    if a.reuse and (a.work / "pretrain.json").is_file():
        man = json.loads((a.work / "corpus.json").read_text())
        man["rows"] = json.loads((a.work / "manifest.json").read_text())
        pre = json.loads((a.work / "pretrain.json").read_text())
        return man, pre, pre["vocab"]
    man = corpus(a.work, a.corpus_mb, a.valid_pct)
    vocab = tokenizer(a.work / "pretrain.txt", a.work / "tokenizer", a.vocab)
    dense_model(a.work / "init", vocab, a.work / "tokenizer", a.hidden)
    pre = run_arm(a.work / "init", a.work / "dense", a.work / "pretrain.txt", a.pretrain_tokens, a, a.evals)
    pre["vocab"] = vocab
    (a.work / "corpus.json").write_text(json.dumps({k: v for k, v in man.items() if k != "rows"}))
    (a.work / "manifest.json").write_text(json.dumps(man["rows"]))
    (a.work / "pretrain.json").write_text(json.dumps(pre))
    return man, pre, vocab


def plot(res: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, r in res["arms"].items():
        t, l = zip(*(r["curve"][-1:] if r.get("note") else r["curve"]))  # a noted arm: its final point only
        ax.plot([x / 1e6 for x in t], l, marker="X" if r.get("note") else "o", ms=8 if r.get("note") else 3,
                label=name + (" (final)" if r.get("note") else ""), lw=2.2 if name == "dense" else 1.2)
    ax.set_xlabel("fresh tokens trained after pretraining (M)")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title("Upcycled MoE arms vs continued dense, fresh code tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(res: dict) -> str:
    """Final held-out loss per arm against dense at equal tokens, and against the dense run given the
    costliest arm's FLOPs (its own full schedule; conservative for the cheaper arms)."""
    d, eq = res["arms"]["dense"], res["arms"].get("dense-equal-flops", res["arms"]["dense"])
    rows = ["| arm | params | final held-out loss | vs dense, equal tokens | vs dense, >= equal FLOPs | train FLOPs |",
            "|---|---|---|---|---|---|"]
    for name, r in res["arms"].items():
        same = eq["final_loss"]
        rows.append(f"| {name} | {r['params']:,} | {r['final_loss']:.4f} | {r['final_loss'] - d['final_loss']:+.4f} "
                    f"| {r['final_loss'] - same:+.4f} | {r['train_flops']:.3g} ({r['train_flops'] / d['train_flops']:.2f}x) |")
    return "\n".join(rows)


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus-mb", type=float, default=80.0)
    ap.add_argument("--valid-pct", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256, help="dense model width (data/embedded's: 256)")
    ap.add_argument("--pretrain-tokens", type=int, default=6 * 2**20)
    ap.add_argument("--arm-tokens", type=int, default=2 * 2**20)
    ap.add_argument("--drop-ratios", type=float, nargs="*", default=[0.5, 0.25])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3, help="pretraining peak, reused by every arm")
    ap.add_argument("--evals", type=int, default=8, help="held-out points per run")
    ap.add_argument("--valid-blocks", type=int, default=128, help="held-out blocks of --seq-len")
    ap.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one)")
    ap.add_argument("--routers", nargs="+", default=["sigmoid"], choices=["sigmoid", "sigmoid-raw"],
                    help="upcycle routers the nemotron_h dense model can take (sigmoid: renormalised, exact; "
                         "sigmoid-raw: the raw scores, close)")
    ap.add_argument("--only", nargs="*", default=[], help="of the shape x router x ratio arms, train only these "
                    "names (e.g. fine-sigmoid-raw-R0.5); default: all")
    ap.add_argument("--no-dense", action="store_true", help="reuse --work's dense arms (arms_partial.json)")
    ap.add_argument("--jobs", type=int, default=1, help="arms trained side by side (the cores are split)")
    ap.add_argument("--reuse", action="store_true", help="reuse --work's corpus, tokenizer and pretrained model")
    ap.add_argument("--seed", type=int, default=0, help="training seed (data order); a nonzero one writes "
                    "upcycle_fresh_seedN.json/.png")
    ap.add_argument("--smoke", action="store_true", help="toy sizes: every step in a few minutes")
    a = ap.parse_args(argv)
    if a.smoke:
        a.corpus_mb, a.vocab, a.pretrain_tokens, a.arm_tokens, a.evals = 2.0, 512, 2**15, 2**14, 2
        a.seq_len, a.batch, a.valid_blocks, a.drop_ratios, a.hidden = 64, 4, 8, [0.5], 64
    return a


def main(argv=None):
    a = _args(argv)
    t0 = time.time()
    a.work = a.work or Path(tempfile.mkdtemp(prefix="upcycle-fresh-"))
    a.work.mkdir(parents=True, exist_ok=True)
    man, pre, vocab = pretrain(a)
    gains = [x[1] - y[1] for x, y in zip(pre["curve"], pre["curve"][1:])]
    res = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
           "corpus": {k: v for k, v in man.items() if k != "rows"}, "vocab": vocab, "pretrain": pre,
           "flattened": bool(gains) and gains[-1] < 0.01 * gains[0], "arms": arms(a, a.work / "dense"),
           "wall_s": round(time.time() - t0, 1)}
    out_json, out_png = (a.work / OUT_JSON.name, a.work / OUT_PNG.name) if a.smoke else (OUT_JSON, OUT_PNG)
    if a.seed:
        out_json, out_png = (p.with_name(f"{p.stem}_seed{a.seed}{p.suffix}") for p in (out_json, out_png))
    out_json.write_text(json.dumps(res, indent=1))
    plot(res, out_png)
    print(table(res))
    print(f"wrote {out_json} and {out_png}; manifest {a.work / 'manifest.json'}; {res['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
