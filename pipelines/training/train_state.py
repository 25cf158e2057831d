"""The resumable state of a training run: `<out>.run/step-NNNNNN/`, torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the model, the AdamW moments and the projections in parallel (no
gather): each tensor is described to DCP as the rectangular chunks of the full tensor that this rank
holds (`Chunks`: the TP / EP split composed with FSDP2's dim-0 chunk, see pipelines.distributed.sharded.local_index),
keyed by parameter name, so a checkpoint is independent of the layout that wrote it. Replicas (a
TP-replicated norm on every tp rank) are written by one rank only. On load every rank asks DCP for
exactly the chunks it holds under the new layout (DP 4 -> DP 2 x TP 2 -> one process). Rank 0 adds
meta.json (step, data position, history, args, per-parameter AdamW step counts) last; the directory
appears by rename from `.step-NNNNNN.partial`, so a kill during a save leaves the previous checkpoint
usable. `save(..., background=True)` writes a staged CPU copy on a thread with its own gloo group.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import threading
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from remodel.models.outputs import check_owned, mark_dir
from remodel.models.errors import RemodelError
from remodel.models.regions import runs

from .dcp_storage import METADATA, RawReader, RawWriter, check_against, plain_errors
from .run_meta import check_meta
from ..distributed.parallel import local_tensor, parallel_info, sharded_dims
from ..distributed.sharded import local_index

STEP_DIR = re.compile(r"^step-(\d+)$")
META = "meta.json"
AUX = "aux"  # the student's tokenizer files, copied into every checkpoint (see _write_aux)
MOMENTS = ("exp_avg", "exp_avg_sq")


def run_dir_for(out) -> Path:
    """Where the resumable checkpoints of a run writing OUT live: `<out>.run/`."""
    out = Path(out).absolute()
    return out.parent / (out.name + ".run")


RUN_MARKER = ".remodel-run"  # written into every run directory remodel makes (models.outputs.check_owned)


def _legacy_run(run_dir: Path) -> bool:
    """A run directory of an older remodel (before RUN_MARKER): it holds a step-* checkpoint with its
    meta.json, so --resume of an old run still works."""
    return any(STEP_DIR.match(p.name) and (p / META).is_file() for p in run_dir.iterdir())


def check_run_dir(run_dir: Path, out: Path, inputs):
    """Refuse, in one line and with nothing touched, a run directory remodel may not write in or empty: a
    symlink, a file, a folder it did not make (no RUN_MARKER, no checkpoint of an older remodel), or one
    that holds an input of this run (--overwrite would delete it before it is read)."""
    check_owned(run_dir, RUN_MARKER, f"the run directory of {out}", _legacy_run)
    real = run_dir.resolve()
    for name, inp in inputs:
        p = Path(inp).expanduser().resolve()
        if p == real or real in p.parents:
            raise RemodelError(f"{inp}: {name} lies inside the run directory {run_dir}, which this run rewrites; "
                               "move it out first")


def mark_run_dir(run_dir: Path) -> bool:
    """Write RUN_MARKER into run_dir when it lacks one; True when this call wrote it."""
    if (run_dir / RUN_MARKER).is_file():
        return False
    mark_dir(run_dir, RUN_MARKER, kind="train run")
    return True


def unmark_unused(run_dir: Path, always: bool = False):
    """Remove RUN_MARKER again when the run dir holds nothing else (a refused or checkpoint-less run), or
    `always` (the run that wrote it saved nothing: an older run's files stay as they were)."""
    try:
        if always or {p.name for p in run_dir.iterdir()} <= {RUN_MARKER, ".lock"}:
            (run_dir / RUN_MARKER).unlink()
    except OSError:
        pass


# ---- a rank's chunks of one tensor, as DCP sees them ---------------------------------------------

class Chunks:
    """This rank's rectangular pieces of a full tensor of shape `size`: [(offsets, view of local data)].
    Implements the parts of DCP's checkpointable protocol its planners call (write items, chunk list)."""

    def __init__(self, size, pieces):
        self._size = torch.Size(size)
        self.pieces = [(torch.Size(o), t) for o, t in pieces]

    def size(self):
        return self._size

    def __create_write_items__(self, fqn, obj):
        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=o, sizes=t.size()),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self._size))
                for o, t in self.pieces]

    def __create_chunk_list__(self):
        return [ChunkStorageMetadata(offsets=o, sizes=t.size()) for o, t in self.pieces]

    def __get_tensor_shard__(self, index):
        for o, t in self.pieces:
            if o == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no local chunk at offset {tuple(index.offset)}")


