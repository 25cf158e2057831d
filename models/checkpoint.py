"""Streaming Hugging Face checkpoint I/O: one tensor at a time, never a whole model.

CheckpointReader validates a checkpoint directory up front (config.json, safetensors headers,
index, shard sizes) and then reads single tensors on demand. CheckpointWriter writes tensors
straight into shards of at most max_shard_bytes and writes the transformers layout at close().
atomic_output_dir (models/outputs.py) makes an output appear all at once or not at all.
Peak memory is about the largest tensor (the writer holds no shard buffer). Only safetensors is read:
pickle checkpoints (*.bin, *.pt) are refused, never unpickled.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import re
import shutil
import struct
import sys
from pathlib import Path

import torch

from .errors import RemodelError
from .files import open_regular, parse_json, read_json
from .fp8 import fingerprint, fp8_output, fp8_views
from .mxfp4 import mxfp4_output
from .outputs import atomic_output_dir  # also re-exported: the commands take it from here

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
             "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja",
             "added_tokens.json")
MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
           "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16",
           "BF16": "bfloat16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
           "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}
DTYPES = {k: getattr(torch, v) for k, v in _DTYPES.items() if hasattr(torch, v)}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# quantized checkpoints read as plain weights: each maps (config, {name: (dtype, shape)}, path) to {weight name:
# models.fp8.Dequantized (the stored parts it is made of, its shape, dtype and read(*parts))}
DEQUANTIZERS = (fp8_views,)
# an output in its quantized source's format: each maps a reader to an object with tensors(name, value) -> [(name,
# stored tensor)] and config(hf config) -> config.json (models.fp8.Fp8Output, models.mxfp4.Mxfp4Output), or None
QUANTIZERS = (fp8_output, mxfp4_output)


def _entry(path, name, e) -> tuple:
    """(dtype, shape, start, end) of one header entry, checked as the safetensors library does."""
    try:
        dtype, shape, offsets = DTYPES[e["dtype"]], e["shape"], e["data_offsets"]
        assert isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2
        assert all(type(d) is int and 0 <= d < 2**63 for d in [*shape, *offsets])
    except (KeyError, TypeError, AssertionError):
        raise RemodelError(f"{path}: corrupt or unsupported safetensors header entry {name!r} "
                           f"(dtype {e.get('dtype') if isinstance(e, dict) else e!r})") from None
    start, end = offsets
    if end - start != math.prod(shape) * dtype.itemsize:
        raise RemodelError(f"{path}: corrupt safetensors header: {name!r} has {end - start} bytes "
                           f"for shape {shape} {e['dtype']}")
    return dtype, shape, start, end


def read_header(path: Path) -> tuple[int, dict]:
    """Parse and check a safetensors header: (offset of the data section, {name: entry}). As strict as
    the safetensors library: a JSON object without duplicate names, string metadata, known dtypes,
    span = shape x dtype size, and the tensors' byte ranges contiguous from 0 to the end of the file
    (no gap, no overlap, nothing shifted or left over)."""
    with os.fdopen(open_regular(path, "safetensors file"), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise RemodelError(f"{path}: file of {size} bytes is too short for a safetensors header")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, MAX_HEADER):
            raise RemodelError(f"{path}: corrupt or truncated safetensors header "
                               f"(declares {n} header bytes, file has {size})")
        raw = f.read(n)
    header = parse_json(raw, f"{path} (safetensors header)")
    if not isinstance(header, dict):
        raise RemodelError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise RemodelError(f"{path}: corrupt safetensors header (__metadata__ is not a string map)")
    spans = sorted((_entry(path, k, e)[2:] + (k,) for k, e in header.items()))
    pos = 0
    for start, end, name in spans:
        if start != pos:
            raise RemodelError(f"{path}: corrupt safetensors header: {name!r} starts at byte {start}, expected "
                               f"{pos} (tensors must be contiguous and must not overlap)")
        pos = end
    if pos != size - 8 - n:
        raise RemodelError(f"{path}: truncated or padded file: the tensors end at byte {pos} of the data "
                           f"section, which has {size - 8 - n} bytes")
    return 8 + n, header


_SHARD = re.compile(r"[^/\\]+\.safetensors")


def read_index(path: Path) -> dict:
    """{tensor name: shard file name} of a model.safetensors.index.json, checked: a weight_map of strings
    naming plain *.safetensors files in the same directory."""
    wmap = read_json(path).get("weight_map")
    if not isinstance(wmap, dict) or not wmap or not all(isinstance(v, str) for v in wmap.values()):
        raise RemodelError(f"{path}: missing or malformed 'weight_map'")
    for shard in set(wmap.values()):
        if not _SHARD.fullmatch(shard) or shard.startswith("."):
            raise RemodelError(f"{path}: shard {shard!r} is not a .safetensors file name in this directory")
    return wmap


def aux_files(path) -> list[Path]:
    """Non-weight files of a checkpoint directory worth copying to an output (not config.json)."""
    return [Path(path) / f for f in AUX_FILES if (Path(path) / f).is_file()]


def without_absent_mtp(d: dict, tensor_names) -> dict:
    """The HF config of a checkpoint whose config declares MTP layers (num_nextn_predict_layers) but whose
    weights hold no MTP tensor (`mtp.*`, or DeepSeek / GLM's `model.layers.{num_hidden_layers}.*`; e.g. a
    trunk-only export, or transformers' save): MTP off, the declared count recorded in
    `num_nextn_predict_layers_dropped`. MTP is on only when the checkpoint has it."""
    after = f"model.layers.{d.get('num_hidden_layers')}."
    if not (d.get("num_nextn_predict_layers") or 0) or any(k.startswith(("mtp.", after)) for k in tensor_names):
        return d
    return {**d, "num_nextn_predict_layers": 0, "num_nextn_predict_layers_dropped": d["num_nextn_predict_layers"]}


class CheckpointReader:
    """Read-only view of a Hugging Face safetensors checkpoint directory, one tensor at a time."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise RemodelError(f"{self.path}: checkpoint directory does not exist")
        self.config = read_json(self.path / "config.json")
        if not isinstance(self.config.get("model_type"), str):
            raise RemodelError(f"{self.path / 'config.json'}: no 'model_type' (not a Hugging Face model config)")
        if (self.path / SINGLE).is_file():
            shards = {SINGLE: None}
        elif (self.path / INDEX).is_file():
            wmap = read_index(self.path / INDEX)
            shards = {}
            for name, shard in wmap.items():
                shards.setdefault(shard, []).append(name)
        else:
            pickles = sorted(p.name for p in self.path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
            if pickles:
                raise RemodelError(f"{self.path}: only pickle weights ({', '.join(pickles[:3])}); remodel reads "
                                   f"safetensors only, convert with save_pretrained(safe_serialization=True)")
            raise RemodelError(f"{self.path}: no {SINGLE} or {INDEX}")
        self._data_start, self._where, self._handles = {}, {}, {}
        for shard, names in shards.items():
            file = self.path / shard
            if Path(shard).name != shard or not file.is_file():
                raise RemodelError(f"{self.path / INDEX}: shard {shard!r} does not exist in {self.path}")
            self._data_start[shard], header = read_header(file)
            for name in header if names is None else names:
                if name not in header:
                    raise RemodelError(f"{file}: tensor {name!r} listed in {INDEX} is missing from the shard")
                self._where[name] = (shard, header[name])
        self._views = dequantized(self.config, self._where, self.path)  # the hook: quantized weights
        self.source_config, self.read_log = self.config, None  # read_log: {fingerprint: name} once an output asks
        self._keys = sorted(set(self._where) - {p for v in self._views.values() for p in v.parts} | set(self._views))
        self._has = set(self._keys)
        self.config = without_absent_mtp(self.config, self._keys)
        if self._views:  # what it reads is plain weights
            self.config = {k: v for k, v in self.config.items() if k != "quantization_config"}

    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, name) -> bool:
        return name in self._has

    def __len__(self) -> int:
        return len(self._keys)

    def _entry(self, name) -> tuple[str, dict]:
        if name not in self._where:
            raise RemodelError(f"{self.path}: no tensor named {name!r}")
        return self._where[name]

    def shape(self, name) -> tuple[int, ...]:
        return self._views[name].shape if name in self._views else tuple(self._entry(name)[1]["shape"])

    def dtype(self, name) -> torch.dtype:
        return self._views[name].dtype if name in self._views else DTYPES[self._entry(name)[1]["dtype"]]

    def stored(self, name) -> list[tuple[torch.dtype, int]]:
        """(dtype, bytes) of each tensor the file stores for `name` (a quantized weight: its data and scales)."""
        parts = self._views[name].parts if name in self._views else (name,)
        return [(DTYPES[self._entry(p)[1]["dtype"]], self._entry(p)[1]["data_offsets"][1]
                 - self._entry(p)[1]["data_offsets"][0]) for p in parts]

    def nbytes(self, name) -> int:
        return sum(n for _, n in self.stored(name))

    def total_bytes(self) -> int:
        return sum(self.nbytes(k) for k in self._keys)

    def get(self, name) -> torch.Tensor:
        """Read exactly one tensor into fresh memory (plain file read; no mmap of the shard); a quantized weight
        dequantized from its stored parts (its value logged when an output in the source's format asks)."""
        v = self._views.get(name)
        if v is None:
            return self._raw(name)
        t = v.read(*map(self._raw, v.parts))
        if self.read_log is not None:
            self.read_log[fingerprint(t)] = name
        return t

    def views(self) -> dict:
        """{weight name: models.fp8.Dequantized} of the weights stored quantized."""
        return dict(self._views)

    def parts(self, name) -> list[tuple[str, torch.Tensor]]:
        """[(stored name, stored tensor)] that `name` is made of, as stored (a quantized weight: data and scales)."""
        return [(p, self._raw(p)) for p in (self._views[name].parts if name in self._views else (name,))]

    def _raw(self, name) -> torch.Tensor:
        shard, e = self._entry(name)
        start, end = e["data_offsets"]
        if shard not in self._handles:
            self._handles[shard] = open(self.path / shard, "rb")
        f = self._handles[shard]
        buf = torch.empty(end - start, dtype=torch.uint8)
        f.seek(self._data_start[shard] + start)
        if end > start and f.readinto(buf.numpy()) != end - start:
            raise RemodelError(f"{self.path / shard}: truncated while reading {name!r}")
        return buf.view(DTYPES[e["dtype"]]).reshape(e["shape"])

    def aux_files(self) -> list[Path]:
        return aux_files(self.path)

    def close(self):
        for f in self._handles.values():
            f.close()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def dequantized(config: dict, where: dict, path) -> dict:
    """{weight name: Dequantized} of the quantized weights among the header entries `where` ({name: (shard,
    entry)}) by every DEQUANTIZER (checked from the headers, nothing read)."""
    stored = {k: (DTYPES[e["dtype"]], tuple(e["shape"])) for k, (_, e) in where.items()}
    return {k: v for dq in DEQUANTIZERS for k, v in dq(config, stored, path).items()}


def output_format(reader, dtype=None):
    """The format an output of `reader`'s source is written in: its own quantized one (a QUANTIZERS entry) unless
    a dtype is asked for (plain weights); None: plain."""
    if dtype is not None:
        return None
    return next((f for f in (q(reader) for q in QUANTIZERS) if f is not None), None)


def _trim_heap():
    """Return freed heap pages to the OS after each shard (the held odd-sized tensors, the callers'
    freed tensors): glibc may otherwise keep them resident after raising its mmap threshold."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


COMPACT_WASTE = 0.01  # a shard whose unused header space exceeds this fraction of its data is rewritten
METADATA = {"__metadata__": {"format": "pt"}}  # what transformers' save_pretrained writes


def _copy_range(src_fd: int, dst_fd: int, offset: int, n: int):
    """Append n bytes of src from offset to dst (at its current position), in the kernel where possible."""
    while n > 0:
        try:
            k = os.copy_file_range(src_fd, dst_fd, min(n, 1 << 30), offset)
        except (AttributeError, OSError):
            k = os.write(dst_fd, os.pread(src_fd, min(n, 1 << 24), offset))
        if k <= 0:
            raise RemodelError(f"short copy while compacting a shard ({n} bytes left)")
        offset, n = offset + k, n - k


def _entry_len(name: str, t: torch.Tensor) -> int:
    """Upper bound on the bytes `name`'s entry adds to a safetensors header (offsets of 20 digits)."""
    e = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [10**19, 10**19]}
    return len(json.dumps({name: e}, separators=(",", ":"))) - 1  # "{...}" -> '"name":{...},'


