"""Fuzzing the untrusted inputs (issues 25 and 39; the slow set): malformed safetensors headers, configs, token
sets, blend strings, numeric options, Megatron indexes and run state (meta.json, dcp_metadata.json),
FUZZ_EXAMPLES (default 40; set 1000 for a deep run) generated inputs per kind, fewer for the costly kinds,
derandomized so a failure reproduces. The contract for each: the command succeeds (the input was valid after
all), or it exits 2 with exactly one line `remodel CMD: error: ...`, no traceback, and nothing new on disk;
below the CLI, only a one-line RemodelError is raised. Where an oracle can tell (headers, train options,
Megatron indexes, run state), a valid input must be accepted and an invalid one refused, not merely end
without a traceback; Megatron and run-state examples are bounded in time (a hang fails)."""
import contextlib
import io
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from remodel import cli
from remodel.models.errors import RemodelError

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "data" / "embedded"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70)
                    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)


def listing(d) -> set:
    return {str(p.relative_to(d)) for p in Path(d).rglob("*")}


def contract(argv, where: Path, errors: list | None = None):
    """Run the CLI in-process: rc 0, or rc 2 with one error line and nothing new under `where`; the
    stderr text is appended to `errors` when given."""
    before = listing(where)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = cli.main([str(a) for a in argv])
        except SystemExit as e:  # argparse
            rc = e.code
    text = err.getvalue()
    if errors is not None:
        errors.append(text)
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
    st.tuples(st.just("shift"), st.integers(0, 4), st.none(), st.integers(-16, 16)),  # a span moved whole
    st.tuples(st.just("swap"), st.integers(0, 4), st.none(), st.integers(0, 4)),  # two entries' spans swapped
    st.tuples(st.just("meta"), st.none(), st.none(), JSON),  # __metadata__ replaced
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
        elif kind == "shift" and isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list):
            entry["data_offsets"] = [x + value if type(x) is int else x for x in entry["data_offsets"]]
        elif kind == "swap" and isinstance(entry, dict) and isinstance(h.get(keys[value % len(keys)]), dict):
            other = h[keys[value % len(keys)]]
            entry["data_offsets"], other["data_offsets"] = other.get("data_offsets"), entry.get("data_offsets")
        elif kind == "meta" and isinstance(h, dict):
            h["__metadata__"] = value
    raw = json.dumps(h).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + b"\0" * data


@pytest.fixture(scope="module")
def header_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hdr")
    (d / "model").mkdir()
    shutil.copy(EMBEDDED / "config.json", d / "model" / "config.json")
    return d


ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8, "F16": 2,
            "BF16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1}  # the safetensors format's dtypes


def _nat(x) -> bool:
    return type(x) is int and 0 <= x < 2**63


