"""`remodel run RECIPE`: the whole job (score, prune / search, distill, eval, upcycle, train, ...) as one resumable
run over named steps (issue 59, Deliver 2). The recipe (recipe_file.py) is checked whole before any step runs;
then each step runs in order, in this process, as its command line would, writing WORKDIR/NAME.

Resuming: a step whose folder holds its remodel_report.json is complete (the commands write their OUT atomically,
report inside; for plan, eval and inspect the runner writes the report, atomically, last), and the run starts at the
first step that is not complete, or whose command line changed since (recipe_report.json records them), so a
killed run goes on from its last complete step. From there every step runs, a complete output of an earlier run
replaced (`--overwrite`, only ever on an output a step wrote). WORKDIR/recipe_report.json (steps, status,
seconds, outputs) is rewritten atomically after every step; a lock on WORKDIR refuses a second run there.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from remodel.models.errors import RemodelError
from remodel.models.outputs import check_owned, mark_dir

from ..distributed.runtime import RunLock
from .options import opt
from .recipe_file import Recipe, Step, find_recipe, load_recipe
from .report import write_json

REPORT = "recipe_report.json"
STEP_MARKER = ".remodel-recipe-step"  # a folder the runner made for a plan, eval or inspect step


@dataclass
class RunOptions:
    COMMAND = "run"
    recipe: object = opt(None, "recipe YAML file, or a shipped recipe's name (shrink-56b-47b, dense-to-moe)",
                         positional=True)
    workdir: object = opt(None, "folder of the step outputs (None: the recipe's `workdir`)")
    from_step: str | None = opt(None, "run again from this step, replacing its output and the later ones (None: "
                                "from the first step not complete)", flag="from")
    dry_run: bool = opt(False, "print the steps' commands (shell-quoted) and write nothing")


@dataclass
class Commands:
    """What the command line lends the runner (pipelines never import cli): remodel's parser (usage errors
    raised), main's option check of parsed arguments, and the call that runs one parsed command -> its report."""
    parser: argparse.ArgumentParser
    check: Callable
    run: Callable


def run_recipe(opts: RunOptions, commands: Commands) -> dict | None:
    """Run (or with dry_run print) the recipe of `opts`; -> the run's report (None for a dry run)."""
    recipe = load_recipe(find_recipe(opts.recipe), opts.workdir, commands.parser, commands.check)
    previous = _previous(recipe.workdir)
    start = _start(recipe, opts.from_step, previous)
    if opts.dry_run:
        _print_dry(recipe, start)
        return None
    lock = RunLock(recipe.workdir, recipe.workdir).acquire()
    try:
        previous = _previous(recipe.workdir)  # read again under the lock
        return _execute(recipe, _start(recipe, opts.from_step, previous), commands)
    finally:
        lock.release()


def _previous(workdir: Path) -> dict:
    """{step name: command line} of WORKDIR/recipe_report.json, {} when there is none; a file of that name that is
    not remodel's is refused (never overwritten)."""
    p = workdir / REPORT
    if not p.exists():
        return {}
    try:
        doc = json.loads(p.read_text())
        if doc.get("command") != "run":
            raise ValueError
        return {s["name"]: s["command_line"] for s in doc["steps"]}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        raise RemodelError(f"{p}: exists and is not a report of `remodel run`; move it away or choose another "
                           "workdir") from None


def _start(recipe: Recipe, from_step: str | None, previous: dict) -> int:
    """The index of the first step to run: --from's, else the first not complete or changed since its output."""
    names = [s.name for s in recipe.steps]
    if from_step is not None:
        if from_step not in names:
            raise RemodelError(f"--from {from_step}: no such step (steps: {', '.join(names)})")
        i = names.index(from_step)
        missing = [s for s in recipe.steps[:i] if not s.complete()]
        if missing:
            raise RemodelError(f"--from {from_step}: earlier step {missing[0].name!r} has no complete output "
                               f"({missing[0].folder}); run without --from first")
        return i
    for i, s in enumerate(recipe.steps):
        if not s.complete() or previous.get(s.name, s.line) != s.line:
            return i
    return len(recipe.steps)


def _overwrite(s: Step) -> bool:
    """Replace the step's output: only one it wrote (complete), or the PLAN file of its own marked folder."""
    return s.complete() or (s.command == "plan" and (s.folder / STEP_MARKER).is_file() and s.out.exists())


