"""Token sets on disk: tokenize a corpus once, then train from a memory map (Megatron's indexed datasets).

A token set is a folder written by `tokenize`:
  tokens.bin  every document's tokens (each followed by eos unless eos=False), concatenated; uint16 when
              the vocabulary has at most 65536 entries, else uint32
  docs.idx    int64 start offset of every document in tokens.bin, n_docs + 1 entries
  meta.json   dtype, counts, tokenizer hash, source path/size/mtime, doc_split, eos, content fingerprint
Sequence i of length L is tokens[i*L:(i+1)*L], the row pipelines.data.data.pack would give. `SequenceSampler`
cuts global batches from a TokenSet (same order as pipelines.data.data.batches) or a weighted `Blend`, for
one DP rank, resumable at any batch; `sequences` adds a background prefetch thread. The sampler reads
its rows with positioned reads (os.preadv) rather than through the memory map: the kernel maps a whole
page-cache folio (up to 2 MB on ext4) per touched page, so random rows through a map would make resident
memory grow with the corpus; with preads it holds only the batches in flight.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from remodel.models.outputs import atomic_output_dir, check_owned, mark_dir, remove_owned
from remodel.models.files import open_regular, parse_json, read_bounded
from remodel.models.errors import RemodelError

from . import megatron, shards, stream
from .token_file import TokenFile
from .data import DOC_SPLITS
from ..distributed.runtime import check_out, load_tokenizer

FORMAT, VERSION = "remodel-tokens", 1
BLEND_PERIOD = 1 << 16  # blend weights are quantized to 1/65536; the dataset pattern repeats with this period
MAX_BLEND = 128  # token sets in one blend (each costs a BLEND_PERIOD-long int64 prefix row, 512 KiB)
META_MAX_BYTES = 1 << 20  # a meta.json larger than this is refused unread
DTYPES = ("uint16", "uint32")
SCAN_TOKENS = 1 << 26  # sets up to this many tokens have their largest id checked by a scan at open
CHUNK = 1 << 20  # tokens / offsets read per step of a scan


# -- tokenizing ------------------------------------------------------------------------------------

def tokenizer_hash(tok) -> str:
    """Content hash of a tokenizer (its serialized vocabulary and rules, plus eos), for cache keys."""
    h = hashlib.blake2b(digest_size=16)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow tokenizer: hash the files it was loaded from
        d = Path(getattr(tok, "name_or_path", ""))
        for f in sorted(d.glob("*")) if d.is_dir() else []:
            if f.is_file() and not f.name.endswith((".safetensors", ".bin")):
                h.update(f.name.encode() + f.read_bytes())
    h.update(f"eos={tok.eos_token_id} len={len(tok)}".encode())
    return h.hexdigest()


def _source_stat(path: Path, files=None) -> dict:
    """Path, total size and newest mtime of a data file or folder, or of the `files` a glob matched (what
    the cache key depends on)."""
    files = files if files is not None else [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    stats = [f.stat() for f in files]
    return {"path": str(path.resolve() if path.exists() else path), "size": sum(s.st_size for s in stats),
            "mtime_ns": max((s.st_mtime_ns for s in stats), default=0), "files": len(files)}


def _check_args(data: Path, out: Path | None, num_proc, doc_split, overwrite, glob: bool = False):
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise RemodelError(f"num_proc must be a positive integer, got {num_proc!r}")
    if doc_split not in DOC_SPLITS:
        raise RemodelError(f"doc_split must be one of {', '.join(DOC_SPLITS)}, got {doc_split!r}")
    if not data.exists() and not glob:
        raise RemodelError(f"data not found: {data}")
    if out is not None and out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise RemodelError(f"{out}: output exists and is not empty (pass --overwrite to replace it)")


@dataclass(frozen=True)
class _Settings:
    """tokenize's keywords, as one value for its body (which tokenize_megatron calls for its work set)."""
    num_proc: int = 1
    doc_split: str = "line"
    eos: bool = True
    overwrite: bool = False
    shard_tokens: int = shards.SHARD_TOKENS