def header_valid(raw: bytes) -> bool:
    """The oracle, written from the safetensors format alone: an 8-byte little-endian length N that the file
    holds; N bytes of strict JSON (UTF-8, unique keys) making an object; __metadata__ (if any) a string
    map; every other entry {dtype known, shape of naturals, data_offsets [begin, end] of naturals with
    end - begin = prod(shape) x itemsize}; the spans, in order, contiguous from 0 to the end of the file."""
    if len(raw) < 8:
        return False
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        return False

    def unique(pairs):
        if len({k for k, _ in pairs}) != len(pairs):
            raise ValueError("duplicate")
        return dict(pairs)

    try:
        h = json.loads(raw[8:8 + n].decode("utf-8"), object_pairs_hook=unique,
                       parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except (ValueError, RecursionError):
        return False
    if not isinstance(h, dict):
        return False
    meta = h.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        return False
    spans = []
    for e in h.values():
        if not isinstance(e, dict) or not isinstance(e.get("dtype"), str) or e["dtype"] not in ITEMSIZE or not isinstance(e.get("shape"), list) \
                or not isinstance(e.get("data_offsets"), list) or len(e["data_offsets"]) != 2 \
                or not all(_nat(x) for x in e["shape"] + e["data_offsets"]):
            return False
        (b, end), size = e["data_offsets"], int(np.prod(e["shape"], dtype=object)) * ITEMSIZE[e["dtype"]]
        if end - b != size:
            return False
        spans.append((b, end))
    pos = 0
    for b, end in sorted(spans):
        if b != pos:
            return False
        pos = end
    return pos == len(raw) - 8 - n


@FUZZ
@given(st.lists(MUTATION, min_size=1, max_size=3))
@example([("field", 0, "x", 1)]).via("an unknown field is ignored")
@example([("meta", None, None, {"a": "b"})]).via("string metadata")
@example([("swap", 0, None, 0)]).via("a no-op swap")
@example([("shift", 0, None, 4)]).via("the first span overlaps the second")
@example([("swap", 0, None, 2)]).via("spans swapped: sizes no longer match")
def test_fuzz_safetensors_headers(header_dir, mutations):
    """read_header accepts exactly the files the format allows (header_valid) and refuses the rest in one
    line; through `convert` still one line (the tensor names are not the model's) and nothing written."""
    from remodel.models.checkpoint import read_header
    f = header_dir / "model" / "model.safetensors"
    raw = _mutated_file(mutations)
    f.write_bytes(raw)
    valid = header_valid(raw)
    got = one_line(read_header, f)
    assert (got is not None) == valid, ("accepted" if got is not None else "refused", mutations)
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
PLAN_FLAGS = ["--params", "--active-params", "--memory-gb", "--train-memory-gb", "--tol", "--top", "--batch", "--seq-len",
              "--train-batch", "--tp", "--ep", "--dp"]
TRAIN_FLAGS = ["--steps", "--tokens", "--seq-len", "--batch", "--grad-accum", "--lr", "--min-lr", "--warmup",
               "--weight-decay", "--grad-clip", "--lb-coeff", "--z-coeff", "--checkpoint-every", "--keep-last",
               "--seed", "--num-proc", "--eval-tokens", "--tp", "--ep", "--log-every"]


PLAN_RULES = {"--params": ("count", 1, 10**18), "--active-params": ("count", 1, 10**18),
              "--memory-gb": ("open", 0, 1e9), "--train-memory-gb": ("open", 0, 1e9), "--tol": ("open_hi", 0, 1),
              "--top": (int, 1, 10**4), "--batch": (int, 1, 2**20), "--seq-len": (int, 1, 2**24),
              "--train-batch": (int, 1, 2**20), "--tp": (int, 1, 1024), "--ep": (int, 1, 1024),
              "--dp": (int, 1, 2**20)}  # from `remodel plan --help`


@FUZZ
@given(st.sampled_from(PLAN_FLAGS), NUMBER)
@example("--tol", "1").via("--tol is a shortfall below 1")
def test_fuzz_plan_options(tmp_path_factory, flag, value):
    """An option outside its rule (PLAN_RULES, the oracle) is refused in one line naming it; one inside may
    still find no candidate, in one line."""
    d = tmp_path_factory.mktemp("plan", numbered=True)
    argv = ["plan", EMBEDDED / "config.json", "--params", "2M", "--top", "3", "--json"]
    err = []
    rc = contract(argv + [f"{flag}={value}"], d, err)
    if option_value(flag, value, PLAN_RULES) is None:
        assert rc == 2 and flag in err[0], (flag, value, err)
    shutil.rmtree(d)


# The rules of `remodel train`'s numeric options, written out from their --help (the oracle): kind and range.
# A count (--tokens, --eval-tokens) takes a k/M/B/G/T suffix and is truncated to an integer.
INF = float("inf")
TRAIN_RULES = {"--steps": (int, 1, 10**12), "--tokens": ("count", 1, 10**18), "--seq-len": (int, 2, 2**24),
               "--batch": (int, 1, 2**20), "--grad-accum": (int, 1, 2**20), "--lr": ("open", 0, 10),
               "--min-lr": (float, 0, 10), "--warmup": (int, 0, 10**12), "--weight-decay": (float, 0, 10),
               "--grad-clip": (float, 0, INF), "--lb-coeff": (float, 0, 1e6), "--z-coeff": (float, 0, 1e6),
               "--checkpoint-every": (int, 1, 10**12), "--keep-last": (int, 0, 10**6), "--seed": (int, 0, 2**32 - 1),
               "--num-proc": (int, 1, 1024), "--eval-tokens": ("count", 1, 10**18), "--tp": (int, 1, 1024),
               "--ep": (int, 1, 1024), "--log-every": (int, 0, 10**12)}
assert sorted(TRAIN_RULES) == sorted(TRAIN_FLAGS)


def option_value(flag: str, text: str, rules=None):
    """The value `text` gives `flag` if its rule (TRAIN_RULES unless given) allows it, else None."""
    kind, lo, hi = (rules or TRAIN_RULES)[flag]
    try:
        if kind is int:
            v = int(text)
        elif kind == "count":
            t = text.strip().lower()
            scale = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}.get(t[-1:], 1)
            v = float(t[:-1] if scale > 1 else t) * scale
            v = int(v) if abs(v) <= 10**18 else v  # truncated; beyond the bound (or inf, nan) stays refused
        else:
            v = float(text)
    except (ValueError, OverflowError):
        return None
    if v != v or not (lo < v if kind == "open" else lo <= v) or not (v < hi if kind == "open_hi" else v <= hi) \
            or v == INF:
        return None
    return v


