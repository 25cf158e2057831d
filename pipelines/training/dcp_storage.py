"""DCP storage without pickle: raw tensor bytes, one file per rank, and JSON metadata.

torch's FileSystemWriter pickles the checkpoint's Metadata (`.metadata`) and torch.save's every tensor,
so reading a run directory someone sent you would unpickle it. RawWriter / RawReader keep DCP's planners,
sharded save and reshard-on-load, but each rank writes its chunks' bytes (C order, native little-endian)
to `__R_0.distcp`, and the coordinator writes `dcp_metadata.json`. The reader validates that JSON as
strictly as safetensors validates a header (known dtypes, each chunk inside its tensor, the chunks of a
tensor tiling it exactly, each chunk's bytes = numel x itemsize inside its file, no two overlapping) and
reads each chunk by a positioned read. A planted `.metadata` pickle is never opened.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import stat
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from remodel.models.checkpoint import DTYPE_NAMES, DTYPES
from remodel.models.files import read_json
from remodel.models.errors import RemodelError

METADATA = "dcp_metadata.json"
FORMAT = "remodel-dcp-raw"
VERSION = 1
_FILE = re.compile(r"__\d{1,6}_0\.distcp")
MAX_DIMS = 8
MAX_CHUNKS = 4096  # per tensor (a rank writes a few runs of each tensor it holds)


@contextlib.contextmanager
def plain_errors():
    """DCP wraps every rank's exception in a CheckpointException (a BaseException with tracebacks);
    re-raise a rank's own RemodelError / OSError (a full disk, a damaged file) so it stays one line.
    DCP's UserWarning that a single process saves / loads without torch.distributed (every such run
    does, on purpose) is silenced here, its one source; other warnings pass."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            yield
    except CheckpointException as e:
        excs = [exc for exc, _ in e.failures.values()]
        for exc in excs:
            if isinstance(exc, (RemodelError, OSError)):
                raise exc from None
        first = str(excs[0]).strip().splitlines() if excs else []
        raise RemodelError(f"checkpoint read/write failed: {type(excs[0]).__name__ if excs else 'error'}: "
                           f"{first[0][:300] if first else ''}") from None


def check_against(md: Metadata, sd: dict, where):
    """Every entry of the state dict `sd` ({key: tensor or Chunks}) is in the checkpoint with the same full
    size and dtype (a checkpoint of another shape must not load silently into a part of the model)."""
    for k, v in sd.items():
        m = md.state_dict_metadata.get(k)
        dtype = v.pieces[0][1].dtype if hasattr(v, "pieces") and v.pieces else getattr(v, "dtype", None)
        if m is None or tuple(m.size) != tuple(v.size()) or (dtype is not None and m.properties.dtype != dtype):
            got = "missing" if m is None else f"{tuple(m.size)} {m.properties.dtype}"
            raise RemodelError(f"{where}: {k!r} is {got}, this run holds {tuple(v.size())} {dtype}")


def _done(value) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


class RawWriter(StorageWriter):
    """Each rank writes its chunks to one file; the coordinator writes the JSON metadata last."""

    def __init__(self, path):
        super().__init__()
        self.path = Path(path)

    def reset(self, checkpoint_id=None):
        if checkpoint_id:
            self.path = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        pass

    def prepare_local_plan(self, plan):
        self.path.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans):
        return [dataclasses.replace(p, storage_data=f"__{i}_0.distcp") for i, p in enumerate(plans)]

    def write_data(self, plan, planner):
        results = []
        with open(self.path / plan.storage_data, "wb") as f:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise RemodelError(f"{item.index.fqn}: only tensors are checkpointed (no pickled objects)")
                t = planner.resolve_data(item).detach().to("cpu").contiguous()
                offset = f.tell()
                if t.numel():
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data)
                results.append(WriteResult(index=item.index, size_in_bytes=t.nbytes,
                                           storage_data=(plan.storage_data, offset, t.nbytes)))
            f.flush()
            os.fsync(f.fileno())
        return _done(results)

    def finish(self, metadata: Metadata, results) -> None:
        where = {wr.index: wr.storage_data for rs in results for wr in rs}
        tensors = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                raise RemodelError(f"{fqn}: only tensors are checkpointed (no pickled objects)")
            chunks = []
            for c in md.chunks:
                file, offset, length = where[MetadataIndex(fqn, c.offsets)]
                chunks.append({"offsets": list(c.offsets), "sizes": list(c.sizes), "file": file,
                               "offset": offset, "length": length})
            tensors[fqn] = {"dtype": DTYPE_NAMES[md.properties.dtype], "size": list(md.size), "chunks": chunks}
        tmp = self.path / (METADATA + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"format": FORMAT, "version": VERSION, "tensors": tensors}, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path / METADATA)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