def tokenize(data, out, tokenizer, *, num_proc: int = 1, doc_split: str = "line", eos: bool = True,
             overwrite: bool = False, shard_tokens: int = shards.SHARD_TOKENS) -> dict:
    """Tokenize DATA (what pipelines.data.data.load_texts reads, or a glob of such files) into the token
    set OUT, atomically, streaming: see pipelines.data.shards. A killed run rerun with the same arguments
    keeps its finished shards of about `shard_tokens` tokens (report["resumed_shards"]); the result is the
    same bytes. Returns the report (meta and run figures)."""
    return _tokenize(data, out, tokenizer, _Settings(num_proc, doc_split, eos, overwrite, shard_tokens))


def _tokenize(data, out, tokenizer, o: _Settings, work_set: bool = False) -> dict:
    """tokenize; work_set: OUT is a work set of tokenize_megatron, marked as remodel's before it appears."""
    num_proc, doc_split, eos, overwrite, shard_tokens = o.num_proc, o.doc_split, o.eos, o.overwrite, o.shard_tokens
    data, out = Path(data).expanduser(), Path(out).expanduser()
    is_glob = not data.exists() and glob.has_magic(str(data))
    _check_args(data, out, num_proc, doc_split, overwrite, glob=is_glob)
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise RemodelError(f"shard_tokens must be a positive integer (--shard-tokens), got {shard_tokens!r}")
    files, kind = stream.inputs(data)
    tok = load_tokenizer(tokenizer, "--tokenizer") if isinstance(tokenizer, (str, Path)) else tokenizer
    if eos and tok.eos_token_id is None:
        raise RemodelError("the tokenizer has no eos token; tokenize with eos=False (--no-eos)")
    vocab = len(tok)
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    t0 = time.perf_counter()
    stream.check_inputs(files, kind, doc_split, data)
    source = _source_stat(data, files if is_glob else None)
    key = json.dumps([VERSION, source, tokenizer_hash(tok), doc_split, eos, dtype.name], sort_keys=True)
    inputs = files + ([Path(tokenizer)] if isinstance(tokenizer, (str, Path)) else [])
    with atomic_output_dir(out, overwrite=overwrite, inputs=inputs) as tmp:
        work = shards.work_dir(out.absolute())
        try:
            with shards.locked_work(work, key) as done:
                meter = stream.Meter()
                docs = stream.documents(files, kind, doc_split, meter, data)
                resumed = len(done)
                enc = shards.Encoding(tok, [tok.eos_token_id] if eos else [], dtype, num_proc)
                done = shards.write_shards(docs, done, work, enc, meter, source["size"], shard_tokens)
                n_tokens, n_docs, fingerprint, max_id = shards.assemble(done, work, tmp, dtype)
        except shards.WorkerDied:
            raise  # the finished shards stay: a rerun resumes from them
        except RemodelError:
            shards.remove_work(work)  # bad data: nothing to resume
            raise
        if n_tokens == 0:
            shards.remove_work(work)
            raise RemodelError("the data gives no tokens")
        meta = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "n_tokens": n_tokens,
                "n_docs": n_docs, "vocab_size": vocab, "max_id": max_id, "eos": eos,
                "eos_id": tok.eos_token_id if eos else None,
                "doc_split": doc_split, "tokenizer": {"name": str(getattr(tok, "name_or_path", "")),
                                                      "hash": tokenizer_hash(tok)},
                "source": source, "fingerprint": fingerprint}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if work_set:  # a work set of tokenize_megatron: marked as remodel's, so only it is ever removed
            mark_dir(tmp, shards.WORK_MARKER, kind="megatron work token set")
        report = {**meta, "output": str(out), "seconds": round(time.perf_counter() - t0, 3), "num_proc": num_proc,
                  "shards": len(done), "resumed_shards": resumed}
        (tmp / "remodel_report.json").write_text(json.dumps(report, indent=2) + "\n")
    shards.remove_work(work)
    return report