def train_expected(flags) -> tuple[bool | None, list]:
    """(accepted? None: either, the flags a refusal may name): each option's rule (the last occurrence counts, as argparse
    takes it), exactly one of --steps / --tokens, 0 <= --min-lr <= --lr (min-lr's default: lr / 10)."""
    given = dict(flags)
    vals = {f: option_value(f, t) for f, t in given.items()}
    bad = [f for f, v in vals.items() if v is None]
    if bad:
        return False, bad
    if ("--steps" in vals) == ("--tokens" in vals):
        return False, ["--steps", "--tokens"]
    lr = vals.get("--lr", 1e-4)
    if vals.get("--min-lr", lr / 10) > lr:
        return False, ["--min-lr", "--lr"]
    if "--tokens" in vals:  # a budget of more than 10^12 steps may be refused up front (issue 39, Deliver 2)
        per_step = vals.get("--batch", 8) * vals.get("--grad-accum", 1) * vals.get("--seq-len", 256)
        if -(-vals["--tokens"] // per_step) > 10**12:
            return None, ["--tokens"]
    return True, []


TRAIN_VALUE = st.one_of(NUMBER, st.integers(-1, 64).map(str), st.integers(1, 64).map(str), st.floats(-0.1, 2).map(repr))


@pytest.fixture(scope="module")
def train_data(tmp_path_factory):
    """Real tiny training data (a few lines of the embedded corpus): examples get past DATA to the option rules."""
    import gzip
    from remodel.pipelines.data.data import embedded_corpus
    d = tmp_path_factory.mktemp("train_data")
    with gzip.open(embedded_corpus()[0], "rt", encoding="utf-8") as f:
        (d / "train.txt").write_text("\n".join(f.read().splitlines()[:50]) + "\n")
    return d / "train.txt"


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(TRAIN_FLAGS), TRAIN_VALUE), min_size=1, max_size=3))
@example([("--grad-clip", "-1")]).via("a negative clip norm")
@example([("--grad-clip", "0")]).via("no clipping")
@example([("--min-lr", "0.5"), ("--lr", "0.1")]).via("min-lr above lr")
def test_fuzz_train_options(train_data, tmp_path_factory, monkeypatch, flags):
    """`remodel train` on a real model and real data, options fuzzed: accepted exactly when every option keeps
    its rule (train_expected), else one line naming an offending flag, nothing written. The trainer stops
    where it would load the models (trainer._run replaced): every option check has run by then."""
    from remodel.pipelines.training import trainer
    reached = []
    monkeypatch.setattr(trainer, "_run", lambda p: reached.append(p) or {})
    d = tmp_path_factory.mktemp("train", numbered=True)
    budget = [] if any(f in ("--steps", "--tokens") for f, _ in flags) else [("--steps", "1")]
    flags = budget + list(flags)
    err = []
    rc = contract(["train", EMBEDDED, d / "out", "--data", train_data] + [f"{f}={v}" for f, v in flags], d, err)
    ok, named = train_expected(flags)
    if ok is not None:
        assert (rc == 0) == ok and bool(reached) == ok, (flags, err)
    if rc != 0:
        assert any(f in err[0] for f in named or TRAIN_FLAGS), (named, err)
    shutil.rmtree(d)


# ---- bounded time ----------------------------------------------------------------------------------------

@contextlib.contextmanager
def bounded(seconds: float, what):
    """Fail the example (TimeoutError naming `what`) if it runs past `seconds`: a hang is a failure too."""
    import signal

    def over(signum, frame):
        raise TimeoutError(f"over {seconds} s: {what}")

    old = signal.signal(signal.SIGALRM, over)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# the costly kinds (a Megatron pair, a resume): fewer examples, and no shrinking (each try may run to its bound)
