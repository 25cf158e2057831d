"""The resumable state of a training run: `<out>.run/step-NNNNNN/` checkpoints.

Each holds the full (unsharded) model, optimizer, RNG and data position in the single-process format
(safetensors for tensors, JSON for the rest, no pickle), written atomically (a temporary sibling renamed
at the end), so a run resumes exactly under any layout, also in one process. The last `keep_last` are
kept. `snapshot` gathers a (possibly sharded) run's state on rank 0; `local_optimizer_tensors` shards a
checkpoint's optimizer state back to this rank.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from models.checkpoint import atomic_output_dir, read_header
from models.errors import RemodelError

from .parallel import _rank, _size, _unshard_all, full_state_dict, shard_tensor

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_TENSORS, STATE_JSON = "state.safetensors", "state.json"


def run_dir_for(out) -> Path:
    """Where the resumable checkpoints of a run writing OUT live: `<out>.run/`."""
    out = Path(out).absolute()
    return out.parent / (out.name + ".run")


def _fsync(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_state(tmp: Path, tensors: dict, meta: dict):
    """The files of one checkpoint: tensors first, the JSON (which marks it readable) last."""
    save_file(tensors, tmp / STATE_TENSORS)
    (tmp / STATE_JSON).write_text(json.dumps(meta) + "\n")
    for f in (STATE_TENSORS, STATE_JSON):
        _fsync(tmp / f)


def optimizer_state(opt: torch.optim.Optimizer, sd: dict | None = None) -> tuple[dict, dict]:
    """Optimizer state_dict (`opt`'s, or `sd`) split into ({'optim.<param>.<key>': tensor}, JSON-able rest)."""
    sd = opt.state_dict() if sd is None else sd
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"optim.{pid}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{k}"] = v
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def load_optimizer_state(opt: torch.optim.Optimizer, tensors: dict, meta: dict):
    state: dict = {}
    for name, t in tensors.items():
        if name.startswith("optim."):
            _, pid, k = name.split(".", 2)
            state.setdefault(int(pid), {})[k] = t
    for key, v in meta["scalars"].items():
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
              for g in meta["param_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})


def rng_state(device: torch.device) -> dict:
    out = {"rng.torch": torch.get_rng_state()}
    if device.type == "cuda":
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = s
    return out


def set_rng_state(tensors: dict, device: torch.device):
    torch.set_rng_state(tensors["rng.torch"])
    cuda = sorted((k for k in tensors if k.startswith("rng.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1]))
    if device.type == "cuda" and cuda:
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])


def save_checkpoint(run_dir: Path, step: int, tensors: dict, meta: dict, keep_last: int) -> Path:
    """Write `run_dir/step-NNNNNN/` atomically, then delete all but the newest `keep_last`."""
    final = run_dir / f"step-{step:06d}"
    with atomic_output_dir(final, overwrite=True) as tmp:
        _write_state(tmp, tensors, meta)
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        gone = old.parent / f".{old.name}.del-{os.getpid()}"
        old.rename(gone)  # a kill during rmtree leaves a hidden dir, never a half checkpoint
        shutil.rmtree(gone, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """step-* dirs, oldest first (complete by construction: they appear by rename)."""
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def _readable(ckpt: Path) -> bool:
    try:
        json.loads((ckpt / STATE_JSON).read_text())
        read_header(ckpt / STATE_TENSORS)
        return True
    except (OSError, ValueError, RemodelError):
        return False


def latest_checkpoint(run_dir: Path) -> Path | None:
    for ckpt in reversed(list_checkpoints(run_dir)):
        if _readable(ckpt):
            return ckpt
        tqdm.write(f"skipping unreadable checkpoint {ckpt}")
    return None


def load_checkpoint(ckpt: Path) -> tuple[dict, dict]:
    return load_file(ckpt / STATE_TENSORS), json.loads((ckpt / STATE_JSON).read_text())


def clean_stale(run_dir: Path):
    """Remove temporaries left by a killed writer (hidden .step-* dirs)."""
    if run_dir.is_dir():
        for p in run_dir.iterdir():
            if p.name.startswith(".step-"):
                shutil.rmtree(p, ignore_errors=True)


def param_order(params: dict) -> list[str]:
    """Names in the optimizer's parameter-id order (build_optimizer: matrices first, then the rest)."""
    return [n for n, p in params.items() if p.ndim >= 2] + [n for n, p in params.items() if p.ndim < 2]


def _full_optimizer_state(opt, order, info) -> dict:
    """opt.state_dict() with every sharded state tensor gathered to full (valid on rank 0; collective)."""
    sd = opt.state_dict()
    state = {pid: dict(st) for pid, st in sd["state"].items()}
    keys = sorted({k for st in state.values() for k, v in st.items() if torch.is_tensor(v) and k != "step"})
    holder = _Named(info)
    for k in keys:  # exp_avg, exp_avg_sq: sharded like their parameter
        pids = [pid for pid in sorted(state) if k in state[pid]]
        full = _unshard_all(holder, [(order[pid], state[pid][k]) for pid in pids], rank0_only=True)
        for pid in pids:
            state[pid][k] = full.get(order[pid])
    return {"state": state, "param_groups": sd["param_groups"]}


class _Named:
    """Stand-in model for parallel._unshard_all, which reads only its ParallelInfo."""

    def __init__(self, info):
        self._parallel = info


def snapshot(student, projections, opt, order, info, dev, meta: dict):
    """(tensors, meta) of a checkpoint in this module's format on rank 0, (None, None) elsewhere."""
    model_sd = full_state_dict(student)
    opt_sd = _full_optimizer_state(opt, order, info)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None, None
    tensors = {f"model.{k}": v.contiguous() for k, v in model_sd.items()}
    if projections is not None:
        tensors.update({f"proj.{k}": v.detach().cpu().contiguous() for k, v in projections.state_dict().items()})
    opt_t, opt_meta = optimizer_state(None, opt_sd)
    tensors.update({k: v.detach().cpu().contiguous() for k, v in opt_t.items()})
    tensors.update(rng_state(dev))
    return tensors, {**meta, "optimizer": opt_meta}


def local_optimizer_tensors(ck_tensors: dict, order, params: dict, info, dev) -> dict:
    """A checkpoint's full optimizer tensors -> this rank's shards (TP/EP spec, then FSDP's DTensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    out = {}
    for key, t in ck_tensors.items():
        if not key.startswith("optim."):
            continue
        _, pid, k = key.split(".", 2)
        name = order[int(pid)]
        p = params[name]
        if k != "step":
            t = t.to(dev)
            spec = info.specs.get(name)
            if spec is not None:
                kind, dim, sizes = spec
                g = info.tp_group if kind == "tp" else info.ep_group
                t = shard_tensor(t, dim, sizes, _rank(g), _size(g)).contiguous()
            if isinstance(p, DTensor):
                t = distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None)
        out[key] = t
    return out
