"""Test-wide settings: keep idle OpenMP threads from spinning (on a 2-core
machine busy-waiting threads in one process slow every other process ~5x),
and keep tokenizers single-threaded; and the markers of the long tests (MARKS)."""
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# token sets cached by training runs go to a fresh folder per test session, not ~/.cache
if "REMODEL_CACHE" not in os.environ:
    import tempfile
    os.environ["REMODEL_CACHE"] = tempfile.mkdtemp(prefix="remodel-test-cache-")

# ---- markers ---------------------------------------------------------------------------------------
# `python -m pytest -q tests` runs everything (CI); `python -m pytest -q -m "not slow" tests` is the
# edit-test loop. The markers (registered in pyproject.toml) are given here, not in the test files:
#   multiprocess  torchrun / several processes (process groups, killed ranks)
#   timing        asserts a speed ratio
#   quality       trains or evaluates for a quality figure
#   slow          left out of the edit-test loop: every test of the three kinds above, plus the longest
#                 of the rest (durations measured with `--durations=0` on the shared 2-core machine)
# MARKS: test file -> test function (the name without its [parameters]; "*" = every test of the file)
# -> markers. A test marked in its own file with multiprocess / timing / quality is made slow too.
# An entry that matches no collected test fails a run that collects the whole tests/ folder.
MARKS = {
}

KINDS = ("multiprocess", "timing", "quality")  # each of these implies slow
TESTS_DIR = Path(__file__).resolve().parent


def _whole_folder(config) -> bool:
    """True when this run collects all of tests/ (no file or node ids, no --ignore / --lf narrowing)."""
    args = [a for a in config.args if not a.startswith("-")] or [str(config.rootpath / p) for p in
                                                                   config.getini("testpaths")]
    if not args or any(Path(config.invocation_params.dir, a).resolve() != TESTS_DIR for a in args):
        return False
    narrowing = ("ignore", "ignore_glob", "deselect", "lf", "failedfirst", "stepwise")
    return not any(_opt(config, o) for o in narrowing)


def _opt(config, name):
    try:
        return config.getoption(name)
    except ValueError:
        return None


@pytest.hookimpl(tryfirst=True)  # before -m / -k deselect anything, so the markers count there
def pytest_collection_modifyitems(session, config, items):
    used = set()
    for item in items:
        table = MARKS.get(item.path.name, {})
        names = set()
        for key in (item.originalname if hasattr(item, "originalname") else item.name, item.name, "*"):
            if key in table:
                used.add((item.path.name, key))
                names.update(table[key].split())
        names.update(m.name for m in item.iter_markers() if m.name in KINDS)
        if names & set(KINDS):
            names.add("slow")
        for name in sorted(names):
            item.add_marker(name)
    if session.testsfailed or not _whole_folder(config):
        return  # a file that failed to import, or a partial run: unmatched entries prove nothing
    stale = [f"{f}::{t}" for f, tests in MARKS.items() for t in tests if (f, t) not in used]
    if stale:
        raise pytest.UsageError("tests/conftest.py MARKS names tests that were not collected (renamed or "
                                "removed? update the table): " + ", ".join(stale))
