"""Output and work directories: an output appears all at once or not at all (atomic_output_dir: a
temporary sibling renamed at the end), and remodel removes only what it made (mark_dir / check_owned:
work and run directories carry a marker; anything else is refused, never deleted). The temporary and
old-output siblings carry one too (SIBLING_MARKER): a folder that only has their name is a user's."""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

from .errors import RemodelError


def _check_output(out: Path, overwrite: bool):
    if out.exists() and not out.is_dir():
        raise RemodelError(f"{out}: output exists and is not a directory")
    if out.is_dir() and not overwrite and any(out.iterdir()):
        raise RemodelError(f"{out}: output directory exists and is not empty (pass --overwrite to replace it)")


_SIBLING = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}")
SIBLING_MARKER = ".remodel-sibling"  # in every `.OUT.tmp-PID-hex` / `.OUT.old-PID-hex` remodel makes
INNER = "output"  # the sibling's folder that becomes OUT (tmp) or holds the previous OUT (old)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0  # another user's live process (or an impossible PID: treat as alive, keep it)
    return True


def _make_sibling(out: Path, kind: str) -> Path:
    """A new `.OUT.KIND-PID-hex` folder carrying SIBLING_MARKER (which names its kind, pid and OUT)."""
    d = out.parent / f".{out.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"
    d.mkdir()
    mark_dir(d, SIBLING_MARKER, kind=kind, pid=os.getpid(), out=out.name)
    return d


def _is_ours(p: Path, m) -> bool:
    """Whether sibling `p` (its name matched as `m`) is remodel's: a real folder holding SIBLING_MARKER, a
    small regular file whose kind, pid and OUT are the ones its name says. Its name alone is never enough."""
    f = p / SIBLING_MARKER
    try:
        if p.is_symlink() or not p.is_dir():
            return False
        st = f.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
            return False
        info = json.loads(f.read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(info, dict) and info.get("made_by") == "remodel" and info.get("kind") == m["kind"]
            and info.get("pid") == int(m["pid"]) and info.get("out") == m["name"])


def _remove_if_bare(p: Path):
    """A kill between `mkdir` and the marker's write (or inside the final rmtree) leaves the sibling empty,
    or holding only a marker still empty: removed with rmdir, which can delete no content."""
    with contextlib.suppress(OSError):
        if p.is_symlink() or not p.is_dir():
            return
        names = [q.name for q in p.iterdir()]
        if names == [SIBLING_MARKER]:
            st = (p / SIBLING_MARKER).lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_size:
                return
            (p / SIBLING_MARKER).unlink()
        elif names:
            return
        p.rmdir()


def _present(p: Path) -> bool:
    return p.exists() or p.is_symlink()


def remove_stale_siblings(out: Path):
    """Delete the `.OUT.tmp-PID-hex` / `.OUT.old-PID-hex` siblings a killed run left behind: their PID is
    dead and they carry remodel's SIBLING_MARKER (a folder with such a name but no marker is a user's, never
    touched, save an empty one: see _remove_if_bare). A stale `.old` holding the previous OUT gives it back
    when OUT is missing."""
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return
    for p in sorted(entries, key=lambda q: "tmp" in q.name):  # .old first, so it can be restored
        m = _SIBLING.fullmatch(p.name)
        if not m or m["name"] != out.name or _pid_alive(int(m["pid"])):
            continue
        if not _is_ours(p, m):
            _remove_if_bare(p)
            continue
        if m["kind"] == "old" and _present(p / INNER) and not _present(out):
            try:
                (p / INNER).rename(out)
            except OSError:
                continue  # keep it: the previous output is still in there
        shutil.rmtree(p, ignore_errors=True)


def make_parents(path: Path) -> list[Path]:
    """Create `path`'s missing parent directories; returns those this call created (deepest last: one a
    concurrent process made first is not ours to remove again)."""
    made = []
    for d in [d for d in reversed(Path(path).parents) if not d.exists()]:
        try:
            d.mkdir()
        except FileExistsError:
            if not d.is_dir():
                raise
            continue
        made.append(d)
    return made