def _lookup(state_dict, index):
    obj = state_dict[index.fqn]
    return obj.__get_tensor_shard__(index) if isinstance(obj, Chunks) else None


class _SavePlanner(DefaultSavePlanner):
    """DCP's default planner over a flat {key: Chunks or tensor} dict."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index):
        return _lookup(self.state_dict, index) if isinstance(self.state_dict.get(index.fqn), Chunks) \
            else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner over a flat {key: Chunks or tensor} dict (its set-up would replace the
    Chunks: it only knows tensors)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index):
        return _lookup(self.state_dict, index) if isinstance(self.state_dict.get(index.fqn), Chunks) \
            else super().lookup_tensor(index)


def chunks_of(local: torch.Tensor, idx: list, full_shape) -> Chunks:
    """Chunks of a local shard whose rows / columns are the full-tensor indices `idx` (runs of
    consecutive indices become separate rectangular pieces)."""
    dims = [runs(i) if i is not None else [(0, 0, n)] for i, n in zip(idx, full_shape)]
    pieces = []
    for combo in itertools.product(*dims):
        where = tuple(slice(p, p + (b - a)) for p, a, b in combo)
        pieces.append((tuple(a for _, a, _ in combo), local[where]))
    return Chunks(full_shape, pieces)


def _owner(model, name: str, t) -> bool:
    """Whether this rank writes its copy of `name`: replicas over a mesh dimension that does not split
    the tensor are written by the rank at coordinate 0 of that dimension."""
    info = parallel_info(model)
    if info.mesh is None:
        return True
    uses = {info.dims.get(t.device_mesh.mesh_dim_names[i]) for i, _ in sharded_dims(t)}
    spec = info.specs.get(name)
    if spec is not None:
        uses.add("tp" if spec[0] == "tp" else info.ep_over)
    coords = {"dp": info.dp_rank, "tp": info.tp_rank}
    return all(coords[d] == 0 for d in coords if d not in uses)


def state_dict(student, projections, opt, saving: bool) -> dict:
    """{key: Chunks or tensor} of the trainable state on this rank (saving: replicas once, see _owner)."""
    sd, shapes = {}, _shapes(student)
    params = dict(student.named_parameters())
    for name, t in list(params.items()) + list(student.named_buffers()):
        if name not in shapes or (saving and not _owner(student, name, t)):
            continue
        full = shapes[name]
        idx = local_index(student, name, t, full)
        sd[f"model.{name}"] = chunks_of(local_tensor(t), idx, full)
        st = opt.state.get(t, {}) if name in params else {}
        for k in MOMENTS:
            if k in st:
                sd[f"optim.{name}.{k}"] = chunks_of(local_tensor(st[k]), idx, full)
    for name, t in (projections.named_parameters() if projections is not None else []):
        sd[f"proj.{name}"] = t.data
        for k in MOMENTS:
            if k in opt.state.get(t, {}):
                sd[f"optim.proj.{name}.{k}"] = opt.state[t][k]
    return sd


def _shapes(model):
    from remodel.models.hf import our_shapes
    return our_shapes(model.cfg)


def _named_params(student, projections):
    out = dict(student.named_parameters())
    if projections is not None:
        out.update({f"proj.{k}": p for k, p in projections.named_parameters()})
    return out


# ---- save ---------------------------------------------------------------------------------------

def _stage(sd: dict) -> dict:
    """A CPU copy of a state dict (for a background save while training goes on)."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, Chunks):
            out[k] = Chunks(v.size(), [(o, t.detach().to("cpu", copy=True)) for o, t in v.pieces])
        else:
            out[k] = v.detach().to("cpu", copy=True)
    return out


