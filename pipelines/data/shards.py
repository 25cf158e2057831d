"""Streaming, resumable tokenization: the engine of tokens.tokenize.

Documents come one at a time from pipelines.data.stream, in batches of BATCH_DOCS documents or
BATCH_CHARS characters, are tokenized in `num_proc` worker processes (at most 2 * num_proc batches in
flight, in order) and written as they come to shards in the work folder `.OUT.partial` beside OUT:
  shard-NNNNNN.bin   the shard's tokens (the token set's dtype)
  shard-NNNNNN.idx   int64 token count of each document
  shard-NNNNNN.json  documents, tokens, largest id: written last (by rename), it marks the shard finished
and a key.json naming the run (source, tokenizer, options), and the marker WORK_MARKER: a folder at that
name without it (a user's) is refused, never emptied or removed. A rerun with the same key keeps the finished
shards and skips their documents; `assemble` concatenates them into tokens.bin / docs.idx, so the
result does not depend on where a run was cut. Memory is bounded by the batches in flight.
"""
from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import itertools
import json
import os
import re
import time
from collections import deque
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm.auto import tqdm

from remodel.models.outputs import check_owned, mark_dir, remove_owned
from remodel.models.errors import RemodelError

from ..distributed.runtime import ChildrenDieWithUs, die_with_parent

BATCH_DOCS, BATCH_CHARS = 512, 1 << 20  # a batch of documents sent to a worker
SHARD_TOKENS = 1 << 26  # default tokens per shard (128 MiB of uint16): a shard ends after the batch reaching it
COPY_BYTES = 1 << 24  # bytes copied per step of `assemble`


WORK_MARKER = ".remodel-work"  # written into every work folder remodel makes (see check_owned)
_WORK_FILE = re.compile(r"(\.lock|key\.json|shard-\d{6}\.(bin|idx|json))(\.tmp)?")


def _legacy_work(work: Path) -> bool:
    """A work folder an older remodel left (before WORK_MARKER): its files are all ours by name."""
    names = [p.name for p in work.iterdir()]
    return "key.json" in names and all(_WORK_FILE.fullmatch(n) for n in names)


def work_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def _name(work: Path, i: int, ext: str) -> Path:
    return work / f"shard-{i:06d}.{ext}"


