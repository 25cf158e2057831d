"""Tensors by key, in memory up to a byte budget and spilled to safetensors files past it: the
calibration hidden states of compress.streaming.score_streaming."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load, save_file


class StateStore:
    """Tensors by key: in memory while their total stays within max_bytes, beyond that each one is a
    safetensors file in a private temporary directory (removed by close())."""

    def __init__(self, max_bytes: int | None = None, dir=None):
        self.max_bytes = float("inf") if max_bytes is None else max_bytes
        self.mem, self.disk, self.used, self.spilled = {}, set(), 0, 0
        self._parent, self._dir = dir, None

    def _path(self, key) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="remodel-spill-", dir=self._parent))
        return self._dir / ("_".join(map(str, key if isinstance(key, tuple) else (key,))) + ".safetensors")

    def __setitem__(self, key, t):
        self.pop(key)
        t = t.detach().cpu().contiguous()
        if self.used + t.nbytes <= self.max_bytes:
            self.mem[key] = t
            self.used += t.nbytes
        else:
            save_file({"t": t}, self._path(key))
            self.disk.add(key)
            self.spilled += t.nbytes

    def __getitem__(self, key) -> torch.Tensor:
        if key in self.mem:
            return self.mem[key]
        return load(self._path(key).read_bytes())["t"]  # a plain read into fresh memory, no mmap

    def pop(self, key):
        if key in self.mem:
            self.used -= self.mem.pop(key).nbytes
        elif key in self.disk:
            self.disk.discard(key)
            self._path(key).unlink()

    def close(self):
        self.mem.clear()
        self.disk.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