class Saver:
    """Writes checkpoints; with background=True each save runs on a thread (one at a time) with its own
    gloo group, so the next training steps overlap the writing."""

    def __init__(self, run_dir: Path, keep_last: int, background: bool = False, group=None):
        from ..distributed.runtime import wait_group
        self.run_dir, self.keep_last, self.background = run_dir, keep_last, background
        self.group = group  # long-timeout gloo group: writing a large shard may outlast the step timeout
        if background and dist.is_initialized():
            self.group = wait_group()  # its own: the save thread's collectives beside the main thread's
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def save(self, step: int, student, projections, opt, meta: dict, prune: bool = True):
        """Write checkpoint `step`; prune=False keeps every older one (a run's first step: it may still fail,
        and then an older run's checkpoints must all be there; see prune_checkpoints)."""
        self.wait()
        keep_last = self.keep_last if prune else 0
        sd = state_dict(student, projections, opt, saving=True)
        sd["rng.torch"] = torch.get_rng_state()
        params = _named_params(student, projections)
        meta = {**meta, "adam_steps": {n: float(opt.state[p]["step"]) for n, p in params.items()
                                       if "step" in opt.state.get(p, {})}}
        if not self.background:
            return _write(self.run_dir, step, sd, meta, keep_last, self.group)
        staged = _stage(sd)
        self.thread = threading.Thread(target=self._run, args=(step, staged, meta, keep_last), daemon=True)
        self.thread.start()

    def _run(self, step, sd, meta, keep_last):
        try:
            _write(self.run_dir, step, sd, meta, keep_last, self.group)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait() on the training thread
            self.error = e

    def wait(self):
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            e, self.error = self.error, None
            raise e


def _write(run_dir: Path, step: int, sd: dict, meta: dict, keep_last: int, group) -> Path:
    lead = not dist.is_initialized() or dist.get_rank() == 0
    final = run_dir / f"step-{step:06d}"
    tmp = run_dir / f".step-{step:06d}.partial"
    if lead and tmp.exists():
        shutil.rmtree(tmp)
    _barrier(group)
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        with plain_errors():
            dcp.save(sd, storage_writer=RawWriter(tmp), planner=_SavePlanner(), process_group=group,
                     no_dist=not dist.is_initialized())
        if lead:
            _write_aux(tmp, meta.get("args", {}).get("student_dir"))
            _write_meta(tmp, meta)
    except BaseException:  # a full disk, a failed rank: the partial checkpoint goes, the previous stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if lead:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync(run_dir)
        prune_checkpoints(run_dir, keep_last)
    _barrier(group)
    return final


def prune_checkpoints(run_dir: Path, keep_last: int):
    """Remove all but the newest `keep_last` checkpoints (0: keep every one)."""
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        gone = old.parent / f".{old.name}.del-{os.getpid()}"
        old.rename(gone)  # a kill during rmtree leaves a hidden dir, never a half checkpoint
        shutil.rmtree(gone, ignore_errors=True)


def _barrier(group):
    if dist.is_initialized():
        dist.barrier(group=group)


