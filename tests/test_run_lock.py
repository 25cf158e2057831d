"""The lock on OUT.run (issue 25): a second train/distill writing the same OUT refuses in one line naming
the holder's pid, and creates nothing; a killed holder leaves no stale lock; a finished or failed run
releases it and leaves no lock file behind."""
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from remodel import cli
from remodel.models.errors import RemodelError
from remodel.pipelines.distributed.runtime import LOCK_NAME, RunLock
from tests.cli_contract import fails, listing

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "data" / "embedded"
VALID = ROOT / "data" / "corpus" / "valid.txt.gz"

HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from remodel.pipelines.distributed.runtime import RunLock
    RunLock(Path(sys.argv[1]), Path(sys.argv[2])).acquire()
    print("locked", flush=True)
    time.sleep(600)
""")


@pytest.fixture()
def holder(tmp_path):
    """Another process holding the lock on tmp_path/o.run; yields it (killed at the end)."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "o.run"), str(tmp_path / "o")], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        yield p
    finally:
        p.kill()
        p.wait()


def test_second_lock_refused_then_released(tmp_path):
    lock = RunLock(tmp_path / "deep" / "o.run", tmp_path / "deep" / "o").acquire()
    assert (tmp_path / "deep" / "o.run" / LOCK_NAME).read_text().strip() == str(os.getpid())
    before = listing(tmp_path)
    with pytest.raises(RemodelError, match=rf"is in use by another run \(pid {os.getpid()}\)"):
        RunLock(tmp_path / "deep" / "o.run", tmp_path / "deep" / "o").acquire()
    assert listing(tmp_path) == before
    lock.release()
    lock.release()  # idempotent
    assert listing(tmp_path) == set()  # the lock file and the folders the lock made are gone
    again = RunLock(tmp_path / "deep" / "o.run", tmp_path / "deep" / "o").acquire()
    (tmp_path / "deep" / "o.run" / "step-000001").mkdir()  # a run that wrote checkpoints keeps its folder
    again.release()
    assert listing(tmp_path) == {"deep", "deep/o.run", "deep/o.run/step-000001"}


def test_killed_holder_leaves_no_stale_lock(tmp_path, holder):
    with pytest.raises(RemodelError, match=rf"in use by another run \(pid {holder.pid}\)"):
        RunLock(tmp_path / "o.run", tmp_path / "o").acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (tmp_path / "o.run" / LOCK_NAME).exists()  # the file stays, the kernel dropped the lock
    RunLock(tmp_path / "o.run", tmp_path / "o").acquire().release()
    assert listing(tmp_path) == {"o.run"}  # not made by this lock: kept, its lock file removed


@pytest.mark.parametrize("cmd, flags", [("train", []), ("train", ["--overwrite"]), ("distill", ["--resume"])])
def test_cli_refuses_an_out_in_use(tmp_path, capsys, holder, cmd, flags):
    model = ["--teacher", EMBEDDED, "--student", EMBEDDED] if cmd == "distill" else [EMBEDDED]
    before = listing(tmp_path)
    fails(capsys, cmd, *model, tmp_path / "o", "--data", VALID, "--steps", "1", "--seq-len", "16", "--batch", "2",
          *flags, match=f"{tmp_path / 'o'} is in use by another run (pid {holder.pid})")
    assert listing(tmp_path) == before


def test_clear_keeps_the_lock(tmp_path):
    from remodel.pipelines.training.run_files import clear_run_dir as _clear
    lock = RunLock(tmp_path / "o.run", tmp_path / "o").acquire()
    (tmp_path / "o.run" / "step-000002").mkdir()
    (tmp_path / "o.run" / "peak-rss-rank0.json").write_text("{}")
    _clear(tmp_path / "o.run")
    assert listing(tmp_path) == {"o.run", f"o.run/{LOCK_NAME}"}
    lock.release()


def test_a_finished_run_releases_the_lock(tmp_path, capsys):
    argv = ["train", EMBEDDED, tmp_path / "o", "--data", VALID, "--steps", "1", "--seq-len", "16", "--batch", "2"]
    assert cli.main([str(a) for a in argv]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o", "o.run"]
    assert not (tmp_path / "o.run" / LOCK_NAME).exists()
    RunLock(tmp_path / "o.run", tmp_path / "o").acquire().release()  # free again
