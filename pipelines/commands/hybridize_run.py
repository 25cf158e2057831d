"""`remodel hybridize` under torchrun: rank 0 alone converts MODEL and writes OUT.init (measuring --select kl on
the way) while the other ranks wait on the long-timeout group; its outcome, the measured costs or its error, is
then shared, so every rank trains from the same OUT.init and an input rank 0 refuses fails on every rank with
rank 0's one line (cli prints it once). In one process the work just runs."""
from __future__ import annotations

import torch
import torch.distributed as dist

from remodel.models.errors import RemodelError
from remodel.models.load import load_config

from ..distributed.runtime import init_dist, pick_device, layout, rank, wait, wait_group, world_size


def lead() -> bool:
    """Whether this process reports: rank 0, or the only process."""
    return rank() == 0


def kept_in(init_dir, p: dict) -> list[int]:
    """The attention layers (indices among p["layers"]) the hybrid written to `init_dir` kept: a resumed
    --select kl run goes on with the layers it measured, not the evenly spaced ones."""
    mixers = {s.kind.section_name for s in p["new_cfg"].slots if s.index in p["replaced"]}
    slots = load_config(init_dir).slots
    return [j for j, i in enumerate(p["layers"]) if slots[i].kind.section_name not in mixers]


def check_processes(tp: int, ep: int, batch: int) -> None:
    """The parallel layout's one-line errors, before the conversion (the trainer meets them after it)."""
    if tp * ep > 1 and world_size() <= 1:
        raise RemodelError(f"--tp {tp} / --ep {ep} need one process per rank: launch with `torchrun "
                           "--nproc-per-node N cli.py hybridize ...`")
    layout(world_size(), tp, ep, batch)


def on_lead(work, device="auto") -> list | None:
    """work() -> a list of floats or None, run by rank 0 alone under torchrun (the process group formed on
    `device`), the others waiting; -> its result on every rank. Rank 0's error is raised on every rank."""
    if world_size() <= 1:
        return work()
    init_dist(pick_device(device))
    group = wait_group()
    wait(group)  # every rank past its own input checks before rank 0 writes (OUT.init would fail theirs)
    msg, result, err = "", None, None
    if rank() == 0:
        try:
            result = work()
        except RemodelError as e:
            msg, err = str(e), e
        except OSError as e:  # as cli words it, so that the other ranks' line is the same
            msg = f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")
            err = RemodelError(msg)
        except Exception as e:  # a bug: rank 0's traceback, the others stop rather than wait
            msg, err = f"rank 0 failed converting: {type(e).__name__}: {e}", e
    msg, result = _share(msg, result, group)
    if err is not None:
        raise err
    if msg:
        raise RemodelError(msg)
    return result


def _share(msg: str, values: list | None, group) -> tuple[str, list | None]:
    """Rank 0's (message, values) on every rank: broadcast as tensors (lengths, utf-8 bytes, float64s)."""
    me = rank() == 0
    text = msg.encode() if me else b""
    head = torch.tensor([len(text), -1 if values is None else len(values)] if me else [0, 0], dtype=torch.int64)
    dist.broadcast(head, 0, group=group)
    n, m = head.tolist()
    buf = torch.tensor(list(text), dtype=torch.uint8) if me else torch.empty(n, dtype=torch.uint8)
    vals = torch.tensor(values or [], dtype=torch.float64) if me else torch.empty(max(m, 0), dtype=torch.float64)
    if n:
        dist.broadcast(buf, 0, group=group)
    if m > 0:
        dist.broadcast(vals, 0, group=group)
    return bytes(buf.tolist()).decode(), (vals.tolist() if m >= 0 else None)