def tokenize_megatron(data, out, tokenizer, *, num_proc: int = 1, doc_split: str = "line", eos: bool = True,
                      overwrite: bool = False, shard_tokens: int = shards.SHARD_TOKENS) -> dict:
    """`remodel tokenize --format megatron`: DATA tokenized (resumably, in the work token set `.OUT.tokens`
    beside OUT) and written atomically as OUT/data.bin + OUT/data.idx (the prefix OUT/data, or OUT itself,
    is what --data and Megatron take). The work set is removed whatever the outcome; a folder at its name
    that remodel did not make is refused in one line, untouched."""
    data, out = Path(data).expanduser(), Path(out).expanduser()
    _check_args(data, out, num_proc, doc_split, overwrite, glob=not data.exists() and glob.has_magic(str(data)))
    check_out(out, overwrite, [data] + ([Path(tokenizer)] if isinstance(tokenizer, (str, Path)) else []))
    work = out.absolute().parent / f".{out.name}.tokens"
    check_owned(work, shards.WORK_MARKER, "the megatron work token set", _legacy_work_set)
    t0 = time.perf_counter()
    try:
        report = _tokenize(data, work, tokenizer, _Settings(num_proc, doc_split, eos, True, shard_tokens),
                           work_set=True)
        src = TokenSet(work)
        with atomic_output_dir(out, overwrite=overwrite, inputs=[data]) as tmp:
            megatron.write_megatron(src, tmp / megatron.NAME)
            got = megatron.MegatronSet(tmp / megatron.NAME)  # what we wrote reads back: every check above holds
            report = {**{k: report[k] for k in ("n_tokens", "n_docs", "vocab_size", "eos", "doc_split", "tokenizer",
                                               "source", "num_proc")},
                      "format": "megatron", "dtype": got.dtype.name, "prefix": str(out.absolute() / megatron.NAME),
                      "output": str(out), "seconds": round(time.perf_counter() - t0, 3)}
            (tmp / "remodel_report.json").write_text(json.dumps(report, indent=2) + "\n")
    finally:
        remove_owned(work, shards.WORK_MARKER, "the megatron work token set", _legacy_work_set)
    return report


def _legacy_work_set(folder: Path) -> bool:
    """A work set an older remodel left (before the marker): a token set written by `tokenize`."""
    try:
        return read_meta(folder).get("format") == FORMAT and (folder / "remodel_report.json").is_file()
    except (RemodelError, OSError):
        return False


