"""Read parts of a Hugging Face checkpoint's tensors, addressed by our parameter names.

A sharded rank needs only its own rows / columns / experts of each tensor: `RegionReader.read(name,
index)` reads exactly that region, never the whole tensor. `index` has one entry per dimension: None
(all of it) or a 1-D LongTensor of the indices kept, read as runs of consecutive indices. The reads are
positioned reads (os.preadv) of the byte spans the region covers, like safetensors' get_slice but
without its memory map: a column slice of a row-major tensor touches every page of it, and mapped
pages count as the rank's resident memory. Fused expert tensors [E, ...] are read from the per-expert
HF tensors (or a fused 3-D HF tensor) of the experts kept.
"""
from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import numpy as np
import torch

from .checkpoint import DTYPES, INDEX, SINGLE, read_header, read_index
from .files import check_weight_dtype, read_json
from .errors import RemodelError
from .families import FAMILIES
from .hf import config_from_hf, our_shapes, weight_table
from .hf_adapter import to_hf_part


def runs(idx: torch.Tensor) -> list[tuple[int, int, int]]:
    """(position in idx, start, stop) of each run of consecutive values in a 1-D index tensor."""
    out, v = [], idx.tolist()
    i = 0
    while i < len(v):
        j = i
        while j + 1 < len(v) and v[j + 1] == v[j] + 1:
            j += 1
        out.append((i, v[i], v[j] + 1))
        i = j + 1
    return out