SMALL = settings(FUZZ, max_examples=min(EXAMPLES, 40), phases=[Phase.explicit, Phase.reuse, Phase.generate])
RESUMES = settings(SMALL, max_examples=min(EXAMPLES, 15))


# ---- Megatron indexes ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def megatron(token_set, tmp_path_factory):
    """A real Megatron pair (PREFIX.bin / PREFIX.idx) of the fuzz token set, as `tokenize --format megatron`."""
    from remodel.pipelines.data.megatron import write_megatron
    from remodel.pipelines.data.tokens import TokenSet
    d = tmp_path_factory.mktemp("megatron")
    write_megatron(TokenSet(token_set), d / "data")
    assert megatron_expected(d / "data") == TokenSet(token_set).n_tokens  # the oracle takes the real pair
    return d / "data"


IDX_FIELD = {"magic": (0, "9s"), "version": (9, "<Q"), "code": (17, "<B"), "S": (18, "<Q"), "D": (26, "<Q")}
MEGATRON_EDIT = st.one_of(
    st.tuples(st.just("field"), st.sampled_from(["version", "code", "S", "D"]),
              st.one_of(st.integers(0, 8), st.sampled_from([2**32, 2**36, 2**40, 2**63, 2**64 - 1]))),
    st.tuples(st.just("field"), st.just("magic"), st.binary(min_size=9, max_size=9)),
    st.tuples(st.just("fit"), st.sampled_from(["S", "D"]), st.sampled_from([0, 1, 2, 39, 41, 1000, 2**33, 2**36])),
    st.tuples(st.just("sparse"), st.none(), st.sampled_from([1, 2**20 + 1, 2**33, 2**36])),
    st.tuples(st.just("bytes"), st.integers(34, 2000), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("truncate"), st.sampled_from(["idx", "bin"]), st.integers(0, 2000)),
    st.tuples(st.just("grow"), st.sampled_from(["idx", "bin"]), st.integers(1, 16)),
)


def _edit_megatron(prefix: Path, edits):
    """Apply the edits to PREFIX.idx / .bin in place. "fit" sets S or D and resizes the .idx to what the
    header then declares (a sparse file when it is huge), so only the arrays can tell it is wrong."""
    idx = Path(f"{prefix}.idx")
    for kind, key, value in edits:
        if kind == "field":
            at, fmt = IDX_FIELD[key]
            with open(idx, "r+b") as f:
                f.seek(at)
                f.write(struct.pack(fmt, value) if fmt != "<B" else bytes([value % 256]))
        elif kind == "fit":
            head = idx.read_bytes()[:34].ljust(34, b"\0")
            _, _, _, S, D = struct.unpack("<9sQBQQ", head)
            S, D = (value, D) if key == "S" else (S, value)
            with open(idx, "r+b") as f:
                f.seek(18)
                f.write(struct.pack("<QQ", S, D))
                f.truncate(34 + 12 * S + 8 * D)
        elif kind == "bytes":
            with open(idx, "r+b") as f:
                f.seek(key)
                f.write(value)
        elif kind == "sparse":  # S empty sequences in one document: zeros (a hole) but the last index, S
            with open(idx, "wb") as f:
                f.write(struct.pack("<9sQBQQ", b"MMIDIDX\0\0", 1, 8, value, 2))
                f.truncate(34 + 12 * value + 8)
                f.seek(34 + 12 * value + 8)
                f.write(struct.pack("<q", value))
        else:
            path = Path(f"{prefix}.{key}")
            with open(path, "r+b") as f:
                f.truncate(value if kind == "truncate" else path.stat().st_size + value)


def megatron_expected(prefix: Path):
    """The oracle, from the format (see pipelines/data/megatron.py's doc): None when the .idx is too big to
    judge here (then only a bounded, one-line outcome is asked), else the number of tokens of a valid pair,
    or False."""
    idx, binp = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    if idx.stat().st_size > 1 << 20:  # only "fit" / "sparse" make one: its pointer array is all zeros (a hole),
        return False if binp.stat().st_size else None  # so every size must be 0: no tokens can be described
    raw = idx.read_bytes()
    if len(raw) < 34:
        return False
    magic, version, code, S, D = struct.unpack("<9sQBQQ", raw[:34])
    item = {8: 2, 4: 4}.get(code)
    if magic != b"MMIDIDX\0\0" or version != 1 or item is None or len(raw) != 34 + 12 * S + 8 * D or D < 1:
        return False
    sizes = np.frombuffer(raw, np.int32, S, 34).astype(np.int64)
    ptrs = np.frombuffer(raw, np.int64, S, 34 + 4 * S)
    docs = np.frombuffer(raw, np.int64, D, 34 + 12 * S)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])) * item if S else sizes
    if (sizes < 0).any() or not np.array_equal(ptrs, starts) or docs[0] != 0 or docs[-1] != S \
            or (np.diff(docs) < 0).any():
        return False
    n = int(sizes.sum())
    return n if binp.stat().st_size == n * item else False