@contextlib.contextmanager
def locked_work(work: Path, key: str):
    """The work folder, locked (a second run on the same OUT refuses in one line), emptied when its
    key.json names another run; yields the finished shards' records, in order. A folder at that name that
    remodel did not make (no WORK_MARKER) or a symlink is refused in one line, untouched."""
    check_owned(work, WORK_MARKER, "the tokenize work folder", _legacy_work)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / WORK_MARKER).is_file():
        mark_dir(work, WORK_MARKER, kind="tokenize work")
    fd = os.open(work / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RemodelError(f"{work}: another tokenize is writing this output") from None
        keyfile = work / "key.json"
        if not keyfile.is_file() or keyfile.read_text() != key:
            for p in work.glob("shard-*"):
                p.unlink()
            _write_atomic(keyfile, key)
        yield _finished(work)
    finally:
        os.close(fd)


def _finished(work: Path) -> list[dict]:
    """Records of shards 0, 1, ... while each is complete; any later shard file is removed."""
    done = []
    while True:
        i = len(done)
        try:
            rec = json.loads(_name(work, i, "json").read_text())
            ok = (_name(work, i, "bin").stat().st_size == rec["bytes"]
                  and _name(work, i, "idx").stat().st_size == 8 * rec["docs"])
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            break
        done.append(rec)
    for p in work.glob("shard-*"):
        if not p.name.endswith(".tmp") and int(p.name[6:12]) < len(done):
            continue
        p.unlink()
    return done


def _write_atomic(path: Path, text: str):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def batches(docs, skip: int):
    """Lists of documents (BATCH_DOCS / BATCH_CHARS), after the first `skip` documents."""
    batch, chars = [], 0
    for d in itertools.islice(docs, skip, None):
        batch.append(d)
        chars += len(d)
        if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


_WORKER = {}


def _init(tok, tail, dtype, owner):
    die_with_parent(owner)
    _WORKER.update(tok=tok, tail=tail, dtype=dtype)


def _encode(texts, tok=None, tail=None, dtype=None):
    """(tokens as dtype, int64 length of each document, largest id) of a batch of documents."""
    if tok is None:
        tok, tail, dtype = _WORKER["tok"], _WORKER["tail"], _WORKER["dtype"]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    lengths = np.fromiter((len(x) + len(tail) for x in ids), np.int64, len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(x + tail for x in ids), np.int64, int(lengths.sum()))
    top = int(flat.max()) if len(flat) else -1
    return (flat.astype(dtype) if top <= np.iinfo(dtype).max else flat), lengths, top


class WorkerDied(RemodelError):
    """A worker process died mid-batch: the finished shards stay for a rerun to resume from."""


def _result(job, workers: list):
    """job.get(), or a one-line RemodelError when one of the pool's workers died (killed, out of memory)
    instead of waiting forever for the batch it held; a rerun resumes from the finished shards."""
    import multiprocess
    while True:
        try:
            return job.get(timeout=0.5)
        except multiprocess.TimeoutError:
            dead = [w.pid for w in workers if w.exitcode is not None]
            if dead:
                raise WorkerDied(f"a tokenize worker process (pid {dead[0]}) died, killed or out of memory; "
                                   "rerun the same command to resume from the finished shards") from None


def encoded(parts, tok, tail, dtype, num_proc: int):
    """_encode of every batch of `parts`, in order: in this process, or in a pool of num_proc workers
    (killed with this process) with at most 2 * num_proc batches in flight."""
    if num_proc == 1:
        for texts in parts:
            yield _encode(texts, tok, tail, dtype)
        return
    import multiprocess
    guard = ChildrenDieWithUs()
    gc.freeze()  # the workers' garbage collector leaves the forked heap alone: no copy-on-write of it
    try:
        pool = multiprocess.get_context("fork").Pool(num_proc, initializer=_init,
                                                     initargs=(tok, tail, dtype, guard.owner))
    finally:
        gc.unfreeze()
    workers = list(pool._pool)  # a Pool replaces a dead worker and waits forever for its lost batch
    died = False
    try:
        pending = deque()
        for texts in parts:
            pending.append(pool.apply_async(_encode, (texts,)))
            if len(pending) >= 2 * num_proc:
                yield _result(pending.popleft(), workers)
        while pending:
            yield _result(pending.popleft(), workers)
    except WorkerDied:
        died = True
        raise
    finally:
        if died:
            _abandon(pool)
        else:
            pool.terminate()
            pool.join()
        del guard


def _abandon(pool):
    """After a worker died: kill the others and drop the pool without terminate(), which would wait forever
    for the queue lock a worker killed mid-read still holds (also at exit: its finalizer is cancelled)."""
    for w in list(pool._pool):
        if w.exitcode is None:
            w.kill()
    pool._terminate.cancel()


class _Shard:
    """The shard being written: tokens and lengths appended, finished by `close` (renames, then json)."""

    def __init__(self, work: Path, i: int):
        self.work, self.i, self.docs, self.tokens, self.top = work, i, 0, 0, -1
        self.fb = open(_name(work, i, "bin.tmp"), "wb")
        self.fi = open(_name(work, i, "idx.tmp"), "wb")

    def add(self, flat, lengths, top):
        self.fb.write(memoryview(np.ascontiguousarray(flat)).cast("B"))
        lengths.tofile(self.fi)
        self.docs, self.tokens, self.top = self.docs + len(lengths), self.tokens + len(flat), max(self.top, top)

    def close(self) -> dict:
        for f, ext in ((self.fb, "bin"), (self.fi, "idx")):
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(_name(self.work, self.i, ext + ".tmp"), _name(self.work, self.i, ext))
        rec = {"docs": self.docs, "tokens": self.tokens, "max_id": self.top,
               "bytes": os.path.getsize(_name(self.work, self.i, "bin"))}
        _write_atomic(_name(self.work, self.i, "json"), json.dumps(rec))
        return rec


class Encoding(NamedTuple):
    """How documents become token ids (`encoded`'s arguments): the tokenizer, the ids appended to each
    document (eos, or none), the stored dtype and the tokenizing processes."""
    tok: object
    tail: list
    dtype: object
    num_proc: int


def write_shards(docs, done: list[dict], work: Path, enc: Encoding, meter, total: int,
                 shard_tokens: int = SHARD_TOKENS):
    """Tokenize `docs` (skipping those of the `done` shards) into new shards of about `shard_tokens`
    tokens; `meter` counts the bytes read of `total` (the progress bar). -> all shard records."""
    done, tok = list(done), enc.tok
    shard, n_tok, t0 = None, 0, time.perf_counter()
    skip = sum(r["docs"] for r in done)
    with tqdm(total=total, desc="tokenize", unit="B", unit_scale=True, dynamic_ncols=True) as bar, \
            contextlib.closing(encoded(batches(docs, skip), *enc)) as results:
        bar.set_postfix_str(f"resumed {len(done)} shards" if done else "", refresh=False)
        for flat, lengths, top in results:
            if top >= len(tok):
                raise RemodelError(f"the tokenizer gave token id {top}, outside its own vocabulary ({len(tok)})")
            shard = shard or _Shard(work, len(done))
            shard.add(flat, lengths, top)
            n_tok += len(flat)
            if shard.tokens >= shard_tokens:
                done.append(shard.close())
                shard = None
            bar.update(meter.bytes - bar.n)
            bar.set_postfix_str(f"{n_tok / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s", refresh=False)
        if shard is not None:
            done.append(shard.close())
    return done


def assemble(done: list[dict], work: Path, folder: Path, dtype):
    """tokens.bin and docs.idx in `folder` from the shards: -> (n_tokens, n_docs, blake2b of tokens.bin,
    largest id)."""
    h, n_tokens, n_docs = hashlib.blake2b(digest_size=16), 0, 0
    with open(folder / "tokens.bin", "wb") as fb, open(folder / "docs.idx", "wb") as fi:
        np.zeros(1, np.int64).tofile(fi)
        for i, rec in enumerate(done):
            with open(_name(work, i, "bin"), "rb") as f:
                while chunk := f.read(COPY_BYTES):
                    h.update(chunk)
                    fb.write(chunk)
            with open(_name(work, i, "idx"), "rb") as f:
                while len(lengths := np.fromfile(f, np.int64, COPY_BYTES // 8)):
                    (n_tokens + np.cumsum(lengths)).tofile(fi)
                    n_tokens += int(lengths.sum())
            n_docs += rec["docs"]
    if n_tokens != sum(r["tokens"] for r in done) or n_tokens * np.dtype(dtype).itemsize != sum(r["bytes"] for r in done):
        raise RemodelError(f"{work}: shards disagree with their records (corrupt work folder; delete it)")
    return n_tokens, n_docs, h.hexdigest(), max((r["max_id"] for r in done), default=-1)


def remove_work(work: Path):
    """Remove the work folder, only when remodel made it (a refused folder, a symlink, stays untouched)."""
    remove_owned(work, WORK_MARKER, "the tokenize work folder", _legacy_work)
