"""The CLI's CPU thread policy (pipelines/commands/threads.py): OpenMP asked to sleep at barriers before torch
loads, and an explicit thread count honoured."""
import os
import subprocess
import sys
from pathlib import Path

from remodel.pipelines.commands import threads

REPO = Path(__file__).resolve().parents[1]


def test_explicit_counts_win_else_torchs_default():
    assert threads.choose_threads(8, {"REMODEL_THREADS": "3", "OMP_NUM_THREADS": "2"}) == 3
    assert threads.choose_threads(8, {"OMP_NUM_THREADS": "2"}) == 2
    assert threads.choose_threads(4, {"OMP_NUM_THREADS": "x", "REMODEL_THREADS": "0"}) == 4
    assert threads.choose_threads(2, {}) == 2


def test_cli_sets_the_wait_policy_before_torch_and_the_thread_count():
    """`remodel inspect` in a fresh process: OMP_WAIT_POLICY is PASSIVE by the time torch loads, and torch runs
    REMODEL_THREADS' count; a policy the user set is kept."""
    code = ("import sys, os; from remodel.pipelines.commands import threads as t; p = t.prepare_env; "
            "t.prepare_env = lambda: print('TORCH_LOADED', 'torch' in sys.modules) or p(); "
            "from remodel.cli import main; rc = main(['inspect', sys.argv[1]]); import torch; "
            "print('RESULT', rc, os.environ.get('OMP_WAIT_POLICY'), torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.update(REMODEL_THREADS="1", PYTHONPATH=str(REPO.parent))
    for user, want in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        if user:
            env["OMP_WAIT_POLICY"] = user
        out = subprocess.run([sys.executable, "-c", code, str(REPO / "data" / "embedded")], env=env,
                             capture_output=True, text=True, timeout=300).stdout
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT")][-1].split()
        assert line[1:] == ["0", want, "1"] and "TORCH_LOADED False" in out, out[-2000:]
