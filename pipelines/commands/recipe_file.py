"""Recipe files of `remodel run` (issue 59, Deliver 2): a YAML file of named steps, each one remodel command with
its own options, spelled as the command's flags without the dashes (`ffn-size: 384`, `dry-run`-style switches as
true / false) or a positional's name (`model`): one table, the commands' own. A recipe comes from anywhere, so it
is read as hostile input: size-bounded, YAML's safe loader with duplicate keys refused, every key and type checked,
and every step's command line parsed by that command's own argparse parser and checked by its rules before any
step runs. Each refusal is one RemodelError line naming the recipe, the step and the field.

Values: `${steps.NAME.out}` is an earlier step's output (its folder WORKDIR/NAME; for plan the PLAN file in it);
`builtin:PATH` a file shipped in remodel's data folder (the embedded checkpoint, the corpus), so a shipped recipe
resolves wherever remodel is installed; any other path is the command line's own (relative to the current folder).
"""
from __future__ import annotations

import argparse
import difflib
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from remodel.models.errors import RemodelError

from ..data.data import DATA_DIR

MAX_BYTES = 1024**2  # a recipe is a few hundred bytes
RECIPES = DATA_DIR / "recipes"  # the shipped recipes (package data)
BUILTIN = "builtin:"
STEP_COMMANDS = ("score", "prune", "search", "distill", "train", "eval", "upcycle", "convert", "plan", "inspect",
                 "tokenize")
FILE_OUT = {"plan": "plan.json"}  # a command whose --out is a file: kept in the step's folder
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
REF = re.compile(r"\$\{([^}]*)\}")
STEP_REF = re.compile(r"steps\.([A-Za-z0-9][A-Za-z0-9_-]*)\.out")
TOP_KEYS = {"workdir": str, "description": str, "steps": list}
STEP_KEYS = {"name": str, "command": str, "options": dict}


@dataclass
class Step:
    """One checked step: its command line (after `remodel`), the parsed arguments, where it writes."""
    name: str
    command: str
    argv: list
    args: argparse.Namespace
    folder: Path  # WORKDIR/NAME: the step is complete when it holds remodel_report.json
    out: Path  # what ${steps.NAME.out} names: the folder, or the file of FILE_OUT
    managed: bool  # the runner makes the folder and writes the command's report there (plan, eval, inspect)

    @property
    def line(self) -> str:
        return shlex.join(["remodel", self.command, *self.argv])

    def complete(self) -> bool:
        return self.folder.is_dir() and not self.folder.is_symlink() and (self.folder / "remodel_report.json").is_file()


@dataclass
class Recipe:
    path: Path
    workdir: Path
    steps: list


def find_recipe(name) -> Path:
    """A recipe file, or the name of a shipped one (`dense-to-moe`, as `plan` takes a shipped config's name)."""
    p = Path(str(name))
    if p.is_file():
        return p
    shipped = RECIPES / (p.name if p.suffix in (".yaml", ".yml") else f"{p.name}.yaml")
    if str(name) == p.name and shipped.is_file():
        return shipped
    names = ", ".join(sorted(x.stem for x in RECIPES.glob("*.yaml")))
    raise RemodelError(f"{name}: no such recipe file, and no shipped recipe of that name (shipped: {names})")


def read_yaml(path: Path):
    """The YAML document of `path`: at most MAX_BYTES of UTF-8, safe loader, duplicate keys refused."""
    import yaml
    try:
        if path.stat().st_size > MAX_BYTES:
            raise RemodelError(f"{path}: over {MAX_BYTES} bytes; a recipe is a short YAML file")
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise RemodelError(f"{path}: not UTF-8 text") from None
    try:
        return yaml.load(text, Loader=_strict_loader())  # SafeLoader's constructors only
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise RemodelError(f"{path}: not a valid YAML recipe{where}: {getattr(e, 'problem', None) or e}") from None


def _strict_loader():
    import yaml

    class Strict(yaml.SafeLoader):
        """yaml.SafeLoader refusing a repeated key (which the plain loader lets the last one win silently)."""

        def construct_mapping(self, node, deep=False):
            seen = set()
            for k, _ in node.value:
                key = self.construct_object(k, deep=deep)
                if not isinstance(key, (str, int, float, bool)) or key in seen:
                    why = "repeated" if key in seen else "not a plain"
                    raise yaml.constructor.ConstructorError(None, None, f"{why} key {key!r}", k.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)
    return Strict


def _kind(v) -> str:
    return {bool: "true/false", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "a mapping", type(None): "nothing"}.get(type(v), type(v).__name__)


def _keys(doc, allowed: dict, where: str, required=()) -> None:
    if not isinstance(doc, dict):
        raise RemodelError(f"{where}: expected a mapping, got {_kind(doc)}")
    bad = [k for k in doc if k not in allowed]
    if bad:
        raise RemodelError(f"{where}: unknown key {bad[0]!r} (known: {', '.join(allowed)})")
    for k in required:
        if k not in doc:
            raise RemodelError(f"{where}: missing {k!r}")
    for k, v in doc.items():
        if not isinstance(v, allowed[k]) or isinstance(v, bool):
            raise RemodelError(f"{where}: {k!r} must be {_kind(allowed[k]())}, got {_kind(v)}")