@SMALL
@given(st.lists(MEGATRON_EDIT, min_size=1, max_size=3))
@example([("field", "version", 1)]).via("unchanged: loads")
@example([("grow", "idx", 4)]).via("trailing bytes")
@example([("bytes", 34 + 4 * 40 + 8, b"\1")]).via("a sequence pointer off by one")
@example([("fit", "S", 2**36)]).via("2^36 sequences: the arrays past the header are a hole")
@example([("sparse", None, 2**36)]).via("2^36 empty sequences, consistent but for the .bin: refused, not scanned")
def test_fuzz_megatron_indexes(megatron, tmp_path_factory, edits):
    """MegatronSet on a mutated .idx/.bin pair: a valid pair loads with the tokens the oracle counts (and its
    documents read back); anything else is one line; every example within 20 s (a huge sparse index too)."""
    from remodel.pipelines.data.megatron import MegatronSet
    d = tmp_path_factory.mktemp("mg", numbered=True)
    for ext in ("idx", "bin"):
        shutil.copy(f"{megatron}.{ext}", d / f"data.{ext}")
    _edit_megatron(d / "data", edits)
    want = megatron_expected(d / "data")
    with bounded(20, edits):
        got = one_line(MegatronSet, d / "data")
        if got is not None:
            docs = [got.document(i) for i in range(min(got.n_docs, 3))]
    if want is not None:
        assert (got is not None) == (want is not False), (want, edits)
    if got is not None:
        assert want is None or got.n_tokens == want
        assert all(len(x) >= 0 for x in docs)
    shutil.rmtree(d)


# ---- run state (meta.json, dcp_metadata.json) -----------------------------------------------------------

@pytest.fixture(scope="module")
def run_state(train_data, tmp_path_factory):
    """A real two-step run of a tiny MoE hybrid (OUT.run/step-000002 kept, with history rows, MoE figures and
    an eval), and the `remodel train --resume` command line that continues it (nothing left to train: it
    reads the run state, then writes OUT)."""
    from remodel.models.config import ModelConfig
    from remodel.models.model import HybridLM, init_weights
    from remodel.pipelines.training.train import train
    from tests.conftest import write_checkpoint
    d = tmp_path_factory.mktemp("run_state")
    cfg = ModelConfig(vocab_size=2048, hidden_size=16, pattern="M*-E", tie_word_embeddings=True, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, intermediate_size=32, mamba_num_heads=4, mamba_head_dim=8,
                      ssm_state_size=8, chunk_size=16, n_routed_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16)
    write_checkpoint(init_weights(HybridLM(cfg), seed=0), d / "student")
    argv = ["--data", train_data, "--steps", "2", "--seq-len", "16", "--batch", "2", "--log-every", "0",
            "--checkpoint-every", "1", "--keep-last", "1", "--eval-data", train_data, "--eval-tokens", "64"]
    train(d / "student", d / "out", train_data, steps=2, seq_len=16, batch=2, log_every=0, checkpoint_every=1,
          keep_last=1, eval_data=str(train_data), eval_tokens=64)
    shutil.copytree(d / "out.run", d / "check.run")  # the run unchanged resumes (else every refusal is moot)
    assert contract(["train", d / "student", d / "check"] + argv + ["--resume"], d) == 0
    assert (d / "check" / "model.safetensors").is_file()
    return d / "out.run", ["train", d / "student"], argv + ["--resume"]


def json_paths(node, at=()) -> list[tuple]:
    """Every position in a JSON document down to depth 8 (the root first), as key / index tuples."""
    out = [at]
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items if len(at) < 8 else ():
        out += json_paths(v, at + (k,))
    return out


def kind_of(v) -> str:
    return "null" if v is None else "bool" if isinstance(v, bool) else "number" if isinstance(v, (int, float)) \
        else type(v).__name__


