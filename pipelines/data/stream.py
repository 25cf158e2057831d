"""Documents of a corpus read incrementally, in the order and with the splitting of data.load_texts.

`inputs(DATA)` resolves a path (file, folder, save_to_disk folder) or a glob to the files it reads;
`documents(files, doc_split, meter)` yields their documents one at a time, holding one document (one
paragraph, one parquet row group) at a time rather than the corpus; `meter` counts the input bytes read.
Only a .json file holding one JSON array (not JSON lines) is parsed whole: use .jsonl for large corpora.
"""
from __future__ import annotations

import contextlib
import glob
import gzip
import io
import json
import re
from pathlib import Path

from remodel.models.errors import RemodelError

from .data import JSON_SUFFIXES, TEXT_SUFFIXES, load_texts, text_errors

READ_CHARS = 1 << 20  # characters read per step of a paragraph split
PARAGRAPH = re.compile(r"\r?\n[ \t\r]*\n")  # data._read_lines's separator
BLANK = " \t\r\n"  # the characters a separator is made of
SAVED = ("dataset_info.json", "state.json", "dataset_dict.json")
PARQUET_ROWS = 1024  # rows per parquet batch


class Meter:
    """Input bytes read so far: whole files done plus the position in the current one."""

    def __init__(self):
        self.done, self.raw = 0, None

    @property
    def bytes(self) -> int:
        try:
            return self.done + (self.raw.tell() if self.raw is not None and not self.raw.closed else 0)
        except (OSError, ValueError):
            return self.done


def inputs(data) -> tuple[list[Path], str]:
    """(files or a saved-dataset folder, in reading order; kind 'text' / 'saved' / 'files') for DATA, a
    path or a glob ('corpus/*.jsonl.gz', '**' recursive); a one-line RemodelError when nothing fits."""
    path = Path(data).expanduser()
    if not path.exists() and glob.has_magic(str(data)):
        found = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not found:
            raise RemodelError(f"data not found: no file matches {data}")
        for f in found:
            _kind(f)
        return found, "files"
    if not path.exists():
        raise RemodelError(f"data not found: {path}")
    if not path.is_dir() and not path.is_file():  # a FIFO or device: reading it could block forever
        raise RemodelError(f"{path}: not a regular file or folder")
    if path.is_dir():
        if any((path / f).exists() for f in SAVED):
            return [path], "saved"
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(TEXT_SUFFIXES))
        if not files:
            raise RemodelError(f"{path}: folder has no .txt/.txt.gz files and is not a saved dataset")
        return files, "text"
    _kind(path)
    return [path], "files"


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    if name.endswith(JSON_SUFFIXES):
        return "json"
    if name.endswith(".parquet"):
        return "parquet"
    raise RemodelError(f"unsupported data file {path}: expected .txt, .txt.gz, .jsonl, .json, .parquet, "
                       "or a folder (text files or datasets.save_to_disk)")


def check_inputs(files: list[Path], kind: str, doc_split: str, where):
    """Cheap checks before any work: every file opens and its first document reads (UTF-8, gzip, JSON,
    a parquet 'text' column of strings), a saved dataset loads, the data holds a document; a one-line
    RemodelError otherwise."""
    for f in files if kind != "saved" else []:
        with contextlib.closing(_file_docs(f, "line", Meter())) as docs:
            next(docs, None)
    with contextlib.closing(documents(files, kind, doc_split, Meter(), where)) as docs:
        next(docs)


def documents(files: list[Path], kind: str, doc_split: str, meter: Meter, where):
    """Every document, in load_texts's order; raises `{where}: no text (empty data)` when there is none."""
    n = 0
    if kind == "saved":
        ds = load_texts(files[0])  # memory-mapped arrow files
        for batch in ds.iter(batch_size=PARQUET_ROWS):
            n += len(batch["text"])
            yield from batch["text"]
    else:
        for f in files:
            for doc in _file_docs(f, doc_split, meter):
                n += 1
                yield doc
            meter.done += f.stat().st_size
    if n == 0:
        raise RemodelError(f"{where}: no text (empty data)")


