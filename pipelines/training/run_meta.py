"""The schema of a training checkpoint's meta.json: every key the trainer and convert read, with its type
and shape, checked in one place before any of it is used (a damaged or hostile run directory is a one-line
error, never a KeyError on --resume)."""
from __future__ import annotations

from remodel.models.errors import RemodelError


def _num(v) -> bool:
    """A JSON number (read_json has refused NaN, Infinity and overflow); never a bool."""
    return type(v) in (int, float)


def _figures(v) -> bool:
    """{label: {figure: number or null}}: a history row's "moe" and "moe_init"."""
    return isinstance(v, dict) and all(isinstance(f, dict) and all(x is None or _num(x) for x in f.values())
                                       for f in v.values())


def _plain(v, depth: int = 2) -> bool:
    """A JSON scalar, or a list of plain values `depth` deep at most (an args value: a path, a count, the
    layer map's pairs, the data fingerprints)."""
    if v is None or type(v) in (bool, int, float, str):
        return True
    return depth > 0 and isinstance(v, list) and all(_plain(x, depth - 1) for x in v)


def _check_history(rows: list, step: int, path):
    """History rows: objects whose "step" runs up strictly within 1..step, a numeric "loss", every other
    figure a number or null, "moe" MoE figures."""
    if len(rows) > step:
        raise RemodelError(f"{path}: 'history' has {len(rows)} rows for step {step}")
    prev = 0
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or type(r.get("step")) is not int or not prev < r["step"] <= step:
            raise RemodelError(f"{path}: 'history' row {i} has no step in {prev + 1}..{step} (corrupt)")
        bad = [k for k, v in r.items() if not (_figures(v) if k == "moe" else v is None or _num(v))]
        if not _num(r.get("loss")) or bad:
            raise RemodelError(f"{path}: 'history' row {i} has a bad {bad[0] if bad else 'loss'!r} (corrupt)")
        prev = r["step"]


def _check_eval(ev: dict, path):
    """"eval": "before" / "after" / "teacher", each {figure: number}."""
    for k, v in ev.items():
        if k not in ("before", "after", "teacher") or not isinstance(v, dict) or not all(_num(x) for x in v.values()):
            raise RemodelError(f"{path}: 'eval' entry {k!r} is not an evaluation's figures (corrupt)")


def check_meta(meta: dict, path, dir_step: int | None) -> dict:
    """The one schema of a checkpoint's meta.json (every key the trainer and convert read, with its type
    and shape): step (the directory's), counts non-negative integers, args plain values, history rows,
    eval figures, MoE figures, AdamW step counts finite in [0, step]; a one-line error otherwise."""
    step = meta.get("step")
    if type(step) is not int or (dir_step is not None and dir_step != step) or step < 0:
        raise RemodelError(f"{path}: 'step' {step!r} does not match its directory")
    kinds = {"consumed_batches": int, "args": dict, "history": list, "eval": dict, "adam_steps": dict}
    for k, t in kinds.items():
        if type(meta.get(k)) is not t or (t is int and meta[k] < 0):
            raise RemodelError(f"{path}: {k!r} is missing or not a {'non-negative ' if t is int else ''}{t.__name__}")
    bad = [k for k, v in meta["args"].items() if not _plain(v)]
    if bad:
        raise RemodelError(f"{path}: 'args' entry {bad[0]!r} is not a plain value (corrupt)")
    _check_history(meta["history"], step, path)
    _check_eval(meta["eval"], path)
    for name, v in meta["adam_steps"].items():
        if not _num(v) or not 0 <= v <= step:
            raise RemodelError(f"{path}: AdamW step count of {name!r} is {v!r}, outside [0, {step}]")
    if not isinstance(meta.get("hf_config", {}), dict):
        raise RemodelError(f"{path}: 'hf_config' is not an object")
    if meta.get("moe_init") is not None and not _figures(meta["moe_init"]):
        raise RemodelError(f"{path}: 'moe_init' is not MoE figures (corrupt)")
    return meta
