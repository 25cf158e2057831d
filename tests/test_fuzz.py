"""Fuzzing the untrusted inputs (issue 25; the slow set): malformed safetensors headers, configs, token sets,
blend strings and numeric options, FUZZ_EXAMPLES (1,000) generated inputs per kind, derandomized so a
failure reproduces. The contract for each: the command succeeds (the input was valid after all), or it
exits 2 with exactly one line `remodel CMD: error: ...`, no traceback, and nothing new on disk; below the
CLI, only a one-line RemodelError is raised."""
import contextlib
import io
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remodel import cli
from remodel.models.errors import RemodelError

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "data" / "embedded"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "1000"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70)
                    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)


def listing(d) -> set:
    return {str(p.relative_to(d)) for p in Path(d).rglob("*")}


def contract(argv, where: Path):
    """Run the CLI in-process: rc 0, or rc 2 with one error line and nothing new under `where`."""
    before = listing(where)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = cli.main([str(a) for a in argv])
        except SystemExit as e:  # argparse
            rc = e.code
    text = err.getvalue()
    assert "Traceback" not in text, text
    if rc == 0:
        return 0
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"remodel {argv[0]}: error: "), (rc, text)
    assert listing(where) == before, text
    return rc


def one_line(fn, *a):
    """fn(*a), or a RemodelError whose message is one line (anything else fails the example)."""
    try:
        return fn(*a)
    except RemodelError as e:
        assert "\n" not in str(e), str(e)
        return None


# ---- safetensors headers -----------------------------------------------------------------------------

def _valid_header():
    h = {"__metadata__": {"format": "pt"}}
    off = 0
    for i, shape in enumerate([[4, 3], [2], [3, 2, 2], [0]]):
        n = int(np.prod(shape)) * 4
        h[f"backbone.layers.{i}.w"] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + n]}
        off += n
    return h, off


MUTATION = st.one_of(
    st.tuples(st.just("field"), st.integers(0, 4), st.sampled_from(["dtype", "shape", "data_offsets", "x"]), JSON),
    st.tuples(st.just("drop"), st.integers(0, 4), st.sampled_from(["dtype", "shape", "data_offsets"]), st.none()),
    st.tuples(st.just("entry"), st.integers(0, 4), st.text(max_size=8), JSON),
    st.tuples(st.just("whole"), st.none(), st.none(), JSON),
    st.tuples(st.just("length"), st.none(), st.none(), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("data"), st.none(), st.none(), st.integers(-64, 64)),
    st.tuples(st.just("bytes"), st.none(), st.none(), st.binary(max_size=64)),
)


def _mutated_file(mutations) -> bytes:
    h, n_data = _valid_header()
    keys = [k for k in h if k != "__metadata__"]
    length, data = None, n_data
    for kind, i, field, value in mutations:
        entry = h.get(keys[(i or 0) % len(keys)]) if isinstance(h, dict) else None
        if kind == "field" and isinstance(entry, dict):
            entry[field] = value
        elif kind == "drop" and isinstance(entry, dict):
            entry.pop(field, None)
        elif kind == "entry" and isinstance(h, dict):
            h[field] = value
        elif kind == "whole":
            h = value
        elif kind == "length":
            length = value
        elif kind == "data":
            data = max(0, n_data + value)
        elif kind == "bytes":
            return struct.pack("<Q", len(value)) + value
    raw = json.dumps(h).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + b"\0" * data


@pytest.fixture(scope="module")
def header_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hdr")
    (d / "model").mkdir()
    shutil.copy(EMBEDDED / "config.json", d / "model" / "config.json")
    return d


@FUZZ
@given(st.lists(MUTATION, min_size=1, max_size=3))
def test_fuzz_safetensors_headers(header_dir, mutations):
    from remodel.models.checkpoint import read_header
    f = header_dir / "model" / "model.safetensors"
    f.write_bytes(_mutated_file(mutations))
    one_line(read_header, f)
    contract(["convert", header_dir / "model", header_dir / "out"], header_dir)


# ---- configs -----------------------------------------------------------------------------------------

CONFIG = json.loads((EMBEDDED / "config.json").read_text())
CONFIG_EDIT = st.lists(st.tuples(st.sampled_from(sorted(CONFIG) + ["num_nextn_predict_layers", "n_routed_experts"]),
                                 st.one_of(JSON, st.integers(-3, 70000), st.just(None))), min_size=1, max_size=3)


@FUZZ
@given(CONFIG_EDIT)
def test_fuzz_configs(tmp_path_factory, edits):
    d = tmp_path_factory.mktemp("cfg", numbered=True)
    cfg = dict(CONFIG)
    for k, v in edits:
        cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    contract(["inspect", d / "config.json"], d)
    shutil.rmtree(d)


# ---- token sets ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def token_set(tmp_path_factory):
    from remodel.pipelines.data.tokens import tokenize
    d = tmp_path_factory.mktemp("tok")
    (d / "text.txt").write_text("\n".join(f"document {i} says hello to the fuzzer" for i in range(40)))
    tokenize(d / "text.txt", d / "set", str(ROOT / "data" / "tokenizer"))
    return d / "set"


