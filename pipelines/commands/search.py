"""`remodel search`: budgeted architecture search (Minitron NAS / MiniPuzzle), scored by loss.

1. plan (pipelines/commands/plan.py) lists the candidate shapes under the budget, by arithmetic alone; an
   infeasible budget is refused here, naming the smallest and largest reachable sizes, before any
   data is read or anything written.
2. SCORES (`--scores`, or one `remodel score` run on the training part of DATA, kept as OUT/scores)
   decide which units each candidate keeps, and which layers of each type go (plan re-run with the
   scores: the least important by loss_increase).
3. plan's `top` candidates (with scores: those of lowest estimated loss, compress/estimate.py) are
   pruned in memory from the one loaded source model and ranked by held-out LM
   loss (held out: `eval_data`, else every 20th document of DATA, see pipelines.data.data.load_texts).
4. The best `candidates` are distilled for `distill_tokens` tokens each (teacher = MODEL, the
   training part of DATA, pipelines.training.train.train) and re-ranked by held-out loss.
5. The best is written to OUT (atomic: HF checkpoint in the source dtype + tokenizer files), with
   OUT/remodel_report.json (the candidate table; with `tasks`, the written pick's lm-eval accuracy)
   and OUT/search.png (parameters against loss).
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from tqdm import tqdm

from remodel.compress.prune import new_config, plan_keep, prune_model
from remodel.compress.scores import load_scores
from remodel.models.checkpoint import CheckpointReader, atomic_output_dir
from remodel.models.errors import RemodelError
from remodel.models.families import depth_units
from remodel.models.hf import config_from_hf
from remodel.models.kinds import used
from remodel.models.load import load_model, save_model
from remodel.models.params import count_params

from ..data.data import load_texts, pack
from .configs import SearchOptions
from .options import given, make
from .plan import SHORT, plan
from .report import write_report
from ..training.evaluate import evaluate
from ..distributed.runtime import check_out, load_tokenizer, source_dtype
from ..training.tasks import add_tasks, check_task_options
from ..training.train import train

PLAN_OPTIONS = {"axes", "tol", "max_width_cut", "max_depth_cut", "max_type_cut", "batch", "seq_len", "divisors"}


CLI_FLAGS = {"candidates", "distill_tokens", "top", "seq_len", "batch"}  # names that are `remodel search` flags


def _positive_int(name, v, zero_ok=False):
    if isinstance(v, bool) or not isinstance(v, int) or v < (0 if zero_ok else 1):
        flag = f" (--{name.replace('_', '-')})" if name in CLI_FLAGS else ""
        raise RemodelError(f"{name} must be a {'non-negative' if zero_ok else 'positive'} integer{flag}, got {v!r}")


def shape_str(c: dict, cfg) -> str:
    """'98 layers (45 M, 5 *, 48 -), ffn 30720' for a candidate row."""
    counts = ", ".join(f"{c['pattern'].count(k.char)} {k.char}" for k in used(cfg, mtp=False))
    w = ", ".join(f"{SHORT[a]} {b}" for a, (_, b) in c["changed"].items())
    return f"{c['num_layers']} layers ({counts})" + (f", {w}" if w else "")


def plot_search(path, rows: list, source: dict, pick: int):
    """Parameters against held-out loss: after pruning (all), after distillation (the distilled ones)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([r["params"] / 1e6 for r in rows], [r["loss"] for r in rows], s=22, color="tab:blue",
               label="pruned (no training)")
    dist = [r for r in rows if r.get("distilled_loss") is not None]
    for r in dist:
        ax.annotate("", (r["params"] / 1e6, r["distilled_loss"]), (r["params"] / 1e6, r["loss"]),
                    arrowprops=dict(arrowstyle="->", color="gray", lw=0.8))
    if dist:
        ax.scatter([r["params"] / 1e6 for r in dist], [r["distilled_loss"] for r in dist], s=30, marker="^",
                   color="tab:green", label="after distillation", zorder=3)
    best = rows[pick]
    y = best["distilled_loss"] if best.get("distilled_loss") is not None else best["loss"]
    ax.scatter([best["params"] / 1e6], [y], s=160, marker="*", color="tab:red", label="pick", zorder=4)
    ax.axhline(source["loss"], color="black", ls="--", lw=0.8, label=f"source ({source['params'] / 1e6:.2f}M)")
    ax.set_xlabel("parameters (M)")
    ax.set_ylabel("held-out LM loss (nats/token)")
    ax.set_title("search: candidates under the budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def search_job(model_dir=None, out=None, data=None, opts: SearchOptions | None = None, **kw) -> dict:
    """Search MODEL's pruned shapes under the budget and write the best to OUT (see the module doc); the options
    are SearchOptions (pipelines/commands/configs.py: each one's meaning and default), given as `opts` or by name.

    params / active_params / memory_gb: the budgets (plan's); top: how many of plan's candidates are
    pruned and evaluated; candidates: how many of those (best by loss) are distilled; plan_options:
    extra plan() keywords (axes, tol, seq_len / batch of the memory budget, divisors, max cuts).
    `scores_dir` is an alias of scores. tasks / task_dir / task_limit: lm-eval tasks run on the written pick,
    in the report as `tasks` (pipelines/training/tasks.py). -> the report."""
    o = make(SearchOptions, opts, {"scores_dir": "scores"}, **given(model=model_dir, out=out, data=data), **kw)
    return _search(o)


def _search(o: SearchOptions) -> dict:
    t0 = time.time()
    data, eval_data, seq_len, batch, progress = o.data, o.eval_data, o.seq_len, o.batch, o.progress
    model_dir, out = Path(o.model), Path(o.out)
    _check_numbers(o)
    budget = dict(params=o.params, active_params=o.active_params, memory_gb=o.memory_gb)
    cfg, family, popts, checked = _check_all(o, model_dir, out, budget)
    tok = load_tokenizer(model_dir)
    settings = dict(seq_len=seq_len, batch=batch, lr=o.lr, seed=o.seed, progress=progress)
    with atomic_output_dir(out, overwrite=o.overwrite, inputs=[model_dir]) as tmp:
        work = tmp / "work"
        eval_blocks = _split_data(data, eval_data, tok, cfg, model_dir, work, seq_len, o.eval_tokens)
        used_scores, scores_note = _scores(model_dir, o.scores, work, tmp, out, o.score_samples, settings)
        tensors, _ = load_scores(used_scores)
        d = _candidates(o, model_dir, cfg, family, budget, used_scores, tensors, popts)
        model = load_model(model_dir)
        src, rows = _rank_candidates(model, cfg, family, tensors, d["candidates"], eval_blocks, batch, progress)
        top_k = sorted(range(len(rows)), key=lambda i: rows[i]["loss_rank"])[:o.candidates]
        if o.distill_tokens:
            for i in top_k:  # written first (fp32), so the source model is freed before the teacher loads
                save_model(prune_model(model, plan_keep(cfg, tensors, rows[i]["prune_targets"], family)),
                           work / f"cand{i}", family=family, aux_from=model_dir)
            del model
            pick, best = _distill_best(rows, top_k, model_dir, work, eval_blocks, o.distill_tokens, settings)
        else:
            pick = top_k[0]
            best = prune_model(model, plan_keep(cfg, tensors, rows[pick]["prune_targets"], family))
            del model
        rows = [dict(r, chosen=i == pick) for i, r in enumerate(rows)]
        _write_best(best, tmp, work, family, model_dir)
        plot_search(tmp / "search.png", rows, src, pick)
        report = {
            "command": "search", "model": str(model_dir), "data": str(data),
            "eval_data": str(eval_data) if eval_data is not None else "every 20th document of data",
            "output": str(out), "scores": scores_note, "family": family,
            "budgets": d["budgets"], "plan": d["plan"],
            "plan_options": popts, "seq_len": seq_len, "batch": batch, "eval_tokens": int(eval_blocks.numel()),
            "distill_tokens": o.distill_tokens, "distilled": len(top_k) if o.distill_tokens else 0, "lr": o.lr,
            "source": {"params": src["params"], "loss": src["loss"], "ppl": src["ppl"], "pattern": cfg.pattern},
            "pick": {k: rows[pick].get(k) for k in PICK_KEYS},
            "candidates": rows, "plot": "search.png", "seconds": round(time.time() - t0, 2),
        }
        write_report(tmp, add_tasks(report, tmp, checked, o.task_limit))  # the written pick's accuracy
    if progress:
        _print_pick(rows[pick], src, o.distill_tokens, report)
    return report


PICK_KEYS = ("plan_rank", "loss_rank", "shape", "params", "active_params", "pattern", "widths", "loss", "ppl",
             "distilled_loss", "distilled_ppl")
ROW_KEYS = ("params", "active_params", "memory_bytes", "widths", "changed", "layers_removed", "num_layers",
            "pattern", "drop_layers", "prune_targets")


def _candidates(o: SearchOptions, model_dir: Path, cfg, family: str, budget: dict, scores, tensors, popts) -> dict:
    """{"candidates": rows to rank, "budgets", "plan": what the report says of them}: plan's under the budget,
    or PLAN's (--plan: all, or --candidate's; layers placed by the scores, as `prune --plan` places them)."""
    if o.plan is None:
        d = plan(model_dir, **budget, scores=scores, top=o.top, verbose=o.progress, **popts)
        keys = ("axes", "space", "depth", "grid", "window", "maximal", "reachable", "depth_metric", "tol", "note")
        return {"candidates": d["candidates"], "budgets": d["budgets"], "plan": {k: d[k] for k in keys}}
    from remodel.compress.prune import depth_metric

    from .plan_file import plan_rows
    s = tensors[depth_metric(tensors)].double().tolist()
    unit_scores = [sum(s[i] for i in u) for u in depth_units(cfg, family)]
    rows = plan_rows(o.plan, cfg, family, o.candidate, unit_scores)
    return {"candidates": rows, "budgets": None, "plan": {"file": str(o.plan), "candidate": o.candidate}}


def _check_numbers(o: SearchOptions):
    _positive_int("candidates", o.candidates)
    _positive_int("distill_tokens", o.distill_tokens, zero_ok=True)
    for name in ("top", "seq_len", "batch", "score_samples", "eval_tokens"):
        _positive_int(name, getattr(o, name))
    if not (isinstance(o.lr, (int, float)) and o.lr > 0):
        raise RemodelError(f"lr must be > 0, got {o.lr!r}")


def _check_all(o: SearchOptions, model_dir: Path, out: Path, budget: dict):
    """-> (cfg, family, plan options, check_task_options' result) once the inputs, the budget (plan's refusals
    name the smallest and largest reachable sizes) and the tasks (lm-eval, names, --task-dir) pass; nothing
    is written before."""
    cfg, family = _check_inputs(model_dir, out, o.data, o.eval_data, o.scores, o.overwrite)
    popts = _plan_options(o.plan_options)
    if o.plan is None:
        if o.candidate is not None:
            raise RemodelError("--candidate picks a row of --plan PLAN; give --plan too")
        plan(model_dir, **budget, scores=o.scores, top=o.top, verbose=False, **popts)  # (the file: its family's space)
    else:
        given_too = [f"--{k.replace('_', '-')}" for k, v in budget.items() if v is not None] + \
            (["plan_options"] if popts else [])
        if given_too:
            raise RemodelError(f"--plan sets the candidates; drop {', '.join(given_too)}")
        from .plan_file import plan_rows
        from .prune import check_scores_match
        plan_rows(o.plan, cfg, family, o.candidate)  # the file and every row checked before anything is written
        if o.scores is not None:  # (without --plan, plan() checks them)
            check_scores_match(cfg, load_scores(o.scores)[1], o.scores)
    return cfg, family, popts, check_task_options(o.tasks, o.task_dir, o.task_limit, o.trust_task_code)


def _check_inputs(model_dir: Path, out: Path, data, eval_data, scores_dir, overwrite: bool):
    """-> (cfg, family) of MODEL, once every input exists and OUT may be written."""
    if not model_dir.is_dir():
        raise RemodelError(f"model not found: {model_dir}")
    with CheckpointReader(model_dir) as reader:  # config and safetensors headers checked here
        hf = reader.config
    cfg, family = config_from_hf(hf, source=model_dir / "config.json"), hf.get("model_type")
    for d in (data,) + ((eval_data,) if eval_data is not None else ()):
        if not Path(d).expanduser().exists():
            raise RemodelError(f"data not found: {d}")
    if scores_dir is not None and not Path(scores_dir).exists():
        raise RemodelError(f"scores not found: {scores_dir}")
    check_out(out, overwrite, [model_dir])
    return cfg, family


def _plan_options(plan_options) -> dict:
    popts = dict(plan_options or {})
    bad = sorted(set(popts) - PLAN_OPTIONS)
    if bad:
        raise RemodelError(f"unknown plan options {bad} (known: {', '.join(sorted(PLAN_OPTIONS))})")
    return popts


def _split_data(data, eval_data, tok, cfg, model_dir, work: Path, seq_len: int, eval_tokens: int):
    """-> the held-out token blocks; the training part is saved to WORK/train (calibration and
    distillation never see the held-out part)."""
    if eval_data is not None:
        train_ds, valid_ds = load_texts(data), load_texts(eval_data)
    else:
        train_ds, valid_ds = load_texts(data, split_valid=True)
    eval_blocks = pack(valid_ds, tok, seq_len, max_tokens=eval_tokens)
    if int(eval_blocks.max()) >= cfg.vocab_size:
        raise RemodelError(f"the tokenizer in {model_dir} gives token id {int(eval_blocks.max())} but the "
                           f"model's vocab_size is {cfg.vocab_size}")
    train_ds.save_to_disk(str(work / "train"))
    return eval_blocks


def _scores(model_dir, scores_dir, work: Path, tmp: Path, out: Path, samples: int, settings: dict):
    """-> (SCORES dir used, what the report names): the given one, or a scoring run on WORK/train kept
    as OUT/scores."""
    if scores_dir is not None:
        return Path(scores_dir), str(scores_dir)
    from .score import score
    score(model_dir, work / "train", tmp / "scores", samples=samples, seq_len=settings["seq_len"],
          batch=settings["batch"], progress=settings["progress"])
    return tmp / "scores", str(out / "scores")


def _rank_candidates(model, cfg, family, tensors, cands, eval_blocks, batch, progress):
    """Prunes each plan candidate in memory and evaluates it: -> (the source's figures, candidate rows
    with their loss_rank)."""
    src = {"params": count_params(cfg)["total"], **evaluate(model, eval_blocks, batch=batch)}
    rows = []
    for c in tqdm(cands, desc="candidates", unit="cand", disable=not progress):
        keep = plan_keep(cfg, tensors, c["prune_targets"], family)
        if count_params(new_config(cfg, keep))["total"] != c["params"]:
            raise AssertionError(f"pruned model of candidate {c['rank']} differs from the plan")
        ev = evaluate(prune_model(model, keep), eval_blocks, batch=batch)
        rows.append({"plan_rank": c["rank"], "shape": shape_str(c, cfg), **{k: c[k] for k in ROW_KEYS},
                     "estimate": c.get("estimate"),
                     "loss": ev["loss"], "ppl": ev["ppl"]})
    by_loss = sorted(range(len(rows)), key=lambda i: (rows[i]["loss"], rows[i]["plan_rank"]))
    for k, i in enumerate(by_loss):
        rows[i]["loss_rank"] = k + 1
    return src, rows


def _distill_best(rows, top_k, model_dir, work: Path, eval_blocks, distill_tokens, settings: dict):
    """Distils the `top_k` candidates (saved as WORK/cand<i>) from MODEL and re-ranks them by held-out
    loss: -> (pick, its model)."""
    s = settings
    for i in tqdm(top_k, desc="distill candidates", unit="cand", disable=not s["progress"]):
        rep = train(work / f"cand{i}", work / f"cand{i}-distilled", work / "train", teacher_dir=model_dir,
                    tokens=distill_tokens, seq_len=s["seq_len"], batch=s["batch"], lr=s["lr"], seed=s["seed"],
                    log_every=0, checkpoint_every=10**9, keep_last=1)
        ev = evaluate(work / f"cand{i}-distilled", eval_blocks, batch=s["batch"])
        rows[i].update(distilled_loss=ev["loss"], distilled_ppl=ev["ppl"], distill_steps=rep["steps"],
                       distill_tokens=rep["tokens"], distill_seconds=round(rep["time_s"], 2))
    pick = min(top_k, key=lambda i: (rows[i]["distilled_loss"], rows[i]["loss_rank"]))
    return pick, load_model(work / f"cand{pick}-distilled")


def _write_best(best, tmp: Path, work: Path, family: str, model_dir):
    """The picked model into OUT (in the source dtype, with the tokenizer files); WORK removed."""
    save_model(best, work / "best", family=family, aux_from=model_dir, dtype=source_dtype(model_dir))
    for f in (work / "best").iterdir():
        f.rename(tmp / f.name)
    shutil.rmtree(work)


def _print_pick(chosen: dict, src: dict, distill_tokens: int, report: dict):
    after = f", {chosen['distilled_ppl']:.2f} after distillation" if distill_tokens else ""
    n, L = report["eval_tokens"], report["seq_len"]
    print(f"search: picked {chosen['shape']} ({chosen['params']:,} params), held-out ppl "
          f"{chosen['ppl']:.2f} pruned{after}; source {src['ppl']:.2f} (each on the same {n:,} tokens, "
          f"{n // L} x {L}, of {report['eval_data']})")
