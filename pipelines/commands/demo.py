"""`remodel demo`: the main jobs on the embedded checkpoint and corpus, offline, on CPU.

inspect -> eval -> convert round trip -> score -> prune to about half -> distill -> upcycle the
teacher to a MoE -> reload the results in transformers and compare logits -> a before/after table
(parameters, perplexity, tokens/s; with the `eval` extra, the accuracy on the shipped lm-eval tasks
remodel_cloze and remodel_nextphrase). OUT is replaced only when it is a previous demo's output.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from remodel.models.checkpoint import CheckpointReader, atomic_output_dir
from remodel.models.errors import RemodelError
from remodel.models.load import load_config
from remodel.models.params import count_params

from ..data.data import DATA_DIR, embedded_corpus, embedded_moe_path
from .report import write_report

EMBEDDED = DATA_DIR / "embedded"


def _row(name, path, ev, note="", tasks=None):
    """A table row; tasks: _tasks' runner (None without lm-eval) adds the shipped tasks' accuracy."""
    p = count_params(load_config(path))
    r = {"model": name, "params": p["total"], "active": p["active"], "ppl": ev["ppl"],
         "ppl_on": {k: ev[k] for k in ("data", "tokens", "sequences", "seq_len")},  # the tokens the ppl is on
         "tokens_per_s": ev["tokens_per_s"], "note": note}
    return {**r, **tasks(path)} if tasks else r


def _tasks(quick: bool):
    """path -> {cloze: acc, nextphrase: acc_norm} on the shipped tasks (pipelines/training/tasks.py), or
    None when the optional lm-eval is not installed (the demo then shows perplexity only)."""
    from ..training.tasks import check_tasks, run_tasks
    try:
        checked = check_tasks(["remodel_cloze", "remodel_nextphrase"])
    except RemodelError:
        return None

    def run(path):
        r = run_tasks(path, [], limit=20 if quick else None, checked=checked)
        return {"cloze": r["remodel_cloze"]["acc"], "nextphrase": r["remodel_nextphrase"]["acc_norm"]}
    return run


def _table(rows) -> str:
    acc = "cloze" in rows[0]
    head = f"{'model':<22}{'params':>12}{'active':>12}{'ppl':>10}{'tok/s':>10}" + \
        (f"{'cloze':>7}{'phrase':>7}" if acc else "") + "  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:<22}{r['params']:>12,}{r['active']:>12,}{r['ppl']:>10.2f}"
                     f"{r['tokens_per_s']:>10,.0f}" + (f"{r['cloze']:>7.2f}{r['nextphrase']:>7.2f}" if acc else "")
                     + f"  {r['note']}")
    on = rows[0]["ppl_on"]
    lines.append(f"ppl: next-token perplexity of each model on the same {on['tokens']:,} tokens "
                 f"({on['sequences']} x {on['seq_len']}) of {on['data']}")
    return "\n".join(lines)


def _previous_demo(out: Path) -> bool:
    try:
        return json.loads((out / "remodel_report.json").read_text()).get("command") == "demo"
    except (OSError, ValueError):
        return False


def _round_trip(src, work: Path) -> int:
    """HF -> remodel -> HF through `convert`; every tensor must come back bit-identical."""
    from .convert import convert
    convert(src, work / "roundtrip")
    with CheckpointReader(src) as a, CheckpointReader(work / "roundtrip") as b:
        if sorted(a.keys()) != sorted(b.keys()):
            raise RemodelError("convert round trip changed the tensor names")
        for k in a.keys():
            if not torch.equal(a.get(k), b.get(k)):
                raise RemodelError(f"convert round trip changed tensor {k}")
        return len(a.keys())


def _hf_logit_diff(path, ids) -> float:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    from remodel.models.load import load_model
    from ..training.fp8 import import_torchao_quietly
    import_torchao_quietly()  # transformers' loading imports torchao, which prints CUDA-library notices
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its "install causal_conv1d / mamba_ssm" notice is about CUDA kernels
    try:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=False,
                                                  local_files_only=True).eval()
        ours = load_model(path).float().eval()
        with torch.no_grad():
            return (hf(ids).logits - ours(ids)).abs().max().item()
    finally:
        hf_logging.set_verbosity(level)


def _check_demo_out(out: Path, overwrite: bool):
    """OUT is replaced only when it is empty, a previous demo's output, or --overwrite says so."""
    if out.exists() and any(out.iterdir()) and not overwrite and not _previous_demo(out):
        raise RemodelError(f"{out}: exists, is not empty and is not a previous demo output; "
                           "pass --overwrite or choose another --out")