def cache_root() -> Path:
    """Where `ensure_tokens` keeps token sets: $REMODEL_CACHE/tokens, else ~/.cache/remodel/tokens."""
    env = os.environ.get("REMODEL_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "remodel") / "tokens"


def is_token_set(path) -> bool:
    """True for a folder holding a meta.json written by `tokenize`, or one that looks like a token set
    (meta.json and tokens.bin, of any kind), so that TokenSet names what is wrong with it. Never opens
    anything but a small regular file (a FIFO would block)."""
    folder = Path(path).expanduser()
    try:
        return read_meta(folder).get("format") == FORMAT
    except (RemodelError, OSError):
        return folder.is_dir() and os.path.lexists(folder / "meta.json") and os.path.lexists(folder / "tokens.bin")


def read_meta(folder) -> dict:
    """The JSON object in FOLDER/meta.json (a regular file of at most META_MAX_BYTES), unvalidated."""
    path = Path(folder).expanduser() / "meta.json"
    raw = read_bounded(path, "meta.json", META_MAX_BYTES)
    meta = parse_json(raw, path)  # the one strict reader of JSON (depth, duplicate keys, finite numbers)
    if not isinstance(meta, dict):
        raise RemodelError(f"{path}: meta.json must hold a JSON object, not {type(meta).__name__}")
    return meta


_INT, _NONE = (int,), (type(None),)
META_KEYS = {"format": (str,), "version": _INT, "dtype": (str,), "n_tokens": _INT, "n_docs": _INT,
             "vocab_size": _INT, "eos": (bool,), "eos_id": _INT + _NONE, "doc_split": (str,),
             "tokenizer": (dict,), "source": (dict,), "fingerprint": (str,)}
OPTIONAL_KEYS = {"max_id": _INT + _NONE}


def check_meta(meta: dict, where) -> dict:
    """`meta` when it is a valid meta.json of this version: every known key with its type, a known
    dtype, counts >= 0, ids inside the vocabulary; a one-line RemodelError naming the first problem."""
    if meta.get("format") != FORMAT:
        raise RemodelError(f"{where}: not a token set (meta.json format is {meta.get('format')!r}, not {FORMAT!r})")
    for key, types in {**META_KEYS, **OPTIONAL_KEYS}.items():
        if key not in meta:
            if key in META_KEYS:
                raise RemodelError(f"{where}: meta.json lacks {key!r}")
            continue
        v = meta[key]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise RemodelError(f"{where}: meta.json {key!r} must be {' or '.join(t.__name__ for t in types)}, "
                               f"got {v!r}"[:300])
    if meta["version"] != VERSION:
        raise RemodelError(f"{where}: token set version {meta['version']}, this remodel reads {VERSION}; "
                           "tokenize it again")
    if meta["dtype"] not in DTYPES:
        raise RemodelError(f"{where}: meta.json dtype must be one of {', '.join(DTYPES)}, got {meta['dtype']!r}")
    bounds = {"n_tokens": (0, 1 << 62), "n_docs": (0, 1 << 62), "vocab_size": (1, np.iinfo(meta["dtype"]).max + 1),
              "eos_id": (0, 1 << 62), "max_id": (0, 1 << 62)}
    for key, (lo, hi) in bounds.items():
        if meta.get(key) is not None and not lo <= meta[key] <= hi:
            raise RemodelError(f"{where}: meta.json {key} is {meta[key]}, outside {lo}..{hi}"
                               + (f" for dtype {meta['dtype']}" if key == "vocab_size" else ""))
    for key in ("eos_id", "max_id"):
        if meta.get(key) is not None and meta[key] >= meta["vocab_size"]:
            raise RemodelError(f"{where}: meta.json {key} {meta[key]} is outside the vocabulary ({meta['vocab_size']})")
    if meta["doc_split"] not in DOC_SPLITS:
        raise RemodelError(f"{where}: meta.json doc_split must be one of {', '.join(DOC_SPLITS)}")
    if not isinstance(meta["tokenizer"].get("hash"), str) or not isinstance(meta["tokenizer"].get("name", ""), str):
        raise RemodelError(f"{where}: meta.json tokenizer must hold a 'hash' string")
    return meta


def ensure_tokens(data, tokenizer, cache_dir=None, num_proc: int = 1, doc_split: str = "line",
                  eos: bool = True) -> Path:
    """A token set for DATA: DATA itself when it is one, else a cached tokenization of it.

    The cache entry (under cache_dir or `cache_root()`) is keyed by the source's path, size and mtime, the
    tokenizer's hash, doc_split and eos, so an edited corpus or another tokenizer is tokenized afresh.
    Under several processes call it on one rank first; concurrent runs on one corpus (separate jobs)
    wait for the one that tokenizes and reuse its set.
    """
    data = Path(data).expanduser()
    if not is_token_set(data) and megatron.is_megatron(data):
        return data  # Megatron's .bin/.idx: tokenized already, with a tokenizer it does not record
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
    if is_token_set(data):
        meta = check_meta(read_meta(data), data)
        if meta["tokenizer"]["hash"] != tokenizer_hash(tok):
            raise RemodelError(f"{data}: token set was made with another tokenizer ({meta['tokenizer']['name']})")
        return data
    _check_args(data, None, num_proc, doc_split, False)
    key = json.dumps([VERSION, _source_stat(data), tokenizer_hash(tok), doc_split, eos], sort_keys=True)
    out = Path(cache_dir).expanduser() if cache_dir else cache_root()
    out = out / hashlib.blake2b(key.encode(), digest_size=12).hexdigest()
    if not is_token_set(out):
        with _entry_lock(out):  # concurrent runs on one corpus: one tokenizes, the others wait and reuse it
            if not is_token_set(out):
                tokenize(data, out, tok, num_proc=num_proc, doc_split=doc_split, eos=eos, overwrite=out.exists())
    return out


@contextlib.contextmanager
def _entry_lock(out: Path):
    """An exclusive lock on the cache entry `out` (a `.NAME.lock` file beside it, kept: removing it would
    let a waiter lock a file no newcomer sees)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out.parent / f".{out.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# -- reading ---------------------------------------------------------------------------------------

class TokenSet(TokenFile):
    """A token set folder: `n_tokens`, `n_docs`, `vocab_size`, `fingerprint`, `meta`; `read` for
    positioned reads of token ranges, `tokens` a read-only memory map of tokens.bin (made on first use)."""

    def __init__(self, path):
        self.path = Path(path).expanduser()
        self.bin_path = self.path / "tokens.bin"
        if not is_token_set(self.path):
            raise RemodelError(f"{self.path}: not a token set (no meta.json written by `remodel tokenize`)")
        self.meta = check_meta(read_meta(self.path), self.path)
        self.dtype = np.dtype(self.meta["dtype"])
        self.n_tokens, self.n_docs = self.meta["n_tokens"], self.meta["n_docs"]
        self.vocab_size, self.fingerprint = self.meta["vocab_size"], self.meta["fingerprint"]
        self._fd = open_regular(self.bin_path, "tokens.bin")
        size, actual = self.n_tokens * self.dtype.itemsize, os.fstat(self._fd).st_size
        if actual != size:
            raise RemodelError(f"{self.path}: tokens.bin holds {actual} bytes, meta.json says {size} "
                               f"({'truncated?' if actual < size else 'not the file meta.json describes'})")
        self._check_docs()

    def _check_docs(self):
        """docs.idx: n_docs + 1 int64 offsets from 0 to n_tokens, never decreasing (read in chunks)."""
        path = self.path / "docs.idx"
        fd = open_regular(path, "docs.idx")
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(fd).st_size
            if size != (self.n_docs + 1) * 8:
                raise RemodelError(f"{path}: docs.idx holds {size} bytes, meta.json's {self.n_docs} documents "
                                   f"need {(self.n_docs + 1) * 8} (truncated?)")
            prev, first = 0, True
            for _ in range(0, self.n_docs + 1, CHUNK):
                idx = np.fromfile(f, np.int64, CHUNK)
                if (first and idx[0] != 0) or idx[0] < prev or (idx[1:] < idx[:-1]).any():
                    raise RemodelError(f"{path}: document offsets do not start at 0 and never decrease (corrupt)")
                prev, first = int(idx[-1]), False
            if prev != self.n_tokens:
                raise RemodelError(f"{path}: the last document ends at token {prev}, meta.json says "
                                   f"{self.n_tokens} tokens (corrupt)")

    def max_id(self) -> int:
        """The largest token id in tokens.bin, by a scan in CHUNK-token positioned reads (-1 when empty)."""
        top, buf = -1, np.empty(min(CHUNK, max(1, self.n_tokens)), self.dtype)
        for start in range(0, self.n_tokens, CHUNK):
            n = min(CHUNK, self.n_tokens - start)
            top = max(top, int(self.read(start, n, buf[:n]).max()))
        return top

    def check_vocab(self, vocab_size: int, scan_limit: int = SCAN_TOKENS):
        """Refuse (one line) a set whose ids may reach past a model's `vocab_size`: its meta vocab_size,
        its recorded max_id, and, for sets of at most `scan_limit` tokens, its actual largest id (which
        must also agree with a recorded max_id). Larger sets rely on the sampler's per-row check."""
        if self.vocab_size > vocab_size:
            raise RemodelError(f"{self.path}: token ids go up to {self.vocab_size - 1}, beyond the model's "
                               f"vocabulary ({vocab_size})")
        recorded = self.meta.get("max_id")
        actual = self.max_id() if self.n_tokens <= scan_limit else None
        if actual is not None and recorded is not None and actual > recorded:
            raise RemodelError(f"{self.path}: tokens.bin holds id {actual}, above meta.json's max_id {recorded} "
                               "(corrupt)")
        top = actual if actual is not None else recorded
        if top is not None and top >= min(vocab_size, self.vocab_size):
            raise RemodelError(f"{self.path}: tokens.bin holds token id {top}, outside the vocabulary "
                               f"({min(vocab_size, self.vocab_size)}) (corrupt token set?)")

    def document(self, i: int) -> np.ndarray:
        """Tokens of document i (eos included when the set was made with eos)."""
        if not 0 <= i < self.n_docs:
            raise IndexError(f"document {i} outside 0..{self.n_docs - 1}")
        idx = np.fromfile(self.path / "docs.idx", np.int64, 2, offset=8 * i)
        return self.read(int(idx[0]), int(idx[1] - idx[0]))

    def __repr__(self):
        return f"TokenSet({str(self.path)!r}, n_tokens={self.n_tokens}, dtype={self.dtype.name})"


def parse_blend(spec, check_paths: bool = True) -> list[tuple[float, str]]:
    """'0.7 A 0.3 B' (or its split list) -> [(0.7, 'A'), (0.3, 'B')]; a lone 'A' -> [(1.0, 'A')]. Weights
    must be finite and positive, at most MAX_BLEND parts, and (check_paths) every path must exist."""
    parts = spec.split() if isinstance(spec, str) else [str(s) for s in spec]
    if len(parts) == 1:
        out = [(1.0, parts[0])]
    elif not parts or len(parts) % 2:
        raise RemodelError(f"blend spec must be 'WEIGHT PATH [WEIGHT PATH ...]', got {' '.join(parts)[:200]!r}")
    elif len(parts) // 2 > MAX_BLEND:
        raise RemodelError(f"blend spec has {len(parts) // 2} parts, more than the {MAX_BLEND} allowed")
    else:
        out = [(_weight(w, p), p) for w, p in zip(parts[::2], parts[1::2])]
    for _, p in out if check_paths else []:
        if not os.path.exists(Path(p).expanduser()) and not megatron.is_megatron(p):
            raise RemodelError(f"blend spec: data not found: {p}" if len(out) > 1 else f"data not found: {p}")
    return out


def _weight(w: str, path: str) -> float:
    try:
        weight = float(w)
    except ValueError:
        raise RemodelError(f"blend spec: {w[:50]!r} is not a weight (expected 'WEIGHT PATH ...')") from None
    if not 0 < weight < float("inf"):
        raise RemodelError(f"blend spec: weight of {path} must be positive and finite, got {w[:50]}")
    return weight


def open_set(path):
    """The token source at `path`: a token set folder (remodel tokenize), else a Megatron prefix."""
    return TokenSet(path) if is_token_set(path) or not megatron.is_megatron(path) else megatron.MegatronSet(path)


class Blend:
    """Token sets mixed with weights, as Megatron's blended dataset: sample i of the stream comes from the
    set whose turn it is in a fixed pattern (each set's samples at ideal times (j + 1/2) / weight, merged),
    so every window holds each set within about one sample of its share. Each set keeps its own shuffled
    order and epochs; `counts(i)` is closed-form, so resuming never replays the stream."""

    def __init__(self, parts):
        parts = [(float(w), s if isinstance(s, TokenFile) else open_set(s)) for w, s in parts]
        if not parts or len(parts) > MAX_BLEND or any(not 0 < w < float("inf") for w, _ in parts):
            raise RemodelError(f"a blend needs 1 to {MAX_BLEND} token sets, each with a positive finite weight")
        hashes = {s.meta["tokenizer"]["hash"] for _, s in parts} - {None}  # Megatron sets record none
        if len(hashes) > 1:
            raise RemodelError("blended token sets were made with different tokenizers")
        self.sets = [s for _, s in parts]
        w = np.array([w for w, _ in parts])
        w = w / w.max()  # first, so that a sum of huge weights cannot overflow
        w = w / w.sum()
        self.weights = w
        q = np.maximum(np.floor(w * BLEND_PERIOD).astype(np.int64), 1)
        q[np.argmax(q)] += BLEND_PERIOD - q.sum()  # quantized weights sum to the period exactly
        self.quota = q
        keys = np.concatenate([(np.arange(n) + 0.5) / n for n in q])
        labels = np.repeat(np.arange(len(q)), q)
        self.pattern = labels[np.lexsort((labels, keys))]
        self.prefix = np.zeros((len(q), BLEND_PERIOD + 1), np.int64)  # prefix[d, p]: d's in pattern[:p]
        for d in range(len(q)):
            np.cumsum(self.pattern == d, out=self.prefix[d, 1:])

    def locate(self, positions: np.ndarray):
        """(set index, sample index within that set's own stream) of stream positions."""
        cycle, p = np.divmod(positions, BLEND_PERIOD)
        d = self.pattern[p]
        return d, cycle * self.quota[d] + self.prefix[d, p]


def open_tokens(spec):
    """A TokenSet (or MegatronSet) for one path, a Blend for a 'W1 A W2 B ...' spec (string or list)."""
    if isinstance(spec, (str, Path)) and (is_token_set(spec) or megatron.is_megatron(spec)):
        return open_set(spec)  # a path, spaces and all
    parts = parse_blend(spec)
    return open_set(parts[0][1]) if len(parts) == 1 else Blend([(w, open_set(p)) for w, p in parts])
