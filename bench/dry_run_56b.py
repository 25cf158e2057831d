"""Dry run of the 56B -> 47B workflow at full depth on CPU: score, search, prune, export, load.

The checkpoint is synthetic: the real Nemotron-H 56B layer pattern (118 layers: 54 M, 54 -, 10 *, from
/work/shared/reference/configs/nemotron-h-56b.json) with every width divided by SCALE (default 32:
hidden 8192 -> 256, FFN 32768 -> 1024, Mamba 256 x 64 -> 16 x 32 (8 groups, state 256 -> 8), attention
64/8 heads x 128 -> 8/1 x 32, vocab 131072 -> 4096) and random weights (bf16 on disk). Nearly every
parameter count scales by 1/SCALE^2 (norms, conv, A/D by 1/SCALE), so shares per layer type are kept.

The budget is the published one scaled the same way, so the depth / width trade-off is the real one:
  params  = scaled-56B params x 46.8e9 / params(56B)  (plan's 47B budget, tests/test_plan.py)
  memory  = scaled-56B memory x 116e9 / memory(56B), both at a 1M-token context scaled to 2^20 / SCALE
            tokens (KV cache then scales by 1/SCALE^2 like the weights; 116 GB is the long-context
            deployment budget under which plan ranks the published 47B shape first at full scale)
  grid    = MiniPuzzle's knobs (FFN + depth per layer type) with the width divisors divided by SCALE
            too (FFN steps 512 -> 16: 30720 / 32 = 960 stays on the grid).
Plan's #1 under that budget is the 47B class (98 layers: 45 M, 48 -, 5 *, FFN x 30/32); the search
then ranks plan's first `--top` shapes by held-out loss and distils the best `--candidates` briefly.
With random weights that ranking is noise: which shape wins says nothing about quality, the run
measures memory, time and the path end to end. Calibration and held-out text: the embedded corpus.

Also checked: infeasible budgets (below the smallest / above the source) are refused naming the
smallest and largest reachable sizes, with nothing written. Prints one JSON object.

    python bench/dry_run_56b.py [--scale 32] [--top 3] [--candidates 2] [--distill-tokens 1024] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remodel.models.errors import RemodelError  # noqa: E402
from remodel.models.hf import config_from_hf  # noqa: E402
from remodel.models.load import load_model, save_model  # noqa: E402
from remodel.models.model import HybridLM, init_weights  # noqa: E402
from remodel.models.params import count_params, memory_bytes  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path  # noqa: E402
from remodel.pipelines.commands.plan import plan  # noqa: E402

REFERENCE = Path("/work/shared/reference/configs")
SHIPPED = Path(__file__).resolve().parents[1] / "models" / "configs"
BUDGET_56B_TO_47B = 46.8e9  # plan's params budget for the published 47B
MEMORY_GB_1M = 116  # deployment memory at a 1M-token context (tests/test_plan.py)
CONTEXT_1M = 2**20
CLASS_47B = {"mamba": 9, "mlp": 6, "attention": 5}  # layers removed: 118 -> 98 (45 M, 48 -, 5 *)


def reference(name: str):
    p = REFERENCE / f"{name}.json"
    return config_from_hf(json.loads((p if p.is_file() else SHIPPED / p.name).read_text()))


def scale_widths(src, scale: int):
    """`src`'s structure (pattern, expert count, top-k) with every width / scale: Mamba heads kept a
    multiple of the groups, the query:KV head ratio kept on 1 KV head, MoE widths (expert FFN, shared
    expert, LatentMoE latent) divided too."""
    inner = src.mamba.mamba_num_heads * src.mamba.mamba_head_dim // scale
    heads = max(src.mamba.n_groups, 2 * src.mamba.mamba_num_heads // scale)
    q = src.attention.num_attention_heads * src.attention.head_dim // scale
    nq = src.attention.num_attention_heads // src.attention.num_key_value_heads  # e.g. 56B: 8 query heads on 1 KV head
    moe = {}
    if "E" in src.pattern:
        moe = dict(moe_intermediate_size=src.moe.moe_intermediate_size // scale,
                   moe_shared_expert_intermediate_size=src.moe.moe_shared_expert_intermediate_size // scale,
                   moe_latent_size=src.moe.moe_latent_size // scale if src.moe.moe_latent_size else None)
    return src.replace(vocab_size=src.vocab_size // scale, hidden_size=src.hidden_size // scale,
                       intermediate_size=src.mlp.intermediate_size // scale, mamba_num_heads=heads,
                       mamba_head_dim=inner // heads, ssm_state_size=src.mamba.d_state // scale,
                       num_attention_heads=nq, num_key_value_heads=1, head_dim=q // nq, chunk_size=64, **moe)


def scaled_config(scale: int):
    """The 56B structure with every width / scale (Mamba heads kept a multiple of its 8 groups)."""
    return scale_widths(reference("nemotron-h-56b"), scale)


def scaled_budget(cfg, scale: int) -> dict:
    src = reference("nemotron-h-56b")
    ctx = CONTEXT_1M // scale
    params = count_params(cfg)["total"] * BUDGET_56B_TO_47B / count_params(src)["total"]
    mem = memory_bytes(cfg, seq_len=ctx)["total"] * MEMORY_GB_1M * 1e9 / memory_bytes(src, seq_len=CONTEXT_1M)["total"]
    return {"params": params, "memory_gb": mem / 2**30,  # plan's --memory-gb is in GiB
            "plan_options": {"axes": ("ffn_size", "depth"), "seq_len": ctx,
                             "divisors": {"hidden_size": 256 // scale, "ffn_size": 512 // scale}}}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def counts(pattern: str, chars: str = "M-*") -> dict:
    return {c: pattern.count(c) for c in chars}


def build_checkpoint(cfg, path: Path, seed: int = 0):
    """A random-weight (std 0.02) bf16 HF checkpoint of cfg with the embedded tokenizer's files."""
    model = init_weights(HybridLM(cfg), std=0.02, seed=seed)
    save_model(model, path, family="nemotron_h", aux_from=embedded_tokenizer_path(), overwrite=True,
               dtype=torch.bfloat16)


