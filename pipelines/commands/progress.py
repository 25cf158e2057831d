"""Progress bars off a terminal: the one place that decides how every tqdm bar of a CLI run prints.

On a terminal a bar redraws itself in place (carriage returns). Piped or logged, those redraws pile up on one
line (256 updates of a run on one line of a log), so off a terminal each bar prints plain lines instead: one
when it starts, then at most one every PERIOD seconds, and its last state when it closes (if it is kept).
A bar given its own `file` or `mininterval` keeps them.
"""
from __future__ import annotations

import sys

PERIOD = 30.0  # seconds between a piped bar's lines


class LineStream:
    """A file for tqdm that writes each status as one line of the current sys.stderr (looked up per write, so
    a redirected stderr is followed); a bar's clearing writes (blanks) are dropped."""

    def write(self, s: str) -> None:
        line = s.replace("\r", "").rstrip()
        if line:
            sys.stderr.write(line + "\n")

    def flush(self) -> None:
        sys.stderr.flush()


def lines_when_piped(stream=None, period: float = PERIOD) -> bool:
    """Makes every tqdm bar created from now on print lines (LineStream, one every `period` s) when `stream`
    (default sys.stderr) is not a terminal. -> whether bars print lines. Idempotent."""
    from tqdm import tqdm
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return False
    if getattr(tqdm.__init__, "remodel_lines", False):
        return True
    init = tqdm.__init__

    def lines_init(self, *args, **kw):
        if kw.get("file") in (None, sys.stderr, sys.__stderr__):
            kw["file"] = LineStream()
            kw.setdefault("mininterval", period)
            kw.setdefault("dynamic_ncols", False)
        init(self, *args, **kw)

    lines_init.remodel_lines = True
    tqdm.__init__ = lines_init
    return True
