"""CPU threads for a CLI run that may share its cores with other jobs.

torch's default OpenMP threads spin at every barrier: beside busy processes a spinning thread burns the core
another job holds and a preempted one stalls every barrier (a train step beside two busy loops on 2 cores took
22x its quiet time). So the CLI asks OpenMP to sleep at barriers (OMP_WAIT_POLICY=PASSIVE, read when torch
loads its OpenMP runtime, so set first): 1.8x there. The thread count stays torch's default, which measured
faster beside busy jobs than fewer threads (the scheduler shares cores per thread: bench/bench_load.py);
REMODEL_THREADS=N (or OMP_NUM_THREADS, torchrun's per rank) fixes it.
"""
from __future__ import annotations

import os


def prepare_env(environ=os.environ) -> None:
    """OpenMP threads sleep at barriers, unless the user chose a policy (effective only before torch loads)."""
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def choose_threads(default: int, environ=os.environ) -> int:
    """The intra-op thread count: REMODEL_THREADS, else OMP_NUM_THREADS where set to a count, else `default`."""
    for name in ("REMODEL_THREADS", "OMP_NUM_THREADS"):
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return default


def apply(environ=os.environ) -> int:
    """Sets torch's intra-op threads by `choose_threads` -> the count."""
    import torch
    n = choose_threads(torch.get_num_threads(), environ)
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    return n