def _read_batches(path, vocab: int):
    from remodel.pipelines.data.sampler import sequences
    from remodel.pipelines.data.tokens import open_tokens
    data = open_tokens(str(path))
    if data.vocab_size > vocab:
        raise RemodelError("vocab")
    for i, b in zip(range(2), sequences(data, 8, 2, seed=0)):
        assert int(b.max()) < vocab  # an id beyond the vocabulary never reaches the model
    return data


TOKEN_EDIT = st.one_of(
    st.tuples(st.just("meta"), st.sampled_from(["format", "version", "dtype", "n_tokens", "n_docs", "vocab_size",
                                                "eos", "eos_id", "max_id", "fingerprint", "extra"]),
              st.one_of(JSON, st.integers(-2, 2**40))),
    st.tuples(st.just("drop"), st.sampled_from(["n_tokens", "dtype", "vocab_size", "n_docs"]), st.none()),
    st.tuples(st.sampled_from(["tokens.bin", "docs.idx"]), st.integers(0, 4096), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("truncate"), st.sampled_from(["tokens.bin", "docs.idx"]), st.integers(0, 400)),
)


@FUZZ
@given(st.lists(TOKEN_EDIT, min_size=1, max_size=3))
def test_fuzz_token_sets(token_set, tmp_path_factory, edits):
    d = tmp_path_factory.mktemp("ts", numbered=True) / "set"
    shutil.copytree(token_set, d)
    meta = json.loads((d / "meta.json").read_text())
    vocab = meta["vocab_size"]
    for kind, key, value in edits:
        if kind == "meta":
            meta[key] = value
        elif kind == "drop":
            meta.pop(key, None)
        elif kind == "truncate":
            with open(d / key, "r+b") as f:
                f.truncate(value)
        else:
            with open(d / kind, "r+b") as f:
                f.seek(key)
                f.write(value)
    (d / "meta.json").write_text(json.dumps(meta))
    one_line(_read_batches, d, vocab)
    shutil.rmtree(d.parent)


# ---- blend strings -------------------------------------------------------------------------------------

WORD = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers(-5, 5).map(str),
                 st.sampled_from(["SET", "SET/", "MISSING", "FILE", "0.5", "nan", "-1", "1e400", "", " "]),
                 st.text(max_size=6))


@FUZZ
@given(st.lists(WORD, min_size=0, max_size=6))
def test_fuzz_blend_strings(token_set, tmp_path_factory, words):
    from remodel.pipelines.data.tokens import open_tokens, parse_blend
    d = token_set.parent
    (d / "FILE").write_text("not a token set")
    spec = " ".join(str(d / "missing") if w == "MISSING" else str(d / "FILE") if w == "FILE"
                    else str(token_set) + w[3:] if w.startswith("SET") else w for w in words)
    before = listing(d)
    parts = one_line(parse_blend, spec)
    if parts is not None:
        assert all(np.isfinite(w) and w > 0 for w, _ in parts)
        one_line(open_tokens, spec)
    assert listing(d) == before


# ---- numeric options -----------------------------------------------------------------------------------

NUMBER = st.one_of(st.floats().map(repr), st.integers(-2**70, 2**70).map(str),
                   st.sampled_from(["0", "-0", "1e400", "-1e400", "nan", "inf", "47B", "1e30B", "2M", "-3k", "0x10",
                                    "1_000", "", " ", "1e-400", "4.5e9"]),
                   st.text(max_size=6))
PLAN_FLAGS = ["--params", "--active-params", "--memory-gb", "--tol", "--top", "--batch", "--seq-len"]
TRAIN_FLAGS = ["--steps", "--tokens", "--seq-len", "--batch", "--grad-accum", "--lr", "--min-lr", "--warmup",
               "--weight-decay", "--grad-clip", "--lb-coeff", "--z-coeff", "--checkpoint-every", "--keep-last",
               "--seed", "--num-proc", "--eval-tokens", "--tp", "--ep", "--log-every"]


@FUZZ
@given(st.sampled_from(PLAN_FLAGS), NUMBER)
def test_fuzz_plan_options(tmp_path_factory, flag, value):
    d = tmp_path_factory.mktemp("plan", numbered=True)
    argv = ["plan", EMBEDDED / "config.json", "--params", "2M", "--top", "3", "--json"]
    contract(argv + [f"{flag}={value}"], d)
    shutil.rmtree(d)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(TRAIN_FLAGS), NUMBER), min_size=1, max_size=3))
def test_fuzz_train_options(tmp_path_factory, flags):
    """Valid options then meet a missing DATA: still one line, before any heavy work."""
    d = tmp_path_factory.mktemp("train", numbered=True)
    argv = ["train", EMBEDDED, d / "out", "--data", d / "missing", "--steps", "1"]
    assert contract(argv + [f"{f}={v}" for f, v in flags], d) == 2
    shutil.rmtree(d)
