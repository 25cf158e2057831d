"""What a training run writes into its run dir and takes back: an earlier run's files cleared at the first save
of a run that starts over, weights refused when not finite (no checkpoint of them), and the first step's files
removed when the run fails there (an older run's files stay; a later failure keeps them to --resume from)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from remodel.models.errors import RemodelError
from remodel.models.load import read_config_dict

from . import train_state as state
from ..distributed.parallel import local_tensor
from ..distributed.runtime import LOCK_NAME


def clear_run_dir(run_dir: Path):
    """Empty run_dir of an earlier run's files, all but the lock this run holds on it and the run marker."""
    for q in run_dir.iterdir():
        if q.name in (LOCK_NAME, state.RUN_MARKER):
            continue
        if q.is_dir() and not q.is_symlink():
            shutil.rmtree(q)
        else:
            q.unlink()


@torch.no_grad()
def check_finite(step: int, modules, dev):
    """Refuse (every rank, one line) to save weights that are NaN or inf (a float16 update that overflowed):
    no checkpoint of them is written. Collective."""
    params = [q for m in modules if m is not None for q in m.parameters()]
    bad = torch.zeros((), dtype=torch.int32, device=dev)
    for q in params:
        t = local_tensor(q)
        if t.is_floating_point() and t.numel():
            bad += (~torch.isfinite(t)).any().to(torch.int32)
    if dist.is_initialized():
        dist.all_reduce(bad)
    if int(bad):
        dtype = str(next(iter(params)).dtype).replace("torch.", "")
        raise RemodelError(f"the weights became NaN or inf by step {step} (training in {dtype}; a lower --lr "
                           "or a wider dtype may help); no checkpoint of them was written")


def discard(written: list, saver, lead: bool):
    """Remove the checkpoints `written` by a run's first step (rank 0), after its background save ended."""
    try:
        saver.wait()  # a background save of that step ends before its folder goes
    except BaseException:  # noqa: BLE001 - the run's own error is the one reported
        pass
    if lead:
        for d in written:
            shutil.rmtree(d, ignore_errors=True)
            shutil.rmtree(d.parent / f".{d.name}.partial", ignore_errors=True)


def keep_upcycle_origin(student_dir: Path, config: Path):
    """The written config.json keeps how an upcycled student's experts were built (UPCYCLE_KEY, from
    `remodel upcycle`), so a later run on OUT still reports the same-shard expert similarity."""
    from remodel.upcycle.similarity import UPCYCLE_KEY
    origin = read_config_dict(student_dir).get(UPCYCLE_KEY)
    if isinstance(origin, dict) and config.exists():
        c = json.loads(config.read_text())
        c[UPCYCLE_KEY] = origin
        config.write_text(json.dumps(c, indent=2) + "\n")
