"""Batches from token sets: `SequenceSampler` cuts global batch b (a pure function of b, so resuming is
exact) for one DP rank from a TokenSet or a weighted Blend (pipelines.data.tokens), reading its rows with
positioned reads; `Prefetch` reads ahead on a thread; `sequences` puts the two together."""
from __future__ import annotations

import queue
import threading
from pathlib import Path

import numpy as np
import torch

from remodel.models.errors import RemodelError

from .token_file import TokenFile
from .tokens import Blend, open_set, open_tokens


# -- sampling --------------------------------------------------------------------------------------

class SequenceSampler:
    """Global batch b of `batch_size` sequences of `seq_len` tokens from a TokenSet or Blend; this DP
    rank's rows are b's rows dp_rank*B/dp .. (dp_rank+1)*B/dp (those today's trainer gives it).

    A TokenSet is read in the order of pipelines.data.data.batches(pack(...), B, shuffle_seed=seed,
    epochs=None, drop_last=True): epoch e shuffles with torch.randperm seeded seed + e (in order when
    seed is None), and a partial last batch is dropped. Each set of a Blend is shuffled with its own
    seed and repeats without dropping anything. Batches are a pure function of b: resuming is exact.
    """

    def __init__(self, data, seq_len: int, batch_size: int, *, seed: int | None = 0, dp_rank: int = 0,
                 dp_size: int = 1, vocab_size: int | None = None):
        for name, v in (("seq_len", seq_len), ("batch_size", batch_size), ("dp_size", dp_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise RemodelError(f"{name} must be a positive integer, got {v!r}")
        if batch_size % dp_size:
            raise RemodelError(f"batch_size {batch_size} is not divisible by the {dp_size} data-parallel ranks")
        if not 0 <= dp_rank < dp_size:
            raise RemodelError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        self.blend = data if isinstance(data, Blend) else None
        self.sets = data.sets if self.blend else [data if isinstance(data, TokenFile) else open_set(data)]
        self.n = [s.num_sequences(seq_len) for s in self.sets]
        for s, n in zip(self.sets, self.n):
            if n == 0 or (not self.blend and n < batch_size):
                raise RemodelError(f"{s.path}: {s.n_tokens} tokens make {n} sequences of {seq_len}, "
                                   f"fewer than one batch of {batch_size}")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        # every row read is checked against this bound: ids past it would index outside the embedding
        self.limits = [s.vocab_size if vocab_size is None else min(vocab_size, s.vocab_size) for s in self.sets]
        per = batch_size // dp_size
        self.rows = slice(dp_rank * per, (dp_rank + 1) * per)
        self._perms: dict = {}

    def _perm(self, k: int, epoch: int) -> np.ndarray:
        """Order of set k's sequences in epoch `epoch` (the two latest epochs per set are kept)."""
        key = (k, epoch)
        if key not in self._perms:
            n = self.n[k]
            if self.seed is None:
                perm = np.arange(n)
            else:
                seed = self.seed + epoch + (0 if self.blend is None else (k + 1) * 1_000_003)
                perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
            for old in [o for o in self._perms if o[0] == k and o[1] < epoch - 1]:
                del self._perms[old]
            self._perms[key] = perm
        return self._perms[key]

    def indices(self, b: int) -> list[tuple[int, int]]:
        """(set index, sequence index) of this rank's rows of global batch b."""
        B = self.batch_size
        if self.blend is None:
            epoch, k = divmod(b, self.n[0] // B)
            seqs = self._perm(0, epoch)[k * B:(k + 1) * B][self.rows].tolist()
            return [(0, s) for s in seqs]
        sets, samples = self.blend.locate(np.arange(b * B, (b + 1) * B, dtype=np.int64)[self.rows])
        out = []
        for d, j in zip(sets.tolist(), samples.tolist()):
            epoch, pos = divmod(j, self.n[d])
            out.append((d, int(self._perm(d, epoch)[pos])))
        return out

    def batch(self, b: int) -> torch.Tensor:
        """LongTensor [batch_size / dp_size, seq_len]: this rank's rows of global batch b."""
        L = self.seq_len
        rows = self.indices(b)
        out = np.empty((len(rows), L), np.int64)
        buf = {s.dtype: np.empty(L, s.dtype) for s in self.sets}
        for r, (k, s) in enumerate(rows):
            row = self.sets[k].read(s * L, L, buf[self.sets[k].dtype])
            hi, lo = int(row.max()), int(row.min()) if row.dtype.kind == "i" else 0  # signed: Megatron's int32 sets
            if hi >= self.limits[k] or lo < 0:
                bad = int(row.argmax()) if hi >= self.limits[k] else int(row.argmin())
                raise RemodelError(f"{self.sets[k].path}: token id {int(row[bad])} at token {s * L + bad} is outside the "
                                   f"vocabulary ({self.limits[k]}) (corrupt token set?)")
            out[r] = row
        return torch.from_numpy(out)

    def __call__(self, start: int = 0, stop: int | None = None):
        """Batches start, start+1, ... (forever when stop is None), nothing before start is read."""
        b = start
        while stop is None or b < stop:
            yield self.batch(b)
            b += 1


class Prefetch:
    """Iterator over batches start, start+1, ... prepared by a background thread `depth` ahead.
    close() (or leaving the `with` block) stops the thread; an error in it is raised by next()."""

    _END = object()

    def __init__(self, sampler: SequenceSampler, start: int = 0, stop: int | None = None, depth: int = 2):
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(sampler, start, stop), daemon=True,
                                        name="remodel-prefetch")
        self._thread.start()

    def _work(self, sampler, start, stop):
        try:
            for x in sampler(start, stop):
                if not self._put(x):
                    return
            self._put(self._END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put(e)

    def _put(self, x) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        x = self._q.get()
        if x is self._END:
            self._q.put(x)
            raise StopIteration
        if isinstance(x, BaseException):
            raise x
        return x

    def close(self):
        self._stop.set()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def sequences(data, seq_len: int, batch_size: int, *, start: int = 0, stop: int | None = None, prefetch: int = 2,
              **sampling):
    """This rank's [batch_size / dp_size, seq_len] int64 batches from global batch `start` on (forever
    when stop is None). `data`: a TokenSet, a Blend, a token set path or a blend spec. `sampling`: the
    SequenceSampler keywords seed (default 0), dp_rank, dp_size and vocab_size. prefetch > 0 returns a
    Prefetch (close it when done), 0 a plain generator. An id >= vocab_size (the model's; the set's own
    vocab_size in any case) raises a RemodelError when its batch is read."""
    if isinstance(data, (str, Path, list, tuple)):
        data = open_tokens(data)
    sampler = SequenceSampler(data, seq_len, batch_size, **sampling)
    return Prefetch(sampler, start, stop, prefetch) if prefetch > 0 else sampler(start, stop)