def _file_docs(path: Path, doc_split: str, meter: Meter):
    kind = _kind(path)
    if kind == "parquet":
        yield from _parquet_docs(path)
    elif kind == "json":
        yield from _json_docs(path, meter)
    else:
        yield from _text_docs(path, doc_split, meter)


@contextlib.contextmanager
def _open(path: Path, meter: Meter):
    """data._open, incremental, with the raw file's position in `meter` and the same one-line errors."""
    try:
        with text_errors(path), open(path, "rb") as raw:
            meter.raw = raw
            stream = gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw
            with io.TextIOWrapper(stream, encoding="utf-8") as f:
                yield f
    finally:
        meter.raw = None


def _text_docs(path: Path, doc_split: str, meter: Meter):
    """data._read_lines, incremental. Paragraphs: the text is cut just before its last character no
    separator can contain, so splitting the pieces equals splitting the whole text; each step scans only
    what follows the carried text's last such character (no separator lies before it), so one long
    paragraph costs linear time, not a rescan of the whole carry per read."""
    with _open(path, meter) as f:
        if doc_split == "line":
            for line in f:
                if line.strip():
                    yield line.rstrip("\r\n")
            return
        if doc_split == "file":
            text = f.read()
            if text.strip():
                yield text
            return
        carry = ""
        while chunk := f.read(READ_CHARS):
            buf, start = carry + chunk, len(carry.rstrip(BLANK))
            end = len(buf.rstrip(BLANK)) - 1  # the last character no separator can hold
            if end < 0:
                carry = buf
                continue
            done, at = [], 0
            for sep in PARAGRAPH.finditer(buf, start, end):
                done.append(buf[at:sep.start()])
                at = sep.end()
            carry = buf[at:]
            yield from _paragraphs(done)
        yield from _paragraphs(PARAGRAPH.split(carry))


def _paragraphs(parts):
    for p in parts:
        p = p.strip("\r\n")
        if p.strip():
            yield p


def _json_docs(path: Path, meter: Meter):
    """data._read_json, one line at a time for JSON lines (a .json array is parsed whole)."""
    if path.name.endswith((".json", ".json.gz")):
        with _open(path, meter) as f:
            first = f.read(1 << 16).lstrip()[:1]
        if first != "{" or _whole_json(path, meter):
            yield from load_texts(path)["text"]
            return
    with _open(path, meter) as f:
        for line in f:
            for piece in line.splitlines():  # as str.splitlines of the whole text
                if piece.strip():
                    text = _record(path, piece)
                    if text:
                        yield text


def _whole_json(path: Path, meter: Meter) -> bool:
    """True when a .json file starting with '{' is one JSON object over several lines."""
    with _open(path, meter) as f:
        line = next((x for x in f if x.strip()), "")
        rest = next((x for x in f if x.strip()), None)
    if rest is None:
        return True
    try:
        json.loads(line)
        return False
    except (ValueError, RecursionError):
        return True


def _record(path: Path, line: str) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise RemodelError(f"{path}: invalid JSON ({e})") from None
    except RecursionError:
        raise RemodelError(f"{path}: JSON nested too deeply") from None
    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
        raise RemodelError(f"{path}: every JSON record needs a 'text' field holding a string")
    return row["text"]


def _parquet_docs(path: Path):
    """The 'text' column of a parquet file, one row-group batch at a time (data._load + _text_only)."""
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except Exception as e:
        raise RemodelError(f"{path}: not a readable parquet file ({type(e).__name__})") from None
    if "text" not in schema.names:
        raise RemodelError(f"{path}: no 'text' column (columns: {', '.join(schema.names) or 'none'})")
    typ = schema.field("text").type
    if str(typ) not in ("string", "large_string"):
        raise RemodelError(f"{path}: the 'text' column holds {typ}, not strings")
    if pf.metadata.num_rows == 0:
        raise RemodelError(f"{path}: no documents")
    for batch in pf.iter_batches(batch_size=PARQUET_ROWS, columns=["text"]):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise RemodelError(f"{path}: 'text' values must be strings (found {text!r})")
            yield text
