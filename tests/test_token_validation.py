"""Untrusted token sets and blends (issue 25): meta.json strictly checked, files of the wrong kind refused
without blocking, token ids checked against the model's vocabulary, bad blend specs refused; through the
CLI every case is one line on stderr, exit 2, nothing written. Also: `tokenize --num-proc` workers die
with a SIGKILLed parent."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from remodel.models.errors import RemodelError
from remodel.pipelines.data import sampler as S
from remodel.pipelines.data import tokens as T
from tests.cli_contract import fails, listing

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "data" / "embedded"  # vocab_size 2048, the tokenizer of data/tokenizer
TOKENIZER = ROOT / "data" / "tokenizer"


@pytest.fixture(scope="module")
def tok_hash():
    return T.tokenizer_hash(AutoTokenizer.from_pretrained(EMBEDDED))  # the tokenizer train/distill load


def make_set(path, ids, vocab=2048, np_dtype=np.uint16, tok_hash="fake", **meta_changes):
    """A token set of `ids` (one document) written directly; meta_changes override meta.json keys
    (value None for a key removes it)."""
    path.mkdir(parents=True)
    ids = np.asarray(ids, dtype=np.int64)
    ids.astype(np_dtype).tofile(path / "tokens.bin")
    np.array([0, len(ids)], np.int64).tofile(path / "docs.idx")
    meta = {"format": T.FORMAT, "version": T.VERSION, "dtype": np.dtype(np_dtype).name, "n_tokens": len(ids),
            "n_docs": 1, "vocab_size": vocab, "eos": False, "eos_id": None, "doc_split": "file",
            "tokenizer": {"name": "fake", "hash": tok_hash}, "source": {}, "fingerprint": "fake"}
    meta.update(meta_changes)
    (path / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if v is not None or k == "eos_id"}))
    return path


def _ids(n=4096, high=2048, seed=0):
    return np.random.default_rng(seed).integers(0, high, n)


# -- meta.json and the files beside it ----------------------------------------------------------------

META_CASES = {  # name -> (change to make_set's meta, part of the error)
    "format": ({"format": "other"}, "not a token set"),
    "version": ({"version": 99}, "version 99"),
    "dtype": ({"dtype": "float32"}, "dtype must be one of uint16, uint32"),
    "dtype-type": ({"dtype": 16}, "'dtype' must be str"),
    "n_tokens-str": ({"n_tokens": "4096"}, "'n_tokens' must be int"),
    "n_tokens-bool": ({"n_docs": True}, "'n_docs' must be int"),
    "n_tokens-float": ({"n_tokens": 4096.0}, "'n_tokens' must be int"),
    "n_docs-negative": ({"n_docs": -1}, "n_docs is -1"),
    "vocab-zero": ({"vocab_size": 0}, "vocab_size is 0"),
    "vocab-dtype": ({"vocab_size": 70000}, "for dtype uint16"),
    "eos_id": ({"eos_id": 5000}, "eos_id 5000 is outside the vocabulary"),
    "max_id": ({"max_id": 2048}, "max_id 2048 is outside the vocabulary"),
    "missing": ({"fingerprint": None}, "lacks 'fingerprint'"),
    "tokenizer": ({"tokenizer": {"name": "x"}}, "'hash'"),
    "doc_split": ({"doc_split": "word"}, "doc_split must be one of"),
    "n_tokens-size": ({"n_tokens": 5000}, "tokens.bin holds 8192 bytes, meta.json says 10000"),
}


@pytest.mark.parametrize("case", sorted(META_CASES))
def test_meta_json_is_validated(tmp_path, case):
    change, match = META_CASES[case]
    path = make_set(tmp_path / "s", _ids(), **change)
    with pytest.raises(RemodelError, match=match.replace("(", r"\(")):
        T.TokenSet(path)


@pytest.mark.parametrize("content, match", [("[1, 2]", "must hold a JSON object"), ("{not json", "meta.json: invalid JSON"),
                                            ("[" * 100_000 + "]" * 100_000, "meta.json: JSON nested too deeply"),
                                            ('{"format": "remodel-tokens"' + " " * (1 << 20) + "}", "more than")])
def test_meta_json_content_and_size(tmp_path, content, match):
    path = make_set(tmp_path / "s", _ids())
    (path / "meta.json").write_text(content)
    with pytest.raises(RemodelError, match=match):
        T.TokenSet(path)


def _idx(path, offsets):
    np.array(offsets, np.int64).tofile(path / "docs.idx")


@pytest.mark.parametrize("offsets, match", [([0], "docs.idx holds 8 bytes"), ([0, 10, 4096, 0], "holds 32 bytes"),
                                            ([0, 4000], "ends at token 4000"), ([5, 4096], "start at 0"),
                                            ([0, 4097], "ends at token 4097")])
def test_docs_idx_is_validated(tmp_path, offsets, match):
    path = make_set(tmp_path / "s", _ids())
    _idx(path, offsets)
    with pytest.raises(RemodelError, match=match):
        T.TokenSet(path)
    path = make_set(tmp_path / "t", _ids(), n_docs=3)
    _idx(path, [0, 3000, 2000, 4096])  # right size and ends, but not monotone
    with pytest.raises(RemodelError, match="never decrease"):
        T.TokenSet(path)


@pytest.mark.parametrize("name", ["meta.json", "tokens.bin", "docs.idx"])
def test_fifo_refused_without_blocking(tmp_path, name):
    path = make_set(tmp_path / "s", _ids())
    (path / name).unlink()
    os.mkfifo(path / name)
    t0 = time.time()
    with pytest.raises(RemodelError, match="not a regular file"):
        T.TokenSet(path)  # would block forever in open() of a FIFO nobody writes
    assert time.time() - t0 < 5


def test_deleted_or_truncated_tokens(tmp_path):
    path = make_set(tmp_path / "s", _ids())
    (path / "tokens.bin").unlink()
    with pytest.raises(RemodelError, match="tokens.bin: missing"):
        T.TokenSet(path)
    path = make_set(tmp_path / "t", _ids())
    os.truncate(path / "tokens.bin", 1000)
    with pytest.raises(RemodelError, match="truncated"):
        T.TokenSet(path)
    ts = T.TokenSet(make_set(tmp_path / "u", _ids()))
    os.truncate(ts.path / "tokens.bin", 1000)  # shrinks under an open set
    with pytest.raises(RemodelError, match="ended early"):
        ts.read(1000, 100)


# -- token ids against the vocabulary -----------------------------------------------------------------

def test_ids_checked_against_the_model_vocabulary(tmp_path):
    big = T.TokenSet(make_set(tmp_path / "big", _ids(high=4096), vocab=4096))
    with pytest.raises(RemodelError, match="beyond the model's vocabulary"):
        big.check_vocab(2048)
    lying = T.TokenSet(make_set(tmp_path / "lying", np.r_[_ids(), 3000]))  # meta says 2048, an id is 3000
    with pytest.raises(RemodelError, match="token id 3000, outside the vocabulary"):
        lying.check_vocab(2048)
    wrong_max = T.TokenSet(make_set(tmp_path / "wm", np.r_[_ids(high=100), 1500], max_id=99))
    with pytest.raises(RemodelError, match="above meta.json's max_id 99"):
        wrong_max.check_vocab(2048)
    recorded = T.TokenSet(make_set(tmp_path / "rec", _ids(high=100), max_id=1999))
    recorded.check_vocab(2048, scan_limit=0)  # too big to scan: the recorded max_id is trusted
    T.TokenSet(make_set(tmp_path / "ok", _ids())).check_vocab(2048)


def test_sampler_refuses_ids_outside_the_vocabulary(tmp_path):
    ids = _ids(high=1000)
    ids[64 * 5 + 7] = 2047  # sequence 5 of 64 tokens
    ts = T.TokenSet(make_set(tmp_path / "s", ids))
    ts.check_vocab(2048)
    assert len(list(S.sequences(ts, 64, 4, seed=None, stop=4, prefetch=0, vocab_size=2048))) == 4
    with pytest.raises(RemodelError, match="token id 2047 at token 327 is outside the vocabulary \\(1024\\)"):
        list(S.sequences(ts, 64, 4, seed=None, stop=4, prefetch=0, vocab_size=1024))
    ids[3] = 3000  # past the set's own vocabulary: refused even without a model's
    ts = T.TokenSet(make_set(tmp_path / "t", ids))
    with S.sequences(ts, 64, 4, seed=None, stop=4, prefetch=2) as it, pytest.raises(RemodelError, match="3000"):
        next(it)


def test_tokenize_records_max_id(tmp_path):
    (tmp_path / "a.txt").write_text("one\ntwo words\n")
    meta = T.tokenize(tmp_path / "a.txt", tmp_path / "out", AutoTokenizer.from_pretrained(TOKENIZER))
    ts = T.TokenSet(tmp_path / "out")
    assert meta["max_id"] == ts.meta["max_id"] == ts.max_id() == int(ts.tokens.max())


# -- blends -------------------------------------------------------------------------------------------

def test_blend_specs(tmp_path):
    a, b = make_set(tmp_path / "a", _ids()), make_set(tmp_path / "b", _ids(seed=1))
    for spec, match in ((f"nan {a} 1 {b}", "positive and finite"), (f"inf {a} 1 {b}", "positive and finite"),
                        (f"0 {a} 1 {b}", "positive and finite"), (f"1 {a} 1 {tmp_path / 'gone'}", "data not found"),
                        (" ".join(f"1 {a}" for _ in range(T.MAX_BLEND + 1)), "more than the 128 allowed"),
                        ("", "WEIGHT PATH")):
        with pytest.raises(RemodelError, match=match):
            T.parse_blend(spec)
    blend = T.open_tokens(f"1e308 {a} 1e308 {b}")  # huge weights: no overflow to inf / nan
    assert np.allclose(blend.weights, [0.5, 0.5])


# -- the CLI: one line, exit 2, nothing written --------------------------------------------------------

@pytest.mark.parametrize("cmd", ["train", "distill"])
def test_cli_bad_token_sets(tmp_path, capsys, tok_hash, cmd):
    sets = {"vocab": make_set(tmp_path / "vocab", _ids(high=4096), vocab=4096, tok_hash=tok_hash),
            "ids": make_set(tmp_path / "ids", np.r_[_ids(), 3000], tok_hash=tok_hash),
            "meta": make_set(tmp_path / "meta", _ids(), tok_hash=tok_hash, n_tokens=-5),
            "short": make_set(tmp_path / "short", _ids(), tok_hash=tok_hash)}
    os.truncate(sets["short"] / "tokens.bin", 100)
    cases = [(str(sets["vocab"]), "beyond the model's vocabulary (2048)"), (str(sets["ids"]), "token id 3000"),
             (str(sets["meta"]), "n_tokens is -5"), (str(sets["short"]), "truncated"),
             (f"nan {sets['ids']} 1 {sets['vocab']}", "positive and finite"),
             (f"1 {sets['ids']} 1 {tmp_path / 'gone'}", "data not found")]
    model = ["--teacher", EMBEDDED, "--student", EMBEDDED, "--lm-loss-weight", "1"] if cmd == "distill" else [EMBEDDED]
    before = listing(tmp_path)
    for data, match in cases:
        fails(capsys, cmd, *model, tmp_path / "out", "--data", data, "--steps", "1", "--seq-len", "16", "--batch",
              "2", match=match)
        assert listing(tmp_path) == before, data


def test_cli_fifo_data_refused(tmp_path, capsys):
    os.mkfifo(tmp_path / "data.txt")
    before = listing(tmp_path)
    fails(capsys, "tokenize", tmp_path / "data.txt", tmp_path / "out", "--tokenizer", TOKENIZER,
          match="not a regular file")
    assert listing(tmp_path) == before


# -- tokenize workers die with their parent -------------------------------------------------------------

def _alive(pids) -> list[int]:
    import psutil
    out = []
    for pid, created in pids:
        try:
            q = psutil.Process(pid)
            if q.create_time() == created and q.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_tokenize_workers_die_with_a_killed_parent(tmp_path):
    """SIGKILL of `remodel tokenize` while its workers are stopped mid-batch: the workers are gone within 5 s.
    Stopped, they cannot exit on their own (a closed pipe, the fallback watch thread), so only the armed
    PR_SET_PDEATHSIG ends them; without the stop the pool's EOF would end them anyway and prove nothing."""
    import psutil
    words = np.array("in the beginning god created heaven and earth which was without form and void".split())
    rng = np.random.default_rng(0)
    with open(tmp_path / "big.txt", "w") as f:
        for _ in range(40):
            f.write("\n".join(" ".join(r) for r in words[rng.integers(0, len(words), (5000, 30))]) + "\n")
    p = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "tokenize", str(tmp_path / "big.txt"),
                          str(tmp_path / "out"), "--tokenizer", str(TOKENIZER), "--num-proc", "2"],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kids = []
    try:
        t0 = time.time()
        while p.poll() is None and time.time() - t0 < 120:
            kids = [(c.pid, c.create_time()) for c in psutil.Process(p.pid).children(recursive=True)]
            if len(kids) >= 2:
                break
            time.sleep(0.05)
        assert p.poll() is None and len(kids) >= 2, "tokenize ended before its workers started"
        time.sleep(0.5)  # the workers are at work on their first batches
        kids = sorted(set(kids) | {(c.pid, c.create_time()) for c in psutil.Process(p.pid).children(recursive=True)})
        assert len(kids) >= 2  # the two tokenizing workers (the streaming tokenize starts no Manager)
        for pid, _ in kids:  # stopped, a worker cannot notice its closed pipes and exit by itself: only the
            os.kill(pid, signal.SIGSTOP)  # kernel's parent-death SIGKILL (which ends a stopped process) can end it
        p.send_signal(signal.SIGKILL)  # no handler of the parent runs
        p.wait()
        t0 = time.time()
        while _alive(kids) and time.time() - t0 < 5:
            time.sleep(0.05)
        assert not _alive(kids), f"workers outlived their killed parent: {_alive(kids)}"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for pid in _alive(kids):  # only the processes this test started
            os.kill(pid, signal.SIGKILL)
