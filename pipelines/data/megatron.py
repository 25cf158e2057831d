"""Megatron-Core indexed datasets (`PREFIX.bin` + `PREFIX.idx`: Megatron's preprocess_data.py writes them,
megatron.core.datasets.indexed_dataset reads them) as remodel token sources, and written from a token set.

The .idx, little-endian: b"MMIDIDX\\x00\\x00", version <Q (1), token dtype code <B (Megatron's DType: 8
uint16, 4 int32), sequence count S <Q, document count D <Q, then int32 sizes[S], int64 pointers[S] (byte
offsets of the sequences in .bin), int64 document_indices[D] (the sequence each document starts at; first
0, last S). The .bin holds the sequences' tokens back to back. `MegatronSet` reads as a TokenSet whose token
stream is the .bin and whose documents are Megatron's, so sampling, blends and training take it as they
take a token set; every header field and array is checked (contiguous pointers, sizes that add up to the
.bin, document indices from 0 to S) before a token is read, in bounded chunks. The scan's cost is bounded
by the data first: the header's counts must fit the .idx's size and the .bin's tokens (at most MAX_EMPTY
sequences more than tokens), and the arrays' first and last entries must match the .bin, all in O(1)
reads, so a sparse .idx declaring 2^36 sequences is refused before any per-entry work. A Megatron dataset
records no tokenizer and no vocabulary: ids are checked against the model's vocabulary instead.
"""
from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import numpy as np

from remodel.models.errors import RemodelError
from remodel.models.files import open_regular

from .token_file import TokenFile

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents: 34 bytes
CODES = {8: np.dtype(np.uint16), 4: np.dtype(np.int32)}  # Megatron's codes of the token dtypes read here
OTHER_CODES = {1: "uint8", 2: "int8", 3: "int16", 5: "int64", 6: "float64", 7: "float32"}
MAX_COUNT = 1 << 40  # sequences or documents in one dataset
NAME = "data"  # `tokenize --format megatron` writes OUT/data.bin and OUT/data.idx
CHUNK = 1 << 20  # values read per step of a scan
SCAN_TOKENS = 1 << 26  # sets up to this many tokens have their ids scanned by check_vocab
MAX_EMPTY = 1 << 20  # sequences beyond the .bin's token count (empty documents) before the index is refused


def prefix_of(path) -> str | None:
    """The Megatron prefix `path` names (PREFIX, PREFIX.bin, PREFIX.idx, or a folder holding exactly one
    .bin/.idx pair), None when it names none. Only names are looked at, nothing is opened."""
    p = str(Path(path).expanduser())
    if p.endswith((".bin", ".idx")):
        p = p[:-4]
    elif os.path.isdir(p):
        pairs = [q[:-4] for q in sorted(os.listdir(p)) if q.endswith(".idx") and os.path.lexists(os.path.join(p, q[:-4] + ".bin"))]
        return os.path.join(p, pairs[0]) if len(pairs) == 1 else None
    return p if os.path.lexists(p + ".idx") and os.path.lexists(p + ".bin") else None


def is_megatron(path) -> bool:
    return prefix_of(path) is not None


def _header(raw: bytes, where, size: int):
    """(token dtype, S, D) of an .idx of `size` bytes starting with `raw`; one-line errors otherwise."""
    if len(raw) < HEADER.size:
        raise RemodelError(f"{where}: {len(raw)} bytes, shorter than a Megatron .idx header ({HEADER.size})")
    magic, version, code, S, D = HEADER.unpack(raw[:HEADER.size])
    if magic != MAGIC:
        raise RemodelError(f"{where}: not a Megatron indexed dataset (header {magic[:9]!r}, expected {MAGIC!r})")
    if version != 1:
        raise RemodelError(f"{where}: Megatron index version {version}, this remodel reads version 1")
    if code not in CODES:
        what = OTHER_CODES.get(code, "unknown")
        raise RemodelError(f"{where}: token dtype code {code} ({what}) is not supported (uint16 or int32)")
    if not (S < MAX_COUNT and 1 <= D <= S + 1):
        raise RemodelError(f"{where}: {S} sequences and {D} document indices are not a valid index (corrupt)")
    want = HEADER.size + 12 * S + 8 * D
    if size == want + S:
        raise RemodelError(f"{where}: a multimodal Megatron dataset (sequence modes); only token datasets are read")
    if size != want:
        raise RemodelError(f"{where}: {size} bytes, the header's {S} sequences and {D} documents need {want} "
                           f"({'truncated?' if size < want else 'trailing bytes'})")
    return CODES[code], S, D


def _at(fd, offset: int, dtype) -> int:
    """One value of `dtype` at byte `offset` of fd."""
    raw = os.pread(fd, np.dtype(dtype).itemsize, offset)
    if len(raw) != np.dtype(dtype).itemsize:
        raise RemodelError("Megatron .idx ended early (changed while being read?)")
    return int(np.frombuffer(raw, dtype)[0])