def _shown(s: Step, overwrite: bool) -> str:
    flag = overwrite and hasattr(s.args, "overwrite") and "--overwrite" not in s.argv
    line = s.line + (" --overwrite" if flag else "")
    return line + (f"  # report: {s.folder / 'remodel_report.json'}" if s.managed and s.command != "plan" else "")


def _print_dry(recipe: Recipe, start: int):
    print(f"# {recipe.path}: {len(recipe.steps)} steps in {recipe.workdir} (dry run: nothing run or written)")
    for i, s in enumerate(recipe.steps):
        print(f"# {s.name}: complete, skipped" if i < start else f"# {s.name}")
        print(_shown(s, i >= start and _overwrite(s)))


def _execute(recipe: Recipe, start: int, commands: Commands) -> dict:
    t0, n = time.time(), len(recipe.steps)
    rows = [{"name": s.name, "command": s.command, "command_line": s.line, "output": str(s.out),
             "status": "skipped" if i < start else "pending", "seconds": 0.0} for i, s in enumerate(recipe.steps)]
    report = {"command": "run", "recipe": str(recipe.path), "workdir": str(recipe.workdir), "status": "running",
              "steps": rows, "output": str(recipe.workdir)}
    _say(f"remodel run: {recipe.path}: {n} steps in {recipe.workdir}")
    for i, (s, row) in enumerate(zip(recipe.steps, rows)):
        if i < start:
            _say(f"[{i + 1}/{n}] {s.name}: skipped, complete ({s.folder})")
            continue
        overwrite = _overwrite(s)
        _say(f"[{i + 1}/{n}] {s.name}: started: {_shown(s, overwrite)}")
        t = time.time()
        try:
            r = _run_step(s, commands, overwrite)
        except BaseException as e:
            row.update(status="failed", seconds=round(time.time() - t, 3))
            _write(recipe, report, "failed", t0)
            if isinstance(e, RemodelError):
                raise RemodelError(f"step {s.name!r} ({s.command}): {e}") from None
            raise
        row.update(status="ran", seconds=round(time.time() - t, 3))
        _write(recipe, report, "running", t0)
        _say(f"[{i + 1}/{n}] {s.name}: done in {row['seconds']:.1f} s -> {s.out}" + _figures(r))
    return _write(recipe, report, "complete", t0)


def _run_step(s: Step, commands: Commands, overwrite: bool):
    a = argparse.Namespace(**vars(s.args))
    if overwrite and hasattr(a, "overwrite"):
        a.overwrite = True
    if not s.managed:
        return commands.run(a)
    check_owned(s.folder, STEP_MARKER, f"the folder of step {s.name!r}")
    (s.folder / "remodel_report.json").unlink(missing_ok=True)  # run again: not complete until written anew
    s.folder.mkdir(parents=True, exist_ok=True)
    mark_dir(s.folder, STEP_MARKER, step=s.name, recipe=str(s.line))
    try:
        r = commands.run(a)
    except BaseException:
        if {p.name for p in s.folder.iterdir()} == {STEP_MARKER}:  # nothing but our marker: the folder goes again
            shutil.rmtree(s.folder)
        raise
    write_json(s.folder / "remodel_report.json", {"command": s.command, **(r or {})})
    return r


def _write(recipe: Recipe, report: dict, status: str, t0: float) -> dict:
    report.update(status=status, seconds=round(time.time() - t0, 3))
    write_json(recipe.workdir / REPORT, report)
    return report


def _figures(r) -> str:
    """The step's summary line (summary.py), else a few top-level figures of its report, for its end line."""
    from .summary import summary
    if not isinstance(r, dict):
        return ""
    if summary(r):
        return "; " + summary(r)
    shown = [f"{k} {v:.4g}" for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
             and k in ("ppl", "loss", "tokens", "final_loss", "eval_ppl", "steps")]
    for task, m in (r.get("tasks") or {}).items():  # lm-eval's figures: each task's first metric
        first = next(((k, v) for k, v in m.items() if isinstance(v, float)), None) if isinstance(m, dict) else None
        shown += [f"{task} {first[0]} {first[1]:.4g}"] if first else []
    return "; " + ", ".join(shown) if shown else ""


def _say(line: str):
    print(line, file=sys.stderr, flush=True)