def _ints(v, n=None) -> bool:
    return (isinstance(v, list) and (n is None or len(v) == n) and len(v) <= MAX_DIMS
            and all(type(x) is int and 0 <= x < 2**62 for x in v))


def _cut(lo: np.ndarray, hi: np.ndarray, group: np.ndarray) -> list | None:
    """The parts of `group` (indices of boxes [lo, hi)) split at every position of one dimension that no box
    straddles (sorted by start, a cut where the running end so far <= the next start); None when no
    dimension has such a cut."""
    for d in range(lo.shape[1]):
        order = group[np.argsort(lo[group, d], kind="stable")]
        reach = np.maximum.accumulate(hi[order, d])
        cuts = np.flatnonzero(reach[:-1] <= lo[order[1:], d]) + 1
        if len(cuts):
            return np.split(order, cuts)
    return None


def _disjoint(chunks, where: str):
    """The chunks of one tensor do not overlap (with volumes summing to numel: they tile it). Checked by
    guillotine cuts, O(n log n) per level on an explicit stack (no recursion): a group of boxes is split
    along any dimension where no box straddles a position, until single boxes remain. Every layout remodel
    writes (products of runs per dimension, FSDP / TP / EP splits) cuts down to single boxes; a group
    that cannot be cut overlaps (or is interleaved in a way no writer here produces): refused."""
    live = [c for c in chunks if math.prod(c["sizes"])]
    if len(live) < 2:
        return
    lo = np.array([c["offsets"] for c in live], dtype=np.int64).reshape(len(live), -1)
    hi = lo + np.array([c["sizes"] for c in live], dtype=np.int64).reshape(len(live), -1)
    stack = [np.arange(len(live))]
    while stack:
        group = stack.pop()
        if len(group) < 2:
            continue
        parts = _cut(lo, hi, group)
        if parts is None:
            raise RemodelError(f"{where}: overlapping chunks")
        stack.extend(parts)


def _check_tensor(fqn: str, e, sizes: dict, where: str) -> list:
    if not isinstance(e, dict) or not isinstance(e.get("dtype"), str) or e["dtype"] not in DTYPES \
            or not _ints(e.get("size")) \
            or not isinstance(e.get("chunks"), list) or len(e["chunks"]) > MAX_CHUNKS:
        raise RemodelError(f"{where}: malformed entry for {fqn!r}")
    item, dims = DTYPES[e["dtype"]].itemsize, len(e["size"])
    for c in e["chunks"]:
        if not isinstance(c, dict) or not _ints(c.get("offsets"), dims) or not _ints(c.get("sizes"), dims) \
                or any(o + s > n for o, s, n in zip(c["offsets"], c["sizes"], e["size"])):
            raise RemodelError(f"{where}: {fqn!r} has a chunk outside its size {e['size']}")
        if not isinstance(c.get("file"), str) or c["file"] not in sizes:
            raise RemodelError(f"{where}: {fqn!r} names a data file that is not in the checkpoint")
        if type(c.get("offset")) is not int or type(c.get("length")) is not int or c["offset"] < 0 \
                or c["length"] != math.prod(c["sizes"]) * item or c["offset"] + c["length"] > sizes[c["file"]]:
            raise RemodelError(f"{where}: {fqn!r} has a byte range that does not match its chunk or file")
    if sum(math.prod(c["sizes"]) for c in e["chunks"]) != math.prod(e["size"]):
        raise RemodelError(f"{where}: the chunks of {fqn!r} do not cover it exactly")
    _disjoint(e["chunks"], f"{where}: {fqn!r}")
    return e["chunks"]