def _check_ends(fd, S: int, D: int, itemsize: int, bin_bytes: int, where):
    """Before any per-entry work, O(1) reads: S fits the .bin's tokens (at most MAX_EMPTY empty sequences
    more), the first pointer is 0 and the last sequence ends where the .bin does, the document indices
    start at 0 and end at S."""
    tokens = bin_bytes // itemsize
    if bin_bytes % itemsize or S > tokens + MAX_EMPTY:
        raise RemodelError(f"{where}: {S} sequences for a .bin of {bin_bytes} bytes ({tokens} tokens): more "
                           f"sequences than tokens (corrupt, or a sparse file)")
    at, ptr = HEADER.size, HEADER.size + 4 * S
    if S and (_at(fd, ptr, np.int64) != 0
              or _at(fd, ptr + 8 * (S - 1), np.int64) + _at(fd, at + 4 * (S - 1), np.int32) * itemsize != bin_bytes):
        raise RemodelError(f"{where}: the first and last sequence pointers do not span the {bin_bytes} bytes of "
                           ".bin (corrupt)")
    if _at(fd, at + 12 * S, np.int64) != 0 or _at(fd, at + 12 * S + 8 * (D - 1), np.int64) != S:
        raise RemodelError(f"{where}: document indices do not run from 0 to {S} (corrupt)")


def _chunks(fd, offset: int, count: int, dtype, h):
    """Arrays of up to CHUNK `dtype` values from `count` at `offset` of fd, each hashed into h."""
    itemsize = np.dtype(dtype).itemsize
    for start in range(0, count, CHUNK):
        n = min(CHUNK, count - start)
        raw = os.pread(fd, n * itemsize, offset + start * itemsize)
        if len(raw) != n * itemsize:
            raise RemodelError("Megatron .idx ended early (changed while being read?)")
        h.update(raw)
        yield start, np.frombuffer(raw, dtype)


def _check_arrays(fd, S: int, D: int, itemsize: int, where, h) -> int:
    """Sizes >= 0, pointers contiguous from 0 (each the byte offset where its sequence starts), document
    indices from 0 to S never decreasing; -> the number of tokens."""
    at = HEADER.size
    total = 0
    sizes = _chunks(fd, at, S, np.int32, h)
    for (_, sz), (_, ptr) in zip(sizes, _chunks(fd, at + 4 * S, S, np.int64, h)):
        if (sz < 0).any():
            raise RemodelError(f"{where}: a negative sequence size (corrupt)")
        starts = total + np.concatenate(([0], np.cumsum(sz[:-1], dtype=np.int64))) * itemsize
        if not np.array_equal(ptr, starts):
            raise RemodelError(f"{where}: sequence pointers are not the running sum of the sizes (corrupt, or "
                               "sequences stored out of order, which remodel does not read)")
        total += int(sz.sum(dtype=np.int64)) * itemsize
    prev = 0
    for start, di in _chunks(fd, at + 12 * S, D, np.int64, h):
        if (start == 0 and di[0] != 0) or di[0] < prev or (di[1:] < di[:-1]).any() or di[-1] > S:
            raise RemodelError(f"{where}: document indices do not run from 0 to {S} without decreasing (corrupt)")
        prev = int(di[-1])
    if prev != S:
        raise RemodelError(f"{where}: the last document index is {prev}, not the {S} sequences (corrupt)")
    return total // itemsize


