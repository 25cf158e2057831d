"""remodel command line: parses arguments and calls pipelines/; nothing else lives here."""
from __future__ import annotations

import argparse
import functools
import os
import sys

if __package__ in (None, "") and "remodel" not in sys.modules:  # `python cli.py` (also under torchrun)
    import importlib.util
    if importlib.util.find_spec("remodel") is None:  # a checkout that was never installed: its folders
        import types                                   # are the remodel package
        sys.modules["remodel"] = types.ModuleType("remodel")
        sys.modules["remodel"].__path__ = [os.path.dirname(os.path.abspath(__file__))]

# the argument types of counts (47B) and index lists (3,7), named here for tests (no torch import)
from remodel.pipelines.commands.options import parse_count as _count, parse_ints as _ints  # noqa: E402


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every option's default; a required option says "(required)" instead of None."""

    def _get_help_string(self, action):
        if action.required and action.option_strings:
            return (action.help or "") + " (required)"
        if action.default is None and "None" in (action.help or ""):
            return action.help  # the line already says what None means
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line too (`remodel CMD: error: ... (see --help)`), from rank 0
    only under torchrun, exit 2; the subcommand parsers inherit it."""

    raising = False  # True: a usage error is raised as a RemodelError (a recipe's steps, checked before any runs)

    def error(self, message):
        if self.raising:
            from remodel.models.errors import RemodelError
            raise RemodelError(message)
        if _lead():
            print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _lead() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 or int(os.environ.get("RANK", "0") or 0) == 0


def _train_flags(p, distill: bool):
    """The TrainConfig options (pipelines.training.train_config: one place for every default and help line)."""
    from remodel.pipelines.training.train_config import add_train_flags
    p.add_argument("--data", required=True, help="training data: text file/folder, .jsonl/.json, .parquet, "
                   "save_to_disk folder (tokenized once into a cached token set), a token set from `remodel "
                   "tokenize`, or a blend 'W1 A W2 B ...' of those")
    add_train_flags(p, distill, count=_count)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="remodel", description="Shrink (prune + distill) and grow (MoE upcycling) "
                                 "hybrid Mamba-Transformer and Llama-family models; Hugging Face in and out.")
    sub = ap.add_subparsers(dest="command", required=True)
    # every command's --help shows each option's default (a parser may still pass its own formatter)
    sub.add_parser = functools.partial(sub.add_parser, formatter_class=_Help)
    for name in TYPED:
        if name in ("distill", "train", "run"):
            {"distill": _add_distill, "train": _add_train, "run": _add_run}[name](sub)
        else:
            _typed(sub, name)
    return ap


TYPED = {"demo": "the main job on the embedded checkpoint and corpus, offline",
         "inspect": "architecture, pattern, exact parameter counts, bytes",
         "convert": "import/export through the shared model definition (MXFP4 experts read dequantized, written bf16 / fp32)",
         "score": "activation importance of every prunable unit", "prune": "structured pruning to a target shape",
         "plan": "candidate architectures under a budget (no weights needed)",
         "search": "budgeted architecture search (Minitron / MiniPuzzle)",
         "distill": None, "train": None,  # TrainConfig's (pipelines/training/train_config.py)
         "upcycle": "dense -> MoE upcycling (virtual groups, weight scaling)",
         "hybridize": "dense attention -> hybrid (Mamba-2 layers from the attention weights)",
         "tokenize": "tokenize DATA once into a token set that train/distill read from disk",
         "eval": "perplexity and tokens/s, and lm-eval tasks (--tasks)",
         "run": "a recipe: named steps of the commands above, resumable (README \"Recipes\")"}  # command -> --help line


def _typed(sub, name: str):
    """Command `name`, whose parser is generated from its options dataclass (pipelines/commands/configs.py:
    every flag's default and help line)."""
    from remodel.pipelines.commands.configs import COMMAND_OPTIONS
    from remodel.pipelines.commands.options import add_flags
    add_flags(sub.add_parser(name, help=TYPED[name]), COMMAND_OPTIONS[name])


def _add_distill(sub):
    p = sub.add_parser("distill", help="knowledge distillation (teacher -> student); give --steps or --tokens",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--teacher", required=True, help="teacher checkpoint directory (frozen)")
    p.add_argument("--student", required=True, help="student checkpoint directory (the model trained)")
    p.add_argument("out", help="output directory of the final HF checkpoint (checkpoints go to OUT.run/)")
    _train_flags(p, True)


def _add_train(sub):
    p = sub.add_parser("train", help="plain LM training / continued pretraining; give --steps or --tokens",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", help="checkpoint directory (the model trained)")
    p.add_argument("out", help="output directory of the final HF checkpoint (checkpoints go to OUT.run/)")
    _train_flags(p, False)


def _add_run(sub):
    from remodel.pipelines.commands.options import add_flags
    from remodel.pipelines.commands.recipe import RunOptions
    add_flags(sub.add_parser("run", help=TYPED["run"]), RunOptions)


def _dtype(name):
    import torch
    return getattr(torch, name) if name else None


def _run_demo(a):
    from remodel.pipelines.commands.demo import demo
    o = _opts(a)
    return demo(o.out, quick=o.quick, overwrite=o.overwrite)


def _run_inspect(a):
    from remodel.pipelines.commands.inspection import format_inspect, inspect
    d = inspect(a.model)
    from remodel.pipelines.commands.report import strict_json
    print(strict_json(d, a.command) if a.json else format_inspect(d))
    _check_inspected(d)


def _check_inspected(d: dict):
    from remodel.models.errors import RemodelError
    bad = (d.get("checkpoint") or {}).get("config_mismatches")
    if bad:
        raise RemodelError(f"{len(bad)} tensor(s) disagree with config.json, e.g. {bad[0]}")


def _inspect_report(a) -> dict:
    from remodel.pipelines.commands.inspection import inspect
    d = inspect(a.model)
    _check_inspected(d)
    return d


def _run_convert(a):
    from remodel.pipelines.commands.convert import convert
    o = _opts(a)
    return convert(o.model, o.out, to=o.to, overwrite=o.overwrite, dtype=_dtype(o.dtype))


def _opts(a):
    """The options dataclass of a typed command, from its parsed arguments."""
    from remodel.pipelines.commands.configs import COMMAND_OPTIONS
    from remodel.pipelines.commands.options import from_args
    return from_args(COMMAND_OPTIONS[a.command], a)


def _run_score(a):
    from remodel.pipelines.commands.score import score
    return score(opts=_opts(a))


def _run_prune(a):
    from remodel.pipelines.commands.prune import prune
    return prune(opts=_opts(a))


def _plan_report(a) -> dict:
    from remodel.pipelines.commands.plan import plan
    return plan(opts=_opts(a))


def _run_plan(a):
    r = _plan_report(a)
    if a.json:
        from remodel.pipelines.commands.report import strict_json
        print(strict_json(r, a.command))


def _run_search(a):
    from remodel.pipelines.commands.search import search_job
    return search_job(opts=_opts(a))


def _run_training(a):
    from remodel.pipelines.training.train_config import config_from_args
    from remodel.pipelines.training.trainer import run as run_training
    if a.command == "distill":
        return run_training(config_from_args(a, student_dir=a.student, teacher_dir=a.teacher, out=a.out))
    return run_training(config_from_args(a, student_dir=a.model, out=a.out))


def _run_upcycle(a):
    from remodel.pipelines.commands.upcycle import upcycle
    return upcycle(opts=_opts(a))


def _run_hybridize(a):
    from remodel.pipelines.commands.hybridize import hybridize
    return hybridize(opts=_opts(a))


def _eval_report(a) -> dict:
    from remodel.pipelines.commands.evaluation import TaskRequest, eval_job
    o = _opts(a)
    return eval_job(o.model, o.data, seq_len=o.seq_len, batch=o.batch, max_tokens=o.max_tokens,
                    request=TaskRequest(o.tasks, o.task_dir, o.limit, o.trust_task_code))


def _run_eval(a):
    r = _eval_report(a)
    _show_tasks(r)
    if "ppl" in r and _lead():
        from remodel.pipelines.commands.summary import eval_summary
        print(eval_summary(r), file=sys.stderr)  # the perplexity beside its tokens
    from remodel.pipelines.commands.report import strict_json
    print(strict_json(r, a.command))


def _show_tasks(r):
    """The lm-eval table of a report with `tasks` (eval, prune, search), on stderr beside the JSON."""
    if isinstance(r, dict) and "tasks" in r:
        from remodel.pipelines.training.tasks import format_tasks
        print(format_tasks(r["tasks"]), file=sys.stderr)


def _show_summary(r):
    """The report's one-line human summary (parameters before / after, deviation), on stderr beside the JSON."""
    from remodel.pipelines.commands.summary import summary
    line = summary(r)
    if line and _lead():
        print(line, file=sys.stderr)


def _run_tokenize(a):
    from remodel.pipelines.data.tokens import tokenize, tokenize_megatron
    o = _opts(a)
    run = tokenize_megatron if o.format == "megatron" else tokenize
    return run(o.data, o.out, o.tokenizer, num_proc=o.num_proc, doc_split=o.doc_split, eos=o.eos,
               overwrite=o.overwrite, shard_tokens=o.shard_tokens)


def _run_recipe(a):
    """`remodel run`: the recipe's steps parsed by their commands' own parsers (errors raised, not exiting) and
    checked as main checks them, then run in this process through _step_report."""
    from remodel.pipelines.commands.options import from_args
    from remodel.pipelines.commands.recipe import Commands, RunOptions, run_recipe
    ap = build_parser()
    for p in (ap, *_subparsers(ap).values()):
        p.raising = True
    return run_recipe(from_args(RunOptions, a), Commands(ap, functools.partial(check_options, ap), _step_report))


def _step_report(a) -> dict | None:
    """One recipe step: command `a` run as main runs it; eval, plan and inspect return their report unprinted."""
    return {"eval": _eval_report, "plan": _plan_report, "inspect": _inspect_report}.get(a.command, run)(a)


def _subparsers(ap: argparse.ArgumentParser) -> dict:
    return next(x for x in ap._actions if isinstance(x, argparse._SubParsersAction)).choices


COMMANDS = {"demo": _run_demo, "inspect": _run_inspect, "convert": _run_convert, "score": _run_score,
            "prune": _run_prune, "plan": _run_plan, "search": _run_search, "distill": _run_training,
            "train": _run_training, "upcycle": _run_upcycle, "eval": _run_eval, "tokenize": _run_tokenize,
            "hybridize": _run_hybridize, "run": _run_recipe}


def run(a) -> object:
    """Runs the parsed command `a`; -> its result (a report dict, or None when it printed its own output)."""
    return COMMANDS[a.command](a)


def _options(command: str | None = None):
    """OPTIONS: (every numeric option of the commands (argparse dest) -> its Check, the same for train /
    distill), checked right after parse_args (before any heavy work). Each command's rules are its options
    dataclass' (pipelines/commands/configs.py), train/distill's the TrainConfig fields' own checks
    (pipelines.training.train_config: the same rules make_config applies to the Python API). With `command`:
    -> that command's rules alone."""
    from remodel.pipelines.commands.configs import COMMAND_OPTIONS
    from remodel.pipelines.commands.options import rules
    from remodel.pipelines.training.train_config import CHECKS
    if command in COMMAND_OPTIONS:
        return rules(COMMAND_OPTIONS[command])
    common = {k: v for cls in COMMAND_OPTIONS.values() for k, v in rules(cls).items()}
    return common, {**common, **CHECKS}


def check_options(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """One-line RemodelError for the first numeric option outside its rule (OPTIONS), naming the flag."""
    from remodel.models.errors import RemodelError
    from remodel.compress.baselines import DATA_METHODS
    if a.command == "score" and a.method in DATA_METHODS and not a.data:
        raise RemodelError(f"--data is required for --method {a.method}")
    if a.command == "run":  # no numeric option; each step is checked here when the recipe is read
        return
    rules = _options()[1] if a.command in ("train", "distill") else _options(a.command)
    sub = _subparsers(ap)[a.command]
    for act in sub._actions:
        chk, v = rules.get(act.dest), getattr(a, act.dest, None)
        if chk is None or v is None or isinstance(v, bool):
            continue
        flag = act.option_strings[-1] if act.option_strings else act.dest
        for x in v if isinstance(v, list) else [v]:
            if not chk.ok(x):
                raise RemodelError(chk.message(act.dest, x, flag))
    if a.command == "upcycle" and a.top_k is not None and a.top_k > a.experts:
        raise RemodelError(f"top_k must be at most --experts={a.experts} (--top-k), got {a.top_k}")


def _fail(command: str, msg: str) -> int:
    """The one error line (exit 2). Under torchrun (WORLD_SIZE > 1) only rank 0 prints it: every rank
    meets the same bad input, and N copies of one line bury it. The other ranks exit 2 silently, unless
    the error is theirs alone (runtime.rank_local_error): they print `remodel CMD: rank R: error: ...`.
    torchrun itself still reports the failure after that line, and exits 1 rather than 2: a "failed
    (exitcode: 2) local_rank: 0" log line, SIGTERM to the ranks still running, then its own Python
    traceback ending in a ChildFailedError summary (each failed rank, exit code, the root cause)."""
    try:  # a progress bar left open by the failed step: end its line first, so the error has its own
        from tqdm import tqdm
        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
    except Exception:  # noqa: BLE001 - the error line matters more than the bar
        pass
    from remodel.models.errors import one_line
    local = _ranks("rank_local_error", msg)
    if _lead():
        print(f"remodel {command}: error: {one_line(msg)}", file=sys.stderr)
    elif local:  # raised on this rank alone (under torchrun): rank 0 does not have it to print
        print(f"remodel {command}: rank {os.environ.get('RANK')}: error: {one_line(msg)}", file=sys.stderr)
    return 2


def _ranks(fn: str, arg):
    """runtime.`fn`(arg) (torchrun error handling) once torch.distributed is loaded, else None."""
    if "torch.distributed" in sys.modules:  # before that no process group can exist
        from remodel.pipelines.distributed import runtime
        return getattr(runtime, fn)(arg)
    return None


def main(argv=None) -> int:
    from remodel.pipelines.commands import threads
    threads.prepare_env()  # before torch loads OpenMP: threads sleep at barriers (steady beside other jobs)
    from remodel.pipelines.commands.progress import lines_when_piped
    lines_when_piped()  # progress bars: lines, not carriage returns, when stderr is no terminal
    ap = build_parser()
    a = ap.parse_args(argv)
    from remodel.models.errors import RemodelError
    try:
        check_options(ap, a)
        threads.apply()  # REMODEL_THREADS / OMP_NUM_THREADS: as set
        r = run(a)
    except RemodelError as e:
        return _fail(a.command, str(e))
    except OSError as e:  # a disk that fills up, a file that vanishes: still one line, no traceback
        return _fail(a.command, f"{e.strerror or e}: {e.filename or ''}".rstrip(": "))
    except KeyboardInterrupt:
        print(f"remodel {a.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        why = _ranks("peer_lost", e)
        if why is None:
            raise
        if why and _lead():  # a timeout; a rank that ended printed its own error (why == "")
            print(f"remodel {a.command}: error: {why}", file=sys.stderr)
        return 1
    if isinstance(r, dict) and a.command not in ("demo",):
        _show_tasks(r)
        _show_summary(r)
        from remodel.pipelines.commands.report import strict_json
        print(strict_json({k: v for k, v in r.items() if not isinstance(v, (list, dict)) or k in ("output", "tasks")},
                          a.command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