def check_refusals(ckpt: Path, root: Path, data, cfg) -> dict:
    """search_job() on budgets below the smallest / above the source: refused, nothing written."""
    from remodel.pipelines.commands.search import search_job
    refused = {}
    for name, p in (("below", 1e3), ("above", 2.0 * count_params(cfg)["total"])):
        bad = root / f"refused-{name}"
        try:
            search_job(ckpt, bad, data, params=p, progress=False)
            refused[name] = "NOT REFUSED"
        except RemodelError as e:
            refused[name] = str(e)
        assert not bad.exists(), bad
    return refused


def check_export(out: Path, vocab: int = 2048) -> dict:
    """The searched checkpoint in transformers against ours: parameters and max |logit diff| (fp32)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_model(out)
    ids = torch.randint(0, vocab, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
    return {"transformers_params": sum(p.numel() for p in hf.parameters()),
            "max_abs_logit_diff": (ref - got).abs().max().item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=int, default=32)
    ap.add_argument("--top", type=int, default=3, help="plan candidates pruned and ranked by loss")
    ap.add_argument("--candidates", type=int, default=2, help="of those, distilled")
    ap.add_argument("--distill-tokens", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4, help="calibration sequences for scoring")
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--out", default=None, help="keep the outputs here (default: a temporary folder)")
    a = ap.parse_args()
    from remodel.pipelines.commands.score import score
    from remodel.pipelines.commands.search import search_job

    t0 = time.time()
    phases = {}

    def mark(name, t):
        phases[name] = {"seconds": round(time.time() - t, 1), "cpu_seconds_so_far": round(cpu_seconds(), 1),
                        "peak_rss_mb_so_far": round(peak_rss_mb(), 1)}

    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="dry-run-56b-"))
    root.mkdir(parents=True, exist_ok=True)
    ckpt, scores, out = root / "synthetic-56b", root / "scores", root / "searched-47b"
    train_txt, _ = embedded_corpus()
    cfg = scaled_config(a.scale)
    b = scaled_budget(cfg, a.scale)

    t = time.time()
    build_checkpoint(cfg, ckpt)
    mark("build", t)

    refused = check_refusals(ckpt, root, train_txt, cfg)  # before any heavy work: nothing may be written

    t = time.time()
    score(ckpt, train_txt, scores, samples=a.samples, seq_len=a.seq_len, batch=a.batch, loss_batches=1,
          overwrite=True, progress=False)
    mark("score", t)

    t = time.time()
    d = plan(ckpt, params=b["params"], memory_gb=b["memory_gb"], scores=scores, top=a.top, verbose=False,
             **b["plan_options"])
    plan_top = [{"rank": c["rank"], "layers": c["num_layers"], "counts": counts(c["pattern"]),
                 "ffn": c["widths"]["ffn_size"], "params": c["params"], "memory_bytes": c["memory_bytes"]}
                for c in d["candidates"]]
    first = d["candidates"][0]
    mark("plan", t)

    t = time.time()
    rep = search_job(ckpt, out, train_txt, params=b["params"], memory_gb=b["memory_gb"], plan_options=b["plan_options"],
                 top=a.top, candidates=a.candidates, distill_tokens=a.distill_tokens, scores_dir=scores,
                 seq_len=a.seq_len, batch=a.batch, eval_tokens=a.eval_tokens, overwrite=True, progress=False)
    mark("search (prune, rank, distill, export)", t)

    t = time.time()
    export = check_export(out)
    mark("transformers load + logits", t)

    pick = rep["pick"]
    res = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "scale": a.scale,
        "source": {"layers": cfg.num_layers, "counts": counts(cfg.pattern), "params": count_params(cfg)["total"],
                   "hidden": cfg.hidden_size, "ffn": cfg.mlp.intermediate_size, "vocab": cfg.vocab_size},
        "budget": {"params": int(b["params"]), "memory_bytes": int(b["memory_gb"] * 2**30),
                   "context": b["plan_options"]["seq_len"], "axes": list(b["plan_options"]["axes"])},
        "plan": {"window": d["window"], "maximal": d["maximal"], "top": plan_top,
                 "first_is_47b_class": first["layers_removed"] == CLASS_47B
                 and first["widths"]["ffn_size"] * 32 == cfg.mlp.intermediate_size * 30},
        "search": {"evaluated": len(rep["candidates"]), "distilled": rep["distilled"],
                   "table": [{k: r.get(k) for k in ("plan_rank", "loss_rank", "shape", "params", "loss",
                                                     "distilled_loss", "chosen")} for r in rep["candidates"]]},
        "pick": {"shape": pick["shape"], "layers": len(pick["pattern"]), "counts": counts(pick["pattern"]),
                 "params": pick["params"], "is_47b_class": counts(pick["pattern"]) == {"M": 45, "-": 48, "*": 5}},
        "export": export,
        "refused": refused,
        "phases": phases,
        "wall_seconds": round(time.time() - t0, 1),
        "cpu_seconds": round(cpu_seconds(), 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    print(json.dumps(res, indent=2))
    if not a.out:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