class MegatronSet(TokenFile):
    """A Megatron .bin/.idx pair with pipelines.data.tokens.TokenSet's interface (its `path` is the prefix).
    `vocab_size` is the dtype's range: the dataset records none, so `check_vocab` scans ids (negatives
    too) against the model's."""

    def __init__(self, path):
        prefix = prefix_of(path)
        if prefix is None:
            raise RemodelError(f"{path}: not a Megatron dataset (no PREFIX.bin and PREFIX.idx)")
        self.path, self.bin_path = Path(prefix), Path(prefix + ".bin")
        idx, binp = Path(prefix + ".idx"), self.bin_path
        self._fd = open_regular(binp, "Megatron .bin")
        actual = os.fstat(self._fd).st_size
        fd = open_regular(idx, "Megatron .idx")
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, HEADER.size, 0)
            self.dtype, S, D = _header(head, idx, size)
            _check_ends(fd, S, D, self.dtype.itemsize, actual, idx)
            h = hashlib.blake2b(head, digest_size=16)
            self.n_tokens = _check_arrays(fd, S, D, self.dtype.itemsize, idx, h)
        finally:
            os.close(fd)
        self.n_sequences, self.n_docs = S, D - 1
        want = self.n_tokens * self.dtype.itemsize
        if actual != want:
            raise RemodelError(f"{binp}: {actual} bytes, its .idx describes {want} ({'truncated?' if actual < want else 'another file?'})")
        self.vocab_size = int(np.iinfo(self.dtype).max) + 1
        self.fingerprint = f"megatron-{h.hexdigest()}-{actual}"
        self.meta = {"format": "megatron", "dtype": self.dtype.name, "n_tokens": self.n_tokens, "n_docs": self.n_docs,
                     "vocab_size": self.vocab_size, "tokenizer": {"name": "", "hash": None}}

    def _offset(self, seq: int) -> int:
        """Token offset where sequence `seq` starts (n_tokens for seq == S)."""
        if seq >= self.n_sequences:
            return self.n_tokens
        at = HEADER.size + 4 * self.n_sequences + 8 * seq
        with open(str(self.path) + ".idx", "rb") as f:
            f.seek(at)
            return int(np.frombuffer(f.read(8), np.int64)[0]) // self.dtype.itemsize

    def document(self, i: int) -> np.ndarray:
        """Tokens of Megatron document i (all its sequences)."""
        if not 0 <= i < self.n_docs:
            raise IndexError(f"document {i} outside 0..{self.n_docs - 1}")
        at = HEADER.size + 12 * self.n_sequences + 8 * i
        di = np.fromfile(str(self.path) + ".idx", np.int64, 2, offset=at)
        a, b = self._offset(int(di[0])), self._offset(int(di[1]))
        return self.read(a, b - a)

    def id_range(self) -> tuple[int, int]:
        """(smallest, largest) token id, by a scan in CHUNK-token positioned reads."""
        lo, hi, buf = 0, -1, np.empty(min(CHUNK, max(1, self.n_tokens)), self.dtype)
        for start in range(0, self.n_tokens, CHUNK):
            n = min(CHUNK, self.n_tokens - start)
            row = self.read(start, n, buf[:n])
            lo, hi = min(lo, int(row.min())), max(hi, int(row.max()))
        return lo, hi

    def max_id(self) -> int:
        return self.id_range()[1]

    def check_vocab(self, vocab_size: int, scan_limit: int = SCAN_TOKENS):
        """Ids outside 0..vocab_size-1 refused in one line (a scan for sets of at most scan_limit tokens;
        larger sets rely on the sampler's per-row check)."""
        if self.n_tokens > scan_limit:
            return
        lo, hi = self.id_range()
        if lo < 0 or hi >= vocab_size:
            raise RemodelError(f"{self.path}: the Megatron dataset holds token id {lo if lo < 0 else hi}, outside the "
                               f"model's vocabulary (0..{vocab_size - 1}): made with another tokenizer?")

    def __repr__(self):
        return f"MegatronSet({str(self.path)!r}, n_tokens={self.n_tokens}, dtype={self.dtype.name})"


# ---- writing -------------------------------------------------------------------------------------

def _write_bin(src, f, dtype):
    for start in range(0, src.n_tokens, CHUNK):
        chunk = src.read(start, min(CHUNK, src.n_tokens - start))
        f.write(chunk.astype(dtype, copy=False).tobytes())


def _doc_offsets(src):
    """docs.idx of a token set in chunks of up to CHUNK + 1 offsets (consecutive chunks share one)."""
    n = src.n_docs + 1
    for start in range(0, n - 1, CHUNK):
        yield np.fromfile(src.path / "docs.idx", np.int64, min(CHUNK + 1, n - start), offset=8 * start)


def write_megatron(src, prefix, dtype=None):
    """PREFIX.bin and PREFIX.idx of the TokenSet `src`, one Megatron sequence and document per document, as
    megatron-core's IndexedDatasetBuilder writes them. dtype: uint16 for a uint16 set, else int32."""
    dtype = np.dtype(dtype or (np.uint16 if src.dtype == np.uint16 else np.int32))
    if dtype not in CODES.values():
        raise RemodelError(f"Megatron token dtype must be uint16 or int32, got {dtype.name}")
    if src.vocab_size > np.iinfo(dtype).max + 1:
        raise RemodelError(f"{src.path}: ids up to {src.vocab_size - 1} do not fit Megatron's {dtype.name}")
    code = next(c for c, d in CODES.items() if d == dtype)
    with open(str(prefix) + ".bin", "wb") as f:
        _write_bin(src, f, dtype)
    with open(str(prefix) + ".idx", "wb") as f:
        f.write(HEADER.pack(MAGIC, 1, code, src.n_docs, src.n_docs + 1))
        for off in _doc_offsets(src):
            sizes = np.diff(off)
            if (sizes >= 1 << 31).any():
                raise RemodelError(f"{src.path}: a document of {int(sizes.max())} tokens exceeds Megatron's int32 sizes")
            f.write(sizes.astype(np.int32).tobytes())
        for off in _doc_offsets(src):
            f.write((off[:-1] * dtype.itemsize).astype(np.int64).tobytes())
        for start in range(0, src.n_docs + 1, CHUNK):
            f.write(np.arange(start, min(start + CHUNK, src.n_docs + 1), dtype=np.int64).tobytes())