def cast_for_output(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` in `dtype` for writing (floating point only; a sigmoid router's correction bias stays as it is).
    A cast that turns a finite weight into inf (beyond the target's range) is refused naming the tensor,
    as is a source that already holds NaN / inf: one isfinite pass per tensor, streaming-friendly."""
    if dtype is None or not t.is_floating_point() or t.dtype == dtype or name.endswith("e_score_correction_bias"):
        return t
    out = t.to(dtype)
    seen = out.float() if out.element_size() == 1 else out  # float8: no isfinite kernel; e4m3fn overflows to NaN
    if not out.is_floating_point() or bool(torch.isfinite(seen).all()):
        return out
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise RemodelError(f"tensor {name!r} holds {bad} non-finite value(s) (NaN or inf); nothing written")
    over = int((~torch.isfinite(seen)).sum())
    raise RemodelError(f"tensor {name!r}: {over} value(s) beyond {str(dtype).replace('torch.', '')}'s range "
                       f"(max {torch.finfo(dtype).max:g}, largest here {float(t.abs().max()):g}) would become inf; "
                       "choose a wider --dtype")


class CheckpointWriter:
    """Write tensors as transformers-style safetensors shards of at most max_shard_bytes each
    (a single tensor larger than that gets a shard of its own).

    Each tensor's bytes go to the open shard file as add() receives it, straight from its memory (no
    serialisation buffer, no copy), so memory is the caller's current tensor, not a shard. The header,
    which safetensors puts first, is written at the shard's end into space reserved at its start
    (padded with spaces, as the format allows); a shard closes early if its header would outgrow the
    reservation, and a shard whose unused reservation exceeds COMPACT_WASTE of its data (a small model,
    a short last shard) is copied, in the kernel, into a file without it. Tensors whose size is not a
    multiple of 8 bytes are held (copied) and written last, by descending item size, so every tensor
    stays aligned to its element size."""

    def __init__(self, out_dir, max_shard_bytes: int = 2 * 1024**3, fmt=None):
        if sys.byteorder != "little":
            raise RemodelError("writing safetensors needs a little-endian machine")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._reserve = min(1 << 20, max(4096, max_shard_bytes // 2048)) // 8 * 8  # header bytes per shard
        self._f = None  # the open shard
        self._shards = []  # [(temporary file, [names])]
        self._names = set()
        self.total_size = 0
        self._closed = False
        self.fmt = fmt  # output_format(): a quantized source's format, or None (plain)

    def add(self, name: str, tensor: torch.Tensor):
        """Write `tensor` (its values now: later in-place changes do not reach the file), in self.fmt."""
        for k, t in self.fmt.tensors(name, tensor) if self.fmt is not None else [(name, tensor)]:
            self._add(k, t)

    def _add(self, name: str, tensor: torch.Tensor):
        if self._closed:
            raise RemodelError(f"{self.out_dir}: writer already closed, cannot add {name!r}")
        if name in self._names:
            raise RemodelError(f"{self.out_dir}: duplicate tensor name {name!r}")
        t = tensor.detach().to("cpu").contiguous()
        if t.dtype not in DTYPE_NAMES:
            raise RemodelError(f"cannot write {name!r}: dtype {t.dtype} has no safetensors name")
        n = _entry_len(name, t)
        if self._f is not None and (self._bytes + t.nbytes > self.max_shard_bytes
                                    or self._header + n > self._reserve):
            self._flush()
        if self._f is None:
            self._open()
        if t.nbytes % 8:
            self._held[name] = t.clone()  # written at the shard's end
        else:
            self._write(name, t)
        self._names.add(name)
        self._header += n
        self._bytes += t.nbytes
        self.total_size += t.nbytes

    def _open(self):
        self._path = self.out_dir / f"model-{len(self._shards) + 1:05d}.safetensors.tmp"
        self._f = open(self._path, "w+b")
        self._f.seek(8 + self._reserve)
        self._entries, self._held, self._offset, self._bytes = {}, {}, 0, 0
        self._header = len(json.dumps(METADATA, separators=(",", ":"))) + 1

    def _write(self, name: str, t: torch.Tensor):
        self._entries[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                               "data_offsets": [self._offset, self._offset + t.nbytes]}
        if t.nbytes:
            self._f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        self._offset += t.nbytes

    def _flush(self):
        for name in sorted(self._held, key=lambda k: -self._held[k].element_size()):  # stable
            self._write(name, self._held[name])
        raw = json.dumps({**METADATA, **self._entries}, separators=(",", ":")).encode()
        assert len(raw) <= self._reserve, "header reservation overflow"
        f, self._f = self._f, None
        if self._reserve - len(raw) > COMPACT_WASTE * self._offset:
            raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the library writes it
            compact = self._path.with_suffix(".compact")
            with open(compact, "wb") as g:
                g.write(struct.pack("<Q", len(raw)) + raw)
                g.flush()
                f.flush()
                _copy_range(f.fileno(), g.fileno(), 8 + self._reserve, self._offset)
            f.close()
            compact.replace(self._path)
        else:
            f.seek(0)
            f.write(struct.pack("<Q", self._reserve) + raw + b" " * (self._reserve - len(raw)))
            f.close()
        self._shards.append((self._path, list(self._entries)))
        self._held = {}
        _trim_heap()

    def close(self, config: dict, aux_from=None):
        """Write the last shard, the index (if sharded), config.json and aux files from `aux_from`."""
        if self._closed:
            raise RemodelError(f"{self.out_dir}: writer already closed")
        if self._f is None and not self._shards:
            self._open()  # an empty checkpoint still gets its (empty) shard
        if self._f is not None:
            self._flush()
        self._closed = True
        n = len(self._shards)
        weight_map = {}
        for i, (tmp, names) in enumerate(self._shards, 1):
            final = SINGLE if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            tmp.rename(self.out_dir / final)
            weight_map.update((k, final) for k in names)
        if n > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        config = self.fmt.config(config) if self.fmt is not None else config
        (self.out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in aux_files(aux_from) if aux_from is not None else []:
            shutil.copyfile(f, self.out_dir / f.name)


def copy_checkpoint(src, out, max_shard_bytes: int = 2 * 1024**3, overwrite: bool = False) -> Path:
    """Stream a checkpoint tensor by tensor into a fresh (re-sharded) output directory."""
    with CheckpointReader(src) as reader, atomic_output_dir(out, overwrite, inputs=[src]) as tmp:
        writer = CheckpointWriter(tmp, max_shard_bytes)
        for name in reader.keys():
            writer.add(name, reader.get(name))
        writer.close(reader.config, aux_from=src)
    return Path(out)