def _check_in_transformers(work: Path, vocab_size: int) -> dict:
    """The distilled and upcycled models loaded by transformers give our logits (max abs diff <= 1e-3)."""
    ids = torch.randint(0, vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    hf_ok = {}
    for name in ("distilled", "moe"):
        d = _hf_logit_diff(work / name, ids)
        hf_ok[name] = {"max_abs_logit_diff_vs_remodel": d}
        print(f"      {name}: transformers logits - remodel logits, max abs {d:.1e}")
        if not d <= 1e-3:
            raise RemodelError(f"{name}: transformers and remodel logits differ by {d:.2e}")
    return hf_ok


def demo(out="remodel-demo", quick: bool = False, overwrite: bool = False) -> dict:
    """Runs the steps of the module doc into OUT and prints the before/after table; -> the report."""
    from ..training.evaluate import evaluate
    from .prune import prune
    from .score import score
    from ..training.train import train
    from .upcycle import upcycle

    torch.manual_seed(0)
    t0 = time.time()
    train_txt, valid_txt = embedded_corpus()
    cfg = load_config(EMBEDDED)
    eval_tokens = 8192 if quick else 32768
    ev = lambda m: evaluate(m, valid_txt, seq_len=256, batch=8, max_tokens=eval_tokens)  # noqa: E731
    tasks = _tasks(quick)
    out = Path(out)
    _check_demo_out(out, overwrite)
    with atomic_output_dir(out, overwrite=True) as tmp:
        work = Path(tmp)
        print(f"[1/6] embedded model: {cfg.pattern}, hidden {cfg.hidden_size}, "
              f"{count_params(cfg)['total']:,} parameters")
        rows = [_row("embedded (teacher)", EMBEDDED, ev(EMBEDDED), "shipped bf16 checkpoint", tasks)]
        n = _round_trip(EMBEDDED, work)
        print(f"      convert round trip HF -> remodel -> HF: {n} tensors identical")

        print("[2/6] scoring every prunable unit on calibration text")
        score(EMBEDDED, train_txt, work / "scores", samples=32 if quick else 128, seq_len=256, batch=8)

        print("[3/6] pruning to about half the parameters (FFN, Mamba heads, hidden)")
        targets = dict(ffn_size=cfg.mlp.intermediate_size // 2, mamba_heads=cfg.mamba.mamba_num_heads // 2,
                       hidden_size=cfg.hidden_size * 3 // 4)
        prune(EMBEDDED, work / "pruned", scores_dir=work / "scores", **targets)
        rows.append(_row("pruned", work / "pruned", ev(work / "pruned"), "no retraining", tasks))

        steps = 30 if quick else 120
        print(f"[4/6] distilling the pruned student from the teacher ({steps} steps)")
        train(work / "pruned", work / "distilled", data=train_txt, teacher_dir=EMBEDDED, steps=steps,
              seq_len=256, batch=8, lr=1e-3, warmup=5, checkpoint_every=10**9, seed=0)
        rows.append(_row("pruned + distilled", work / "distilled", ev(work / "distilled"),
                         f"{steps * 8 * 256:,} tokens of KD", tasks))

        print("[5/6] upcycling the dense teacher to a fine-grained MoE (8 experts, G=4, top-4)")
        upcycle(EMBEDDED, work / "moe", experts=8, granularity=4, top_k=4, router="sigmoid", exact=True)
        rows.append(_row("upcycled MoE", work / "moe", ev(work / "moe"), "exact at init (G=4 virtual groups)", tasks))
        if embedded_moe_path().is_dir():  # the same upcycle, trained further and shipped: one more eval
            rows.append(_row("embedded MoE (trained)", embedded_moe_path(), ev(embedded_moe_path()),
                             "shipped data/embedded_moe: upcycled + trained", tasks))

        print("[6/6] loading the results in transformers (no trust_remote_code), comparing logits")
        hf_ok = _check_in_transformers(work, cfg.vocab_size)
        table = _table(rows)
        print("\n" + table)
        report = {"command": "demo", "rows": rows, "targets": targets, "loaded_in_transformers": hf_ok,
                  "round_trip_tensors_identical": n,
                  "seconds": round(time.time() - t0, 1)}
        (work / "table.txt").write_text(table + "\n")
        write_report(work, report)
    print(f"\nwrote {out}/ (roundtrip, scores, pruned, distilled, moe, table.txt) in {time.time() - t0:.0f} s")
    return report
