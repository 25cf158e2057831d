"""Typed command options: each command's settings are one dataclass, and its argparse parser is generated
from the fields (like pipelines.training.train_config's TrainConfig), so a default and its help line live in
one place. Field metadata (set with `opt`):
  help      the --help line (required)
  cli       False: Python API only (no flag)
  flag      the flag's name when it is not the field's (`limit` for task_limit)
  positional / required / choices / count (token and parameter counts such as 47B) / ints (3,7) / names (a,b)
  cli_default  the flag's default where the command line's differs from the API's (score --seq-len)
  group     a mutually exclusive group of the command (the class's GROUPS says which must be given)
  negate    a True-by-default bool whose flag turns it off (--no-loss-increase)
  widths    the one field holding {width name: target}: a flag per prunable width of models.kinds.WIDTHS,
            generated here, so a width declared there is a flag of every command that prunes
  train     the one dict field holding further TrainConfig settings: a flag per train / distill option
            (pipelines.training.train_config.add_train_flags) that is not a field of the command itself
  check     the Check (train_config) a given value must pass: cli.check_options applies it after parsing
The Python API (`prune(model, out, ffn_size=...)`) goes through `make`, which refuses an unknown name in one line.
"""
from __future__ import annotations

import argparse
import dataclasses
import math

from remodel.models.errors import RemodelError
from ..training.train_config import CHECKS, FIELDS, MAX_COUNT, add_train_flags, field_type, ints, train_flag_names

WIDTH_RULE = ints(1, 2**24)  # a width target (prune --ffn-size ...)


def opt(default, help: str, **meta):
    """A field with its help line and metadata (see the module doc); a dict/list default is copied per instance."""
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=type(default), metadata={"help": help, **meta})
    return dataclasses.field(default=default, metadata={"help": help, **meta})


def train_opt(name: str, help: str | None = None, **meta):
    """A command field that is TrainConfig's `name` (its default, rule and help line unless the command's meaning
    differs: `help`), so the command and train / distill share one definition."""
    f = FIELDS[name]
    md = {k: f.metadata[k] for k in ("check", "count", "choices") if k in f.metadata}
    return opt(f.default, help or f.metadata["help"], **md, **meta)


def _train_field(cls):
    """-> (the `train` dict field's name, the TrainConfig names it takes from the command line) or (None, ())."""
    name = next((f.name for f in dataclasses.fields(cls) if f.metadata.get("train")), None)
    own = {f.name for f in dataclasses.fields(cls)}
    return (name, tuple(n for n in train_flag_names(True) if n not in own)) if name else (None, ())