def _fsync(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_aux(tmp: Path, student_dir):
    """The student's tokenizer and generation files (checkpoint.AUX_FILES), copied into the checkpoint's
    AUX folder, so `remodel convert` of a run exports them from the run itself and never follows a path
    stored in meta.json (which could name any folder)."""
    from remodel.models.checkpoint import aux_files
    files = aux_files(student_dir) if student_dir else []
    if files:
        (tmp / AUX).mkdir()
        for f in files:
            shutil.copyfile(f, tmp / AUX / f.name)


def _write_meta(tmp: Path, meta: dict):
    """meta.json last: its presence marks the DCP files beside it complete."""
    (tmp / META).write_text(json.dumps(meta) + "\n")
    _fsync(tmp / META)


# ---- find and load --------------------------------------------------------------------------------

def list_checkpoints(run_dir: Path) -> list[Path]:
    """step-* dirs, oldest first (complete by construction: they appear by rename)."""
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def read_meta(ckpt: Path) -> dict:
    """meta.json of a checkpoint (bounded strict JSON, a regular file), checked by check_meta against its
    directory."""
    from remodel.models.files import read_json
    path = Path(ckpt) / META
    m = STEP_DIR.match(Path(ckpt).name)
    return check_meta(read_json(path), path, int(m.group(1)) if m else None)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest step-N directory, checked (meta.json against its directory, the DCP index present).
    Step directories appear by rename, so one that fails the check was tampered with or damaged: that is
    an error naming it, never a silent resume from an older step."""
    found = list_checkpoints(run_dir)
    if not found:
        return None
    ckpt = found[-1]
    try:
        read_meta(ckpt)
    except RemodelError as e:
        raise RemodelError(f"{e} (delete {ckpt.name} to resume from the checkpoint before it)") from None
    if not (ckpt / METADATA).is_file():
        raise RemodelError(f"{ckpt}: no {METADATA} (an older remodel's pickled DCP metadata is not read; "
                           f"delete {ckpt.name} to resume from the checkpoint before it)")
    return ckpt


def clean_stale(run_dir: Path):
    """Remove temporaries left by a killed writer (hidden .step-* dirs)."""
    if run_dir.is_dir():
        for p in run_dir.iterdir():
            if p.name.startswith(".step-"):
                shutil.rmtree(p, ignore_errors=True)


@torch.no_grad()
def load(ckpt: Path, student, projections, opt) -> dict:
    """Fill this rank's shards of the model, projections, AdamW state and the RNG from `ckpt` (any
    layout wrote it); -> its meta. Collective."""
    meta = read_meta(ckpt)
    for name, p in _named_params(student, projections).items():
        if name in meta["adam_steps"]:
            opt.state[p] = {"step": torch.tensor(meta["adam_steps"][name], dtype=torch.float32),
                            "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    sd = state_dict(student, projections, opt, saving=False)
    sd["rng.torch"] = torch.empty_like(torch.get_rng_state())
    reader = RawReader(ckpt)
    check_against(reader.read_metadata(), sd, ckpt)
    with plain_errors():
        dcp.load(sd, storage_reader=reader, planner=_LoadPlanner(), no_dist=not dist.is_initialized())
    _check_moments(opt, _named_params(student, projections), ckpt)
    torch.set_rng_state(_checked_rng(sd["rng.torch"], ckpt))
    return meta


def _check_moments(opt, params: dict, ckpt):
    """AdamW's moments as read (this rank's shards): exp_avg finite, exp_avg_sq finite and >= 0 (its
    square root divides the update: a negative one writes NaN weights). Checked before any step uses them."""
    for name, p in params.items():
        st = opt.state.get(p, {})
        for k in MOMENTS:
            t = local_tensor(st[k]) if k in st else None
            if t is not None and not (bool(torch.isfinite(t).all()) and (k == "exp_avg" or bool((t >= 0).all()))):
                want = "finite" if k == "exp_avg" else "finite and >= 0"
                raise RemodelError(f"{ckpt}: AdamW state {k} of {name!r} is not {want} (corrupt checkpoint)")


def _checked_rng(state: torch.Tensor, ckpt) -> torch.Tensor:
    """The CPU generator state as read, tried on a scratch generator first: garbage bytes of the right
    size are a one-line error, and the global generator is only set from a state that loads."""
    want = torch.get_rng_state()
    if state.dtype != want.dtype or state.shape != want.shape:
        raise RemodelError(f"{ckpt}: RNG state is {state.dtype} {tuple(state.shape)}, not {want.dtype} "
                           f"{tuple(want.shape)} (corrupt checkpoint)")
    try:
        torch.Generator().set_state(state)
    except (RuntimeError, ValueError) as e:
        raise RemodelError(f"{ckpt}: RNG state does not load ({str(e).strip().splitlines()[0][:120]}; "
                           "corrupt checkpoint)") from None
    return state


def read_full(ckpt: Path, prefix: str = "model.") -> dict:
    """Whole tensors of a checkpoint (small models and tests; `remodel convert` streams instead)."""
    reader = RawReader(ckpt)
    md = reader.read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if k.startswith(prefix)}
    with plain_errors():
        dcp.load(sd, storage_reader=reader, planner=_LoadPlanner(), no_dist=True)
    return sd


def read_tensor(ckpt: Path, key: str, reader: RawReader | None = None) -> torch.Tensor:
    """One whole tensor of a DCP checkpoint (peak memory: that tensor), e.g. for a streaming export;
    pass the same `reader` for several tensors so the metadata is parsed and validated once."""
    reader = reader or RawReader(ckpt)
    md = reader.read_metadata().state_dict_metadata.get(key)
    if md is None:
        raise RemodelError(f"{ckpt}: checkpoint has no tensor {key!r}")
    sd = {key: torch.empty(md.size, dtype=md.properties.dtype)}
    with plain_errors():
        dcp.load(sd, storage_reader=reader, planner=_LoadPlanner(), no_dist=True)
    return sd[key]
