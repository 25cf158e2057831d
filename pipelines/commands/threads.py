"""CPU threads for a CLI run that may share its cores with other jobs.

torch's default (one intra-op thread per core, OpenMP threads that spin at every barrier) collapses beside busy
processes: a spinning thread burns the core another job holds, and a preempted one stalls every barrier. So
the CLI asks OpenMP to sleep at barriers (OMP_WAIT_POLICY=PASSIVE, read when torch loads its OpenMP runtime,
so set first) and takes no more threads than the cores other processes leave idle (sampled from /proc/stat).
OMP_NUM_THREADS or REMODEL_THREADS (an explicit count) skip the sampling; torchrun sets the former per rank.
"""
from __future__ import annotations

import os
import time

SAMPLE_S = 0.2  # how long the idle sample watches /proc/stat


def prepare_env(environ=os.environ) -> None:
    """OpenMP threads sleep at barriers, unless the user chose a policy (effective only before torch loads)."""
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _cpu_times(stat: str = "/proc/stat"):
    """(idle, total) jiffies of all cores, or None where /proc/stat is not there (not Linux)."""
    try:
        with open(stat) as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return idle, sum(fields[:8])  # guest times are already inside user / nice


def idle_cores(cores: int, sample_s: float = SAMPLE_S, stat: str = "/proc/stat") -> float | None:
    """How many of the machine's cores sat idle over sample_s seconds (None: unknown)."""
    a = _cpu_times(stat)
    time.sleep(sample_s)
    b = _cpu_times(stat)
    if a is None or b is None or b[1] <= a[1]:
        return None
    return cores * (b[0] - a[0]) / (b[1] - a[1])


def choose_threads(default: int, environ=os.environ, idle=None) -> int:
    """The intra-op thread count: REMODEL_THREADS or OMP_NUM_THREADS where set (the user's, or torchrun's),
    else torch's default capped by the idle cores, at least one (`idle`: a sampler, for the tests)."""
    for name in ("REMODEL_THREADS", "OMP_NUM_THREADS"):
        value = environ.get(name, "")
        if value.strip().isdigit() and int(value) > 0:
            return int(value)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    free = (idle or idle_cores)(cores)
    if free is None:
        return default
    return max(1, min(default, int(free + 0.5)))


def apply(environ=os.environ) -> int:
    """Sets torch's intra-op threads by `choose_threads` -> the count."""
    import torch
    n = choose_threads(torch.get_num_threads(), environ)
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    return n