def remove_dirs(dirs: list[Path]):
    """Remove the directories make_parents created, deepest first, those still empty only."""
    for d in reversed(dirs):
        with contextlib.suppress(OSError):
            d.rmdir()


def mark_dir(d: Path, marker: str, **info):
    """Record in `d` that remodel made it (a work or run directory): the MARKER file, a small JSON. Only
    a directory that carries it (see check_owned) is ever emptied or removed by remodel."""
    (Path(d) / marker).write_text(json.dumps({"made_by": "remodel", **info}) + "\n")


def check_owned(d: Path, marker: str, what: str, legacy=None):
    """A work or run directory remodel may write in and later remove: absent, empty (or holding only its
    lock), carrying MARKER, or `legacy(d)` (an older remodel's). Anything else is a one-line RemodelError
    and is never removed, --overwrite or not: a symlink (never followed), a file, a folder without it."""
    d = Path(d)
    if d.is_symlink():
        raise RemodelError(f"{d}: {what} is a symbolic link; remodel never follows one to write or delete "
                           "there: remove the link or choose another output")
    if not d.exists():
        return
    if not d.is_dir():
        raise RemodelError(f"{d}: {what} exists and is not a directory; move it away or choose another output")
    try:
        names = {p.name for p in d.iterdir()}
    except OSError as e:
        raise RemodelError(f"{d}: cannot read {what} ({e.strerror or e})") from None
    if marker in names or names <= {".lock"} or (legacy is not None and legacy(d)):
        return
    raise RemodelError(f"{d}: {what} exists and was not made by remodel (no {marker} in it); it is never "
                       "removed, with or without --overwrite: move it away or choose another output")


def remove_owned(d: Path, marker: str, what: str, legacy=None):
    """Remove `d` only when check_owned accepts it as remodel's; anything else stays untouched, silently
    (the cleanup of a work folder after a run, which must never turn into a user's loss)."""
    with contextlib.suppress(RemodelError):
        check_owned(d, marker, what, legacy)
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def atomic_output_dir(out, overwrite: bool = False, inputs=()):
    """Yield a temporary folder for `out` (inside the marked sibling `.OUT.tmp-PID-hex`); rename it to
    `out` on success, delete it on error. Refuses a non-empty `out` unless overwrite, and any `out` equal
    to, inside or containing an input. A replaced OUT is first moved into a marked `.OUT.old-PID-hex`, put
    back on error. Siblings left by killed runs are removed first (those carrying the marker only);
    parent directories it creates are removed again on error; an OUT that cannot be created (permissions,
    a file in the path) is a RemodelError."""
    out = Path(out).absolute()
    real = out.resolve()
    for inp in inputs:
        inp = Path(inp).resolve()
        if real == inp or inp in real.parents or real in inp.parents:
            raise RemodelError(f"{out}: output overlaps input directory {inp}; write the output elsewhere")
    remove_stale_siblings(out)
    _check_output(out, overwrite)
    created, wrap, old = [], None, None
    try:
        created = make_parents(out)
        wrap = _make_sibling(out, "tmp")
        (wrap / INNER).mkdir()
    except OSError as e:
        if wrap is not None:
            shutil.rmtree(wrap, ignore_errors=True)
        remove_dirs(created)
        raise RemodelError(f"{out}: cannot create the output directory ({e.strerror or e}: "
                           f"{e.filename or out.parent})") from None
    try:
        yield wrap / INNER
        _check_output(out, overwrite)  # something may have appeared meanwhile
        if _present(out):
            old = _make_sibling(out, "old")
            out.rename(old / INNER)
        (wrap / INNER).rename(out)
    except BaseException:
        shutil.rmtree(wrap, ignore_errors=True)
        if old is not None and _present(old / INNER) and not _present(out):
            (old / INNER).rename(out)  # put the previous output back
        if old is not None and not _present(old / INNER):
            shutil.rmtree(old, ignore_errors=True)
        remove_dirs(created)
        raise
    shutil.rmtree(wrap, ignore_errors=True)  # its marker only
    if old is not None:  # an OUT that was a link: the link goes (rmtree never follows one), never its target's files
        shutil.rmtree(old, ignore_errors=True)
