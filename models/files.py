"""Reading files that may be hostile: strict, bounded JSON and regular files only.

open_regular refuses FIFOs and devices before opening (non-blocking) and again after, and bounds the
size; parse_json refuses duplicate keys, NaN / Infinity (written or overflowing, 1e999) and nesting deeper
than MAX_DEPTH, measured by a scan before parsing so neither the parser nor a later walk of the result
(transformers' special-float decoder recurses) runs out of stack; read_json puts them together for config,
index and meta files. check_weight_dtype keeps integer relabels out of model weights.
"""
from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import numpy as np
import torch

from .errors import RemodelError

MAX_JSON = 64 * 1024 * 1024  # config, index and meta files (a 1T-parameter index is ~10 MB)
MAX_DEPTH = 64  # nesting of objects and arrays (configs and run state use < 10)


def _unique(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


def _finite_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"{s[:40]} overflows a float")
    return v


def _real_quotes(x: np.ndarray) -> np.ndarray:
    """Positions of the quotes in UTF-8 JSON bytes `x` that open or close a string (not escaped by an odd
    run of backslashes before them)."""
    quotes = np.flatnonzero(x == ord('"'))
    bs = np.flatnonzero(x == ord("\\"))
    if not len(bs) or not len(quotes):
        return quotes
    ends = np.flatnonzero(np.diff(bs) != 1)
    run_end, run_len = bs[np.append(ends, len(bs) - 1)], np.diff(np.concatenate(([-1], ends, [len(bs) - 1])))
    k = np.minimum(np.searchsorted(run_end, quotes - 1), len(run_end) - 1)
    return quotes[~((run_end[k] == quotes - 1) & (run_len[k] % 2 == 1))]


def json_depth(raw: bytes) -> int:
    """The deepest nesting of brackets outside string literals in UTF-8 JSON bytes, without recursion or a
    Python loop over the text: a bracket is outside a string when an even number of real quotes precede it."""
    x = np.frombuffer(raw, np.uint8)
    quotes, deepest, level = _real_quotes(x), 0, 0
    for i in range(0, len(x), 1 << 23):
        part = x[i:i + (1 << 23)]
        opens, closes = (part == ord("[")) | (part == ord("{")), (part == ord("]")) | (part == ord("}"))
        at = np.flatnonzero(opens | closes)
        at = at[np.searchsorted(quotes, at + i) % 2 == 0]
        if len(at):
            run = level + np.cumsum(np.where(opens[at], 1, -1))
            deepest, level = max(deepest, int(run.max())), int(run[-1])
    return deepest


def parse_json(raw: bytes, where) -> object:
    """Strict JSON: UTF-8, no duplicate keys, no NaN / Infinity, finite numbers, at most MAX_DEPTH deep."""
    try:
        text = raw.decode("utf-8")
        if json_depth(raw) > MAX_DEPTH:
            raise RecursionError
        return json.loads(text, object_pairs_hook=_unique, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise RemodelError(f"{where}: JSON nested too deeply (more than {MAX_DEPTH} levels)") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise RemodelError(f"{where}: invalid JSON ({str(e).splitlines()[0][:200]})") from None


def open_regular(path, what: str = "file", max_bytes: int | None = None) -> int:
    """A read-only fd of `path`, a regular file of at most max_bytes. A FIFO or a device is refused before
    the open (which is non-blocking besides) and again after it, in case the path was swapped in between,
    so reading never blocks on one; a one-line RemodelError naming `what` otherwise."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise RemodelError(f"{path}: missing: {what} not found (deleted?)") from None
    except OSError as e:
        raise RemodelError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise RemodelError(f"{path}: {what} is not a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise RemodelError(f"{path}: {what} holds {st.st_size} bytes, more than the {max_bytes} allowed")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise RemodelError(f"{path}: cannot open {what} ({e.strerror or e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RemodelError(f"{path}: {what} is not a regular file")
    return fd


def read_bounded(path, what: str, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most max_bytes (see open_regular); a file that grew past the
    bound since its stat is refused too."""
    with os.fdopen(open_regular(path, what, max_bytes), "rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise RemodelError(f"{path}: {what} is larger than {max_bytes} bytes")
    return raw


def read_json(path: Path, max_bytes: int = MAX_JSON) -> dict:
    """A JSON object from `path` (a regular file of bounded size, strict JSON), or RemodelError naming it."""
    obj = parse_json(read_bounded(path, Path(path).name, max_bytes), path)
    if not isinstance(obj, dict):
        raise RemodelError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def check_weight_dtype(where, name: str, dtype: torch.dtype):
    """A tensor read as a model weight must have a floating-point dtype (an integer relabel of the same
    bytes would otherwise load as garbage)."""
    if not dtype.is_floating_point:
        raise RemodelError(f"{where}: tensor {name!r} is {dtype}; weights must be floating point")