def _data_files(ckpt: Path) -> dict:
    """{name: bytes} of the regular data files (others are refused when named)."""
    out = {}
    for p in ckpt.iterdir():
        if _FILE.fullmatch(p.name):
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                out[p.name] = st.st_size
    return out


def _no_byte_overlap(tensors: dict, where: str):
    spans = sorted((c["file"], c["offset"], c["offset"] + c["length"]) for e in tensors.values()
                   for c in e["chunks"] if c["length"])
    for (f1, _, e1), (f2, s2, _) in zip(spans, spans[1:]):
        if f1 == f2 and s2 < e1:
            raise RemodelError(f"{where}: two chunks share bytes of {f1}")


def read_metadata(ckpt) -> Metadata:
    """The validated Metadata of a checkpoint written by RawWriter (see the module doc)."""
    ckpt = Path(ckpt)
    path = ckpt / METADATA
    if not path.exists() and (ckpt / ".metadata").exists():
        raise RemodelError(f"{ckpt}: checkpoint with pickled DCP metadata (an older remodel); it is not read, "
                           "since unpickling can run code")
    md = read_json(path)
    if md.get("format") != FORMAT or md.get("version") != VERSION or not isinstance(md.get("tensors"), dict):
        raise RemodelError(f"{path}: not a {FORMAT} v{VERSION} checkpoint index")
    sizes = _data_files(ckpt)
    sd_md, storage = {}, {}
    for fqn, e in md["tensors"].items():
        chunks = _check_tensor(fqn, e, sizes, str(path))
        dtype = DTYPES[e["dtype"]]
        sd_md[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(e["size"]),
                                           [ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"]))
                                            for c in chunks])
        for c in chunks:
            storage[MetadataIndex(fqn, torch.Size(c["offsets"]))] = (c["file"], c["offset"], dtype, c["sizes"])
    _no_byte_overlap(md["tensors"], str(path))
    return Metadata(state_dict_metadata=sd_md, storage_data=storage, storage_meta=StorageMeta())


class RawReader(StorageReader):
    """Reads a RawWriter checkpoint; the metadata is parsed once and validated (read_metadata)."""

    def __init__(self, path):
        super().__init__()
        self.path = Path(path)
        self._metadata = None

    def reset(self, checkpoint_id=None):
        if checkpoint_id and Path(checkpoint_id) != self.path:
            self.path, self._metadata = Path(checkpoint_id), None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            self._metadata = read_metadata(self.path)
        return self._metadata

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        fds = {}
        try:
            for req in plan.items:
                if req.type == LoadItemType.BYTE_IO:
                    raise RemodelError(f"{req.storage_index.fqn}: only tensors are read from a checkpoint")
                file, offset, dtype, sizes = self.storage[req.storage_index]
                if file not in fds:
                    fds[file] = os.open(self.path / file, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
                t = _read_narrow(fds[file], offset, dtype, sizes, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                target.copy_(t)
                planner.commit_tensor(req, target)
        finally:
            for fd in fds.values():
                os.close(fd)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


def _read_narrow(fd: int, offset: int, dtype, sizes, starts, lengths) -> torch.Tensor:
    """The box [starts, starts + lengths) of a stored C-order chunk: only the rows of dim 0 it spans are
    read (a resharded load reads its slice, not the whole chunk)."""
    item = dtype.itemsize
    row = math.prod(sizes[1:]) * item if sizes else item
    a, n = (starts[0], lengths[0]) if sizes else (0, 1)
    if n * row == 0:
        return torch.empty([n, *sizes[1:]] if sizes else [], dtype=dtype)
    buf = bytearray(n * row)
    if os.preadv(fd, [memoryview(buf)], offset + a * row) != len(buf):
        raise RemodelError("truncated checkpoint data file")
    t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape([n, *sizes[1:]] if sizes else [])
    for d in range(1, len(sizes)):
        t = t.narrow(d, starts[d], lengths[d])
    return t