def parse_names(s: str) -> list[str]:
    """'a, b,' -> ['a', 'b'] (--tasks; an empty list is refused by name later, before any work)."""
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_ints(s: str) -> list[int]:
    try:
        return [int(x) for x in parse_names(s)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def parse_count(s: str) -> int | float:
    """1000, 4.5e9, 47B, 500M, 2k -> an int; a value no count can be (inf, nan, 1e400, 1e30B) comes back as
    a float for the option check to refuse by name (int(float) would raise OverflowError)."""
    mult = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
    t = s.strip().lower()
    num, scale = (t[:-1], mult[t[-1]]) if t and t[-1] in mult else (t, 1)
    try:
        v = float(num) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number like 4.5e9 or 47B, got {s!r}") from None
    return int(v) if math.isfinite(v) and abs(v) <= MAX_COUNT else v


def width_flags() -> dict:
    """{width name: its --help line} of every prunable width the kinds declare (models.kinds), read when asked
    (not at import)."""
    from remodel.models import kinds
    return {n: f"target {kinds.WIDTHS[n].help} (None: kept)" for n in kinds.PRUNABLE}


def help_of(f: dataclasses.Field) -> str:
    """The help line; a callable one is asked when the parser is built (a list of widths, families)."""
    h = f.metadata["help"]
    return h() if callable(h) else h


def flag_of(f: dataclasses.Field) -> str:
    """--task-dir for task_dir; --limit for task_limit (metadata flag); --no-eos for eos (metadata negate)."""
    return "--" + (f.metadata.get("negate") or f.metadata.get("flag", f.name)).replace("_", "-")


def add_flags(p: argparse.ArgumentParser, cls) -> None:
    """The parser of command options `cls`: one argument per CLI field, default and help from the field."""
    groups = {}
    for name, required in getattr(cls, "GROUPS", {}).items():
        groups[name] = p.add_mutually_exclusive_group(required=required)
    for f in dataclasses.fields(cls):
        md = f.metadata
        if md.get("cli", True) is False:
            continue
        if md.get("train"):  # here, in the field's place
            add_train_flags(p, True, count=parse_count, only=_train_field(cls)[1])
            continue
        where = groups[md["group"]] if "group" in md else p
        if md.get("widths"):
            for name, help in width_flags().items():
                where.add_argument("--" + name.replace("_", "-"), dest=name, type=int, help=help)
            continue
        if md.get("positional"):
            p.add_argument(f.name, help=help_of(f))
            continue
        where.add_argument(flag_of(f), **_argument(f))


def _argument(f: dataclasses.Field) -> dict:
    md = f.metadata
    kw = {"dest": f.name, "help": help_of(f), "default": md.get("cli_default", f.default)}
    if md.get("negate"):  # --no-X: stored as no_X (default False), the field is its negation
        return {**kw, "dest": md["negate"], "default": False, "action": "store_true"}
    if f.default is False:
        return {**kw, "action": "store_true"}
    if md.get("required"):
        kw["required"] = True
    if "choices" in md:
        kw["choices"] = list(md["choices"])
    if "flag" in md:
        kw["metavar"] = md["flag"].upper()
    parse = [fn for key, fn in (("count", parse_count), ("ints", parse_ints), ("names", parse_names)) if md.get(key)]
    kw["type"] = parse[0] if parse else field_type(f)
    return kw


def from_args(cls, a: argparse.Namespace, **fixed):
    """`cls` from parsed arguments (the dests add_flags set) plus `fixed` values."""
    kw = {}
    train, names = _train_field(cls)
    if train:
        kw[train] = {n: getattr(a, n) for n in names if hasattr(a, n)}
    for f in dataclasses.fields(cls):
        if f.metadata.get("train"):
            continue
        if f.metadata.get("widths"):
            kw[f.name] = {n: getattr(a, n) for n in width_flags() if getattr(a, n, None) is not None}
        elif f.metadata.get("negate") and hasattr(a, f.metadata["negate"]):
            kw[f.name] = not getattr(a, f.metadata["negate"])
        elif hasattr(a, f.name):
            kw[f.name] = getattr(a, f.name)
    return cls(**{**kw, **fixed})


def rules(cls) -> dict:
    """{dest: Check} of the numeric options of command `cls` (cli.check_options applies them after parsing):
    its fields' checks, and a positive integer for each width target."""
    widths = any(f.metadata.get("widths") for f in dataclasses.fields(cls))
    return {**({n: WIDTH_RULE for n in width_flags()} if widths else {}),
            **{n: CHECKS[n] for n in _train_field(cls)[1] if n in CHECKS},
            **{f.name: f.metadata["check"] for f in dataclasses.fields(cls) if "check" in f.metadata}}


def given(**kw) -> dict:
    """The keywords that are not None (a command's positional arguments, which `opts` may hold instead)."""
    return {k: v for k, v in kw.items() if v is not None}


def make(cls, opts=None, aliases: dict | None = None, **kw):
    """The Python API's options: `opts` (or the defaults) with the keyword values `kw` replacing fields;
    a width name goes into the `widths` field; an unknown name is a one-line error (never dropped)."""
    names = {f.name for f in dataclasses.fields(cls)}
    wfield = next((f.name for f in dataclasses.fields(cls) if f.metadata.get("widths")), None)
    kw = {(aliases or {}).get(k, k): v for k, v in kw.items()}
    widths = {k: kw.pop(k) for k in list(kw) if wfield and k in width_flags()}
    bad = sorted(set(kw) - names)
    if bad:
        what = getattr(cls, "UNKNOWN", f"{cls.COMMAND} options")
        raise RemodelError(f"unknown {what} {bad} (known: {', '.join(sorted(names - {wfield}))})")
    o = dataclasses.replace(opts, **kw) if opts is not None else cls(**kw)
    if widths:
        o = dataclasses.replace(o, **{wfield: {**getattr(o, wfield), **widths}})
    return o