DEEP = "[" * 600 + "]" * 600  # nested 600 deep
STATE_EDIT = st.tuples(st.sampled_from(["set", "set", "drop", "deep"]), st.integers(0, 10**6), JSON)


def _apply(doc, edits):
    """(edited document, [(path, old value, new value or "drop")]) of the edits, each at a position of the
    document as it stands (an index taken modulo the positions)."""
    done = []
    for kind, i, value in edits:
        paths = json_paths(doc)
        path = paths[i % len(paths)]
        new = json.loads(DEEP if kind == "deep" else json.dumps(value))  # a fresh copy, never shared
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        old = parent[path[-1]] if path else doc
        if not path:
            doc = new if kind != "drop" else {}
        elif kind == "drop":
            del parent[path[-1]]
        else:
            parent[path[-1]] = new
        done.append((path, old, "drop" if kind == "drop" else new))
    return doc, done


def meta_must_refuse(path, old, new) -> bool:
    """The oracle for meta.json: what no run could have written and a resume must refuse. Strict: the step
    (and its directory), the counts, and the shapes of history rows (their step above all), the MoE figures,
    the eval and the AdamW step counts; a JSON kind changed there (null on either side excepted) or a
    required key removed. Elsewhere (args, hf_config, moe_init) either outcome, in one line."""
    if not path:
        return True  # the whole document replaced: never a complete meta.json
    strict = path[0] in ("step", "consumed_batches", "history", "eval", "adam_steps")
    if new == "drop":
        return (len(path) == 1 and path[0] in ("step", "consumed_batches", "args", "history", "eval", "adam_steps")) \
            or (path[0] == "history" and len(path) == 3 and path[2] == "step")
    if path == ("step",) and new != old:
        return True
    if len(path) == 1 and path[0] == "args":
        return kind_of(new) != "dict"
    return strict and kind_of(old) != kind_of(new) and "null" not in (kind_of(old), kind_of(new))


def dcp_must_refuse(path, old, new) -> bool:
    """The oracle for dcp_metadata.json: its format, version and every tensor entry and chunk are required,
    with their JSON kinds (a number may change value: only the load can tell, and it may refuse it)."""
    if not path or new == "drop":
        return True
    if path[0] in ("format", "version"):
        return new != old
    return path[0] == "tensors" and kind_of(old) != kind_of(new)


def _resume(run_state, tmp_path_factory, name, edits, must_refuse, precheck):
    """Copy the run, apply the edits to its newest step's `name`, check it (`precheck`, cheap), resume from it
    when the check passes; the oracle decides which edits must be refused. Bounded to 60 s."""
    from remodel.pipelines.training import train_state as S
    run, head, tail = run_state
    d = tmp_path_factory.mktemp("rs", numbered=True)
    shutil.copytree(run, d / "out.run")
    step = S.list_checkpoints(d / "out.run")[-1]
    doc, done = _apply(json.loads((step / name).read_text()), edits)
    (step / name).write_text(json.dumps(doc))
    refuse = any(must_refuse(*x) for x in done)
    with bounded(60, done):
        ok = one_line(precheck, step) is not None
        rc = contract(head + [d / "out"] + tail, d) if ok else 2
    if refuse:
        assert rc == 2, ("accepted", done)
    if rc == 0:
        assert (d / "out" / "model.safetensors").is_file()
    shutil.rmtree(d)


@RESUMES
@given(st.lists(STATE_EDIT, min_size=1, max_size=2))
@example([("set", 0, 0)]).via("the step's own value (index 0 is the root: replaced)")
def test_fuzz_run_state_meta(run_state, tmp_path_factory, edits):
    """`train --resume` on a run whose meta.json was mutated: a correct resume, or one line (refused by
    read_meta or later), never a traceback; what no run could write (meta_must_refuse) is refused."""
    from remodel.pipelines.training.train_state import read_meta
    _resume(run_state, tmp_path_factory, "meta.json", edits, meta_must_refuse, read_meta)


@RESUMES
@given(st.lists(STATE_EDIT, min_size=1, max_size=2))
def test_fuzz_run_state_dcp_index(run_state, tmp_path_factory, edits):
    """The same for dcp_metadata.json (read_metadata first, then the resume that loads through it)."""
    from remodel.pipelines.training.dcp_storage import read_metadata
    _resume(run_state, tmp_path_factory, "dcp_metadata.json", edits, dcp_must_refuse, read_metadata)
