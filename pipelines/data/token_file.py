"""Positioned reads of a flat token file (a token set's tokens.bin, a Megatron dataset's PREFIX.bin): the
part of a token source that samplers and blends use, shared so that each format only finds and validates
its files (pipelines.data.tokens.TokenSet, pipelines.data.megatron.MegatronSet)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from remodel.models.errors import RemodelError


class TokenFile:
    """Subclasses set `bin_path`, `dtype`, `n_tokens` and `_fd` (an open read-only fd of bin_path, which
    holds exactly n_tokens tokens)."""
    bin_path: Path
    dtype: np.dtype
    n_tokens: int
    _fd = None
    _tokens = None

    def read(self, start: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens [start, start + count) by one positioned read (thread-safe, nothing stays mapped)."""
        out = np.empty(count, self.dtype) if out is None else out
        if start < 0 or count < 0 or start + count > self.n_tokens:
            raise IndexError(f"tokens {start}..{start + count} outside 0..{self.n_tokens}")
        got = os.preadv(self._fd, [memoryview(out).cast("B")], start * self.dtype.itemsize)
        if got != count * self.dtype.itemsize:
            raise RemodelError(f"{self.bin_path}: ended early (read {got} of {count * self.dtype.itemsize} bytes)")
        return out

    @property
    def tokens(self) -> np.ndarray:
        """Read-only np.memmap of all tokens (pages become resident as they are touched)."""
        if self._tokens is None:
            self._tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r")
        return self._tokens

    def num_sequences(self, seq_len: int) -> int:
        """Full sequences of seq_len tokens (the remainder is never read)."""
        return self.n_tokens // seq_len

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)