class RegionReader:
    """Our-name -> region reads from a HF checkpoint directory (safetensors only)."""

    def __init__(self, path, family: str | None = None):
        self.path = Path(path)
        self.config = read_json(self.path / "config.json")
        self.cfg = config_from_hf(self.config)
        self.family = family or self.config.get("model_type")
        if (self.path / SINGLE).is_file():
            shards = [SINGLE]
        elif (self.path / INDEX).is_file():
            shards = sorted(set(read_index(self.path / INDEX).values()))
        else:
            raise RemodelError(f"{self.path}: no {SINGLE} or {INDEX}")
        self.where = {}  # HF name -> (file, absolute data offset, dtype, shape)
        for shard in shards:
            if not (self.path / shard).is_file():
                raise RemodelError(f"{self.path / INDEX}: shard {shard!r} does not exist in {self.path}")
            start, header = read_header(self.path / shard)
            for k, e in header.items():
                self.where[k] = (self.path / shard, start + e["data_offsets"][0], DTYPES[e["dtype"]], e["shape"])
        self.shapes = our_shapes(self.cfg)
        self.rows: dict[str, list[tuple[str, int | None]]] = {}
        self.parts = {}  # our name -> its Part of an HF tensor that concatenates several of ours
        for ours, hf, e in weight_table(self.cfg, self.family):
            self.rows.setdefault(ours, []).append((hf, e))
            self.parts.setdefault(ours, to_hf_part(self.cfg, self.family, ours, e))
        self._check_shapes()
        self._fds: dict[Path, int] = {}

    def _check_shapes(self):
        """Every (non-expert) HF tensor in the shape the config implies, before any read: a region read
        trusts the shape, so a mismatch would read the wrong rows. One line; a layout that load.py reads
        by regrouping (Family.regrouped) is named, with the command that rewrites it."""
        for ours, ((hf, e), *_) in self.rows.items():
            if e is not None or hf not in self.where:
                continue
            have, want = list(self.where[hf][3]), list(self.parts[ours].hf_shape(self.shapes[ours]))
            if have != want:
                fix = ("; `remodel convert` rewrites it in the layout sharded loading reads"
                       if FAMILIES[self.family].regrouped(ours, hf) else "")
                raise RemodelError(f"{self.path}: tensor {hf} has shape {have} but the config implies {want}{fix}")

    def _entry(self, hf: str, expert: int | None):
        """(file, data offset, dtype, shape, leading index) of one HF tensor, whatever its on-disk variant."""
        for k in (hf, "model." + hf[9:] if hf.startswith("backbone.") else None):
            if k is not None and k in self.where:
                return self._float(k, ())
        if expert is not None:  # fused 3-D experts, e.g. mixer.experts.up_proj
            base, leaf = hf.split(f".{expert}.", 1)
            k = base + "." + leaf.rsplit(".weight", 1)[0]
            if k in self.where:
                return self._float(k, (expert,))
        if hf + "_blocks" in self.where:  # MXFP4 (models/mxfp4.py): read whole by load_model, not by regions
            raise RemodelError(f"{self.path}: {hf} is MXFP4; sharded loading reads plain weights: "
                               "`remodel convert --dtype bfloat16` it first")
        raise RemodelError(f"checkpoint {self.path} has no tensor {hf!r}")

    def _float(self, k: str, lead: tuple):
        check_weight_dtype(self.path, k, self.where[k][2])
        if k + "_scale_inv" in self.where:  # float8 with block scales (models/fp8.py): not a region of plain values
            raise RemodelError(f"{self.path}: {k} is FP8 block-quantized; sharded loading reads plain weights: "
                               "`remodel convert --dtype bfloat16` it first")
        return (*self.where[k], lead)

    def read(self, name: str, index: list, dtype=torch.float32) -> torch.Tensor:
        """The region `index` (see the module doc) of our tensor `name`, as `dtype` (floats only)."""
        shape = self.shapes[name]
        idx = [torch.arange(n) if i is None else i for n, i in zip(shape, index)]
        out = torch.empty([len(i) for i in idx], dtype=dtype)
        rows, part = self.rows[name], self.parts[name]
        if part.count > 1:  # our part of a concatenation: where our indices lie in the HF tensor
            idx = [part.hf_index(i, shape[d]) if d == part.dim else i for d, i in enumerate(idx)]
        if part.transposed:  # the HF tensor's last two dimensions are ours swapped: fill a view of ours
            idx, out_view = [*idx[:-2], idx[-1], idx[-2]], out.transpose(-2, -1)
        else:
            out_view = out
        if rows[0][1] is not None:  # dim 0 = experts, one HF tensor each
            for pos, e in enumerate(idx[0].tolist()):
                self._fill(out_view[pos], self._entry(rows[e][0], e), idx[1:])
        else:
            self._fill(out_view, self._entry(rows[0][0], None), idx)
        return out

    def _fill(self, dst: torch.Tensor, entry, idx: list):
        file, offset, dt, shape, lead = entry
        for combo in itertools.product(*[runs(i) for i in idx]):
            ranges = [(e, e + 1) for e in lead] + [(a, b) for _, a, b in combo]
            block = self._read_block(file, offset, dt, shape, ranges)
            where = tuple(slice(p, p + (b - a)) for p, a, b in combo)
            dst[where].copy_(block.reshape(dst[where].shape))

    def _read_block(self, file: Path, offset: int, dt, shape, ranges) -> torch.Tensor:
        """The box `ranges` ([a, b) per dimension) of a row-major tensor at `offset`, by positioned reads
        of its contiguous spans."""
        item = torch.empty((), dtype=dt).element_size()
        k = len(shape)
        while k > 0 and ranges[k - 1] == (0, shape[k - 1]):
            k -= 1  # trailing whole dimensions are contiguous with the run before them
        inner = math.prod(shape[k:])
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        a, b = ranges[k - 1] if k > 0 else (0, 1)
        span = (b - a) * inner * item
        outer = [range(lo, hi) for lo, hi in ranges[:max(k - 1, 0)]]
        n = math.prod(len(r) for r in outer) if outer else 1
        buf = np.empty(n * span, dtype=np.uint8)
        fd = self._fd(file)
        for j, pre in enumerate(itertools.product(*outer)):
            start = sum(i * s for i, s in zip(pre, strides)) + (a * strides[k - 1] if k > 0 else 0)
            view = memoryview(buf)[j * span:(j + 1) * span]
            if os.preadv(fd, [view], offset + start * item) != span:
                raise RemodelError(f"{file}: truncated while reading a region")
        return torch.from_numpy(buf).view(dt)

    def _fd(self, file: Path) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