def load_recipe(path: Path, workdir, parser: argparse.ArgumentParser, check) -> Recipe:
    """The checked recipe of `path` (see the module doc); `parser` is `remodel`'s own, raising its usage errors,
    `check` the option rules main applies. Nothing is written."""
    doc = read_yaml(path)
    _keys(doc, TOP_KEYS, str(path), required=("steps",))
    if workdir is None and not doc.get("workdir"):
        raise RemodelError(f"{path}: give 'workdir' (the folder of the step outputs) or --workdir")
    wd = Path(str(workdir if workdir is not None else doc["workdir"]))
    if wd.exists() and not wd.is_dir():
        raise RemodelError(f"{wd}: the recipe's workdir exists and is not a folder")
    if not doc["steps"]:
        raise RemodelError(f"{path}: 'steps' is empty")
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    steps, outs = [], {}
    for i, raw in enumerate(doc["steps"]):
        where = f"{path}: step {i + 1}"
        _keys(raw, STEP_KEYS, where, required=("name", "command"))
        name, command = raw["name"], raw["command"]
        if not NAME.fullmatch(name):
            raise RemodelError(f"{where}: name {name!r} must be letters, digits, - and _ (a folder name in workdir)")
        if name in outs:
            raise RemodelError(f"{where}: name {name!r} is used by an earlier step")
        if command not in STEP_COMMANDS:
            raise RemodelError(f"{where} ({name}): unknown command {command!r} (known: {', '.join(STEP_COMMANDS)})")
        where = f"{path}: step {name!r} ({command})"
        step = _step(name, command, wd, subs[command], _values(raw.get("options") or {}, where, outs))
        try:
            step.args = parser.parse_args([command, *step.argv])
            check(step.args)
        except RemodelError as e:
            raise RemodelError(f"{where}: {e}") from None
        steps.append(step)
        outs[name] = step.out
    return Recipe(path, wd, steps)


def _values(options: dict, where: str, outs: dict) -> dict:
    """{option: str or bool}: scalars only, references and builtin: paths resolved."""
    vals = {}
    for key, v in options.items():
        at = f"{where} option {key!r}"
        if not isinstance(key, str):
            raise RemodelError(f"{where}: option names are strings, got {key!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise RemodelError(f"{at}: {v} is not a finite number")
        if isinstance(v, bool):
            vals[key] = v
        elif isinstance(v, (int, float)):
            vals[key] = str(v)
        elif isinstance(v, str):
            vals[key] = _resolve(v, at, outs)
        else:
            raise RemodelError(f"{at}: expected a string, a number or true/false, got {_kind(v)}")
    return vals


def _resolve(v: str, at: str, outs: dict) -> str:
    def ref(m):
        r = STEP_REF.fullmatch(m.group(1))
        if r is None:
            raise RemodelError(f"{at}: unknown reference ${{{m.group(1)}}} (a reference is ${{steps.NAME.out}})")
        if r.group(1) not in outs:
            raise RemodelError(f"{at}: ${{{m.group(1)}}} names no earlier step (earlier: {', '.join(outs) or 'none'})")
        return str(outs[r.group(1)])
    if v.count("${") != len(REF.findall(v)):
        raise RemodelError(f"{at}: unterminated reference in {v!r} (a reference is ${{steps.NAME.out}})")
    v = REF.sub(ref, v)
    return str(_builtin(v[len(BUILTIN):], at)) if v.startswith(BUILTIN) else v


def _builtin(rel: str, at: str) -> Path:
    """builtin:REL -> remodel's installed data folder / REL, which must exist and lie inside it."""
    root = DATA_DIR.resolve()
    p = (root / rel).resolve()
    if not rel or Path(rel).is_absolute() or root not in p.parents or not p.exists():
        shipped = sorted(x.name for x in root.iterdir() if x.is_dir() and x.name[0] not in "._")
        raise RemodelError(f"{at}: builtin:{rel} is no shipped file (builtin: names a path in remodel's data folder: "
                           f"{', '.join(shipped)})")
    return p


def _step(name: str, command: str, wd: Path, sub: argparse.ArgumentParser, vals: dict) -> Step:
    """The step's command line from its option values; its output set by the recipe (WORKDIR/NAME)."""
    acts = {(a.option_strings[-1].lstrip("-") if a.option_strings else a.dest): a for a in sub._actions
            if a.dest != "help"}
    folder = wd / name
    out = folder / FILE_OUT[command] if command in FILE_OUT else folder
    managed = command in FILE_OUT or "out" not in acts
    where = f"step {name!r} ({command}) option"
    pos, flags = {"out": str(out)} if "out" in acts and not acts["out"].option_strings else {}, []
    for key, v in vals.items():
        act = acts.get(key)
        if key == "out":
            raise RemodelError(f"{where} 'out': set by the recipe (this step writes {out})")
        if act is None:
            near = difflib.get_close_matches(key, acts, n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"the options of {command}: {', '.join(acts)}"
            raise RemodelError(f"{where} {key!r}: unknown ({hint})")
        if act.nargs == 0:
            if not isinstance(v, bool):
                raise RemodelError(f"{where} {key!r}: a switch, true or false (got {v!r})")
            flags += [f"--{key}"] if v else []
        elif isinstance(v, bool):
            raise RemodelError(f"{where} {key!r}: expects a value (as after --{key}), got {str(v).lower()}")
        elif not act.option_strings:
            if v.startswith("-"):
                raise RemodelError(f"{where} {key!r}: a path starting with '-' ({v!r}); write ./{v}")
            pos[act.dest] = v
        else:
            flags += [f"--{key}={v}"] if v.startswith("-") else [f"--{key}", v]
    if "out" in acts and acts["out"].option_strings:
        flags += ["--out", str(out)]
    order = [a.dest for a in sub._actions if not a.option_strings and a.dest in pos]
    return Step(name, command, [pos[d] for d in order] + flags, None, folder, out, managed)
