"""Read parts of a Hugging Face checkpoint's tensors, addressed by our parameter names.

A sharded rank needs only its own rows / columns / experts of each tensor: `RegionReader.read(name,
index)` reads exactly that region through safetensors' `safe_open(...).get_slice`, never the whole
tensor. `index` has one entry per dimension: None (all of it) or a 1-D LongTensor of the indices kept,
read as runs of consecutive indices. Fused expert tensors [E, ...] are read from the per-expert HF
tensors (or a fused 3-D HF tensor) of the experts kept.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import torch
from safetensors import safe_open

from .checkpoint import INDEX, SINGLE, read_json
from .errors import RemodelError
from .hf import config_from_hf, our_shapes, weight_table, without_absent_mtp


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
        if (self.path / SINGLE).is_file():
            with safe_open(self.path / SINGLE, framework="pt") as f:
                self.where = {k: SINGLE for k in f.keys()}
        elif (self.path / INDEX).is_file():
            self.where = dict(read_json(self.path / INDEX)["weight_map"])
        else:
            raise RemodelError(f"{self.path}: no {SINGLE} or {INDEX}")
        self.config = without_absent_mtp(self.config, self.where)  # as CheckpointReader does
        self.cfg = config_from_hf(self.config)
        self.family = family or self.config.get("model_type")
        self.shapes = our_shapes(self.cfg)
        self.rows: dict[str, list[tuple[str, int | None]]] = {}
        for ours, hf, e in weight_table(self.cfg, self.family):
            self.rows.setdefault(ours, []).append((hf, e))
        self._files: dict[str, object] = {}

    def _file(self, shard: str):
        if shard not in self._files:
            self._files[shard] = safe_open(self.path / shard, framework="pt")
        return self._files[shard]

    def _slice(self, hf: str, expert: int | None):
        """(get_slice object, leading index) of one HF tensor, whatever its on-disk variant."""
        for k in (hf, "model." + hf[9:] if hf.startswith("backbone.") else None):
            if k is not None and k in self.where:
                return self._file(self.where[k]).get_slice(k), ()
        if expert is not None:  # fused 3-D experts, e.g. mixer.experts.up_proj
            base, leaf = hf.split(f".{expert}.", 1)
            for k in (base + "." + leaf.rsplit(".weight", 1)[0],):
                if k in self.where:
                    return self._file(self.where[k]).get_slice(k), (expert,)
        raise RemodelError(f"checkpoint {self.path} has no tensor {hf!r}")

    def read(self, name: str, index: list, dtype=torch.float32) -> torch.Tensor:
        """The region `index` (see the module doc) of our tensor `name`, as `dtype` (floats only)."""
        shape = self.shapes[name]
        idx = [torch.arange(n) if i is None else i for n, i in zip(shape, index)]
        out = torch.empty([len(i) for i in idx], dtype=dtype)
        rows = self.rows[name]
        fused = rows[0][1] is not None
        if fused:  # dim 0 = experts, one HF tensor each
            for pos, e in enumerate(idx[0].tolist()):
                sl, lead = self._slice(rows[e][0], e)
                self._fill(out[pos], sl, lead, idx[1:])
        else:
            sl, lead = self._slice(rows[0][0], None)
            self._fill(out, sl, lead, idx)
        return out

    @staticmethod
    def _fill(dst: torch.Tensor, sl, lead: tuple, idx: list):
        for combo in itertools.product(*[runs(i) for i in idx]):
            key = lead + tuple(slice(a, b) for _, a, b in combo)
            block = sl[key] if key else sl[:]
            where = tuple(slice(p, p + (b - a)) for p, a, b in combo)
            dst[where].copy_(block.to(dst.dtype) if dst.is_floating_point() else block)

    def close(self):
        self._files.clear()
