"""Data loading shared by every command (score, eval, train, distill).

load_texts(DATA) -> datasets.Dataset with one `text` column, from local files only:
  .txt / .txt.gz            one document per non-empty line (doc_split="paragraph" / "file": per
                            blank-line separated paragraph / per file, newlines kept)
  folder of .txt / .txt.gz  files read in sorted path order (recursive)
  .jsonl / .json (.gz)      objects with a "text" field (.json: a list of objects, or JSON lines)
  .parquet                  a "text" column
  datasets.save_to_disk     a Dataset, or a DatasetDict ("train" split, or its only split)
pack() tokenizes and cuts into fixed blocks; batches() iterates them in a seeded, resumable order.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import math
import re
import zlib
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
import torch

from remodel.models.errors import RemodelError

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
TEXT_SUFFIXES = (".txt", ".txt.gz")
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
VALID_SPLITS = ("validation", "valid", "test")
DOC_SPLITS = ("line", "paragraph", "file")  # how a .txt file splits into documents (see _read_lines)
VALID_EVERY = 20  # split_valid without a validation split: every 20th document is held out


def embedded_corpus() -> tuple[Path, Path]:
    """(train, valid) .txt.gz files of the shipped King James Bible corpus."""
    return DATA_DIR / "corpus" / "train.txt.gz", DATA_DIR / "corpus" / "valid.txt.gz"


def embedded_moe_path() -> Path:
    """Folder of the shipped trained MoE: data/embedded upcycled to 8 experts and trained further
    (made by data/make_embedded_moe.py; loads with AutoModelForCausalLM.from_pretrained)."""
    return DATA_DIR / "embedded_moe"


def embedded_tokenizer_path() -> Path:
    """Folder of the shipped 2048-token byte-level BPE (loads with AutoTokenizer.from_pretrained)."""
    return DATA_DIR / "tokenizer"


@contextlib.contextmanager
def _open(path: Path):
    """Text file (gunzipped for .gz) as UTF-8, under text_errors."""
    with text_errors(path), (gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz") else
                             open(path, encoding="utf-8")) as f:
        yield f


@contextlib.contextmanager
def text_errors(path: Path):
    """A file that is not UTF-8, a truncated or fake .gz, or an unreadable file raises a one-line
    RemodelError naming it, also when the error comes while reading."""
    try:
        yield
    except UnicodeDecodeError as e:
        raise RemodelError(f"{path}: not UTF-8 text ({e.reason}, byte 0x{e.object[e.start]:02x}); "
                           "convert it to UTF-8 first") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise RemodelError(f"{path}: corrupt or truncated gzip file ({type(e).__name__}: {e})") from None
    except OSError as e:
        raise RemodelError(f"{path}: cannot read ({e.strerror or e})") from None


def _read_lines(path: Path, doc_split: str = "line") -> list[str]:
    """Documents of one text file: each non-empty line ("line", the newlines dropped), each blank-line
    separated paragraph ("paragraph") or the whole file ("file"); the last two keep their newlines."""
    with _open(path) as f:
        if doc_split == "line":
            return [line.rstrip("\r\n") for line in f if line.strip()]
        text = f.read()
    docs = [text] if doc_split == "file" else [p.strip("\r\n") for p in re.split(r"\r?\n[ \t\r]*\n", text)]
    return [d for d in docs if d.strip()]


def _read_json(path: Path) -> list[str]:
    with _open(path) as f:
        raw = f.read()
    rows = None
    if path.name.endswith((".json", ".json.gz")):
        try:
            rows = json.loads(raw)
        except (json.JSONDecodeError, RecursionError):
            pass  # a .json file holding JSON lines
    if rows is None:
        try:
            rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise RemodelError(f"{path}: invalid JSON ({e})") from None
        except RecursionError:
            raise RemodelError(f"{path}: JSON nested too deeply") from None
    rows = [rows] if isinstance(rows, dict) else rows
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("text"), str) for r in rows):
        raise RemodelError(f"{path}: every JSON record needs a 'text' field holding a string")
    return [r["text"] for r in rows if r["text"]]


def _from_disk(path: Path, split_valid: bool):
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # corrupt or foreign folder
        raise RemodelError(f"{path}: cannot load saved dataset ({type(e).__name__}: {e})".splitlines()[0]) from None
    if isinstance(ds, datasets.DatasetDict):
        if not ds:
            raise RemodelError(f"{path}: saved DatasetDict has no splits")
        name = "train" if "train" in ds else next(iter(ds))
        valid = next((s for s in VALID_SPLITS if s in ds and s != name), None)
        if split_valid and valid:
            return _text_only(ds[name], f"{path}[{name}]"), _text_only(ds[valid], f"{path}[{valid}]")
        ds = ds[name]
    return _text_only(ds, str(path))


def _text_only(ds: datasets.Dataset, where: str) -> datasets.Dataset:
    if "text" not in ds.column_names:
        raise RemodelError(f"{where}: no 'text' column (columns: {', '.join(ds.column_names) or 'none'})")
    if getattr(ds.features["text"], "dtype", None) not in ("string", "large_string"):
        raise RemodelError(f"{where}: the 'text' column holds {ds.features['text']}, not strings")
    if len(ds) == 0:
        raise RemodelError(f"{where}: no documents")
    return ds.select_columns(["text"])


def _load(path: Path, split_valid: bool, doc_split: str = "line"):
    """Returns a Dataset, or a (train, valid) pair when a saved DatasetDict has a validation split."""
    if not path.exists():
        raise RemodelError(f"data not found: {path}")
    if not path.is_dir() and not path.is_file():  # a FIFO or device: reading it could block forever
        raise RemodelError(f"{path}: not a regular file or folder")
    name = path.name.lower()
    if path.is_dir():
        if any((path / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            return _from_disk(path, split_valid)
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(TEXT_SUFFIXES))
        if not files:
            raise RemodelError(f"{path}: folder has no .txt/.txt.gz files and is not a saved dataset")
        texts = [t for p in files for t in _read_lines(p, doc_split)]
    elif name.endswith(TEXT_SUFFIXES):
        texts = _read_lines(path, doc_split)
    elif name.endswith(JSON_SUFFIXES):
        texts = _read_json(path)
    elif name.endswith(".parquet"):
        import pyarrow.parquet as pq
        try:
            columns = pq.read_schema(path).names
        except Exception as e:
            raise RemodelError(f"{path}: not a readable parquet file ({type(e).__name__})") from None
        if "text" not in columns:
            raise RemodelError(f"{path}: no 'text' column (columns: {', '.join(columns) or 'none'})")
        return _text_only(datasets.Dataset(pq.read_table(path, columns=["text"])), str(path))
    else:
        raise RemodelError(f"unsupported data file {path}: expected .txt, .txt.gz, .jsonl, .json, .parquet, "
                           "or a folder (text files or datasets.save_to_disk)")
    if not texts:
        raise RemodelError(f"{path}: no text (empty data)")
    if not all(isinstance(t, str) for t in texts):
        raise RemodelError(f"{path}: 'text' values must be strings")
    return datasets.Dataset.from_dict({"text": texts})


def load_texts(path, split_valid: bool = False, doc_split: str = "line"):
    """Dataset with a `text` column from a local DATA path (see module doc); nothing is downloaded.

    split_valid=True returns (train, valid): a saved DatasetDict's validation/valid/test split when
    there is one, otherwise every 20th document (deterministic) is held out as valid.
    """
    if doc_split not in DOC_SPLITS:
        raise RemodelError(f"doc_split must be one of {', '.join(DOC_SPLITS)}, got {doc_split!r}")
    out = _load(Path(path).expanduser(), split_valid, doc_split)
    if not split_valid or isinstance(out, tuple):
        return out
    n = len(out)
    if n < 2:
        raise RemodelError(f"{path}: need at least 2 documents to hold out a validation split")
    valid_idx = list(range(VALID_EVERY - 1, n, VALID_EVERY)) or [n - 1]
    held = set(valid_idx)
    return out.select([i for i in range(n) if i not in held]), out.select(valid_idx)


def pack(dataset: datasets.Dataset, tokenizer, seq_len: int, max_tokens: int | None = None,
         eos: bool = True) -> torch.Tensor:
    """LongTensor [num_sequences, seq_len]: documents tokenized (no special tokens added), each
    followed by eos when eos=True, concatenated, cut into full blocks (the remainder is dropped).
    With max_tokens, tokenization stops once that many tokens are collected and the stream is
    truncated to max_tokens before cutting."""
    if seq_len < 1:
        raise RemodelError(f"seq_len must be positive, got {seq_len}")
    eos_id = tokenizer.eos_token_id
    if eos and eos_id is None:
        raise RemodelError("the tokenizer has no eos token; pack with eos=False")
    tail = [eos_id] if eos else []

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"ids": [x + tail for x in ids]}

    def run(ds, tag):
        out = ds.map(tokenize, batched=True, remove_columns=ds.column_names, keep_in_memory=True,
                     new_fingerprint=f"remodel-pack-{tag}")
        return pc.list_flatten(out.data.column("ids")).to_numpy()

    if max_tokens is None:
        parts = [run(dataset, "all")]
    else:
        parts, total, chunk = [], 0, 256
        was_on = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()
        try:
            for start in range(0, len(dataset), chunk):
                parts.append(run(dataset.select(range(start, min(start + chunk, len(dataset)))), start))
                total += len(parts[-1])
                if total >= max_tokens:
                    break
        finally:
            if was_on:
                datasets.enable_progress_bars()
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if max_tokens is not None:
        flat = flat[:max_tokens]
    n = len(flat) // seq_len
    if n == 0:
        raise RemodelError(f"data gives only {len(flat)} tokens, fewer than one sequence of {seq_len}")
    return torch.from_numpy(flat[: n * seq_len].astype(np.int64)).view(n, seq_len)


def batches(blocks: torch.Tensor, batch_size: int, shuffle_seed: int | None = None, start: int = 0,
            epochs: int | None = 1, drop_last: bool = False):
    """Yield [B, L] batches of `blocks`. Epoch e uses the permutation of torch.Generator seeded with
    shuffle_seed + e (sequential order when shuffle_seed is None). `start` skips that many batches
    (counted across epochs) without materializing them, so resuming at step k yields exactly the
    tail of the full iteration. epochs=None repeats forever."""
    n = len(blocks)
    per_epoch = (n // batch_size if drop_last else math.ceil(n / batch_size)) if batch_size > 0 else 0
    if per_epoch == 0:
        raise RemodelError(f"cannot make batches of {batch_size} from {n} sequences")
    epoch, skip = divmod(start, per_epoch)
    while epochs is None or epoch < epochs:
        if shuffle_seed is None:
            order = torch.arange(n)
        else:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(shuffle_seed + epoch))
        for b in range(skip, per_epoch):
            yield blocks[order[b * batch_size:(b + 1) * batch_size]]
        epoch, skip = epoch + 1, 0
