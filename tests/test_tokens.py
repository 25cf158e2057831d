"""Token sets on disk (pipelines/data/tokens.py): content equal to pack(), dtype by vocabulary, exact resume,
DP rows, weighted blends, document splitting, flat resident memory, bad input, the CLI."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from remodel import cli
from remodel.models.errors import RemodelError
from remodel.pipelines.data import sampler as S
from remodel.pipelines.data import tokens as T
from remodel.pipelines.data.data import batches, embedded_corpus, embedded_tokenizer_path, load_texts, pack
from tests.rss import PEAK_RSS

ROOT = Path(__file__).resolve().parents[1]
TRAIN, VALID = embedded_corpus()


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(embedded_tokenizer_path())


@pytest.fixture(scope="module")
def shipped(tmp_path_factory, tok):
    """The shipped training corpus tokenized with 2 processes."""
    out = tmp_path_factory.mktemp("tok") / "train"
    meta = T.tokenize(TRAIN, out, tok, num_proc=2)
    return out, meta


def fake_set(path, n_tokens, seed=0, low=0, high=2048, dtype=np.uint16):
    """A token set of random tokens in [low, high) written directly (no tokenizer), in 1M-token chunks."""
    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    with open(path / "tokens.bin", "wb") as f:
        for start in range(0, n_tokens, 1 << 20):
            rng.integers(low, high, min(1 << 20, n_tokens - start), dtype=np.int64).astype(dtype).tofile(f)
    np.array([0, n_tokens], np.int64).tofile(path / "docs.idx")
    meta = {"format": T.FORMAT, "version": T.VERSION, "dtype": np.dtype(dtype).name, "n_tokens": n_tokens,
            "n_docs": 1, "vocab_size": high, "eos": False, "eos_id": None, "doc_split": "file",
            "tokenizer": {"name": "fake", "hash": "fake"}, "source": {}, "fingerprint": f"fake{seed}"}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


class BigVocab:
    """Duck-typed tokenizer with a 70000-entry vocabulary: ids above 65535 need uint32."""
    eos_token_id, name_or_path, backend_tokenizer = 69999, "big", None

    def __len__(self):
        return 70000

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[65536 + len(t), 1, 69998] for t in texts]}


def test_shipped_corpus_equals_pack(shipped, tok):
    out, meta = shipped
    ts = T.TokenSet(out)
    assert (meta["dtype"], ts.dtype, ts.vocab_size) == ("uint16", np.uint16, 2048)
    assert meta["n_docs"] == ts.n_docs == len(load_texts(TRAIN)) == 1130
    blocks = pack(load_texts(TRAIN), tok, 128)
    n = ts.num_sequences(128)
    assert n == len(blocks)
    assert torch.equal(torch.from_numpy(ts.tokens[:n * 128].astype(np.int64)).view(n, 128), blocks)
    first = tok(load_texts(TRAIN)[0]["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ts.document(0).tolist() == first
    idx = np.fromfile(out / "docs.idx", np.int64)
    assert len(idx) == 1131 and idx[0] == 0 and idx[-1] == ts.n_tokens == meta["n_tokens"]
    assert (out / "tokens.bin").stat().st_size == 2 * ts.n_tokens


def test_sampler_matches_todays_batches(shipped, tok):
    ts = T.TokenSet(shipped[0])
    blocks = pack(load_texts(TRAIN), tok, 512)
    ref = batches(blocks, 16, shuffle_seed=5, epochs=None, drop_last=True)
    per_epoch = len(blocks) // 16
    got = S.SequenceSampler(ts, 512, 16, seed=5)
    for b in range(per_epoch * 2 + 3):  # crosses two epoch boundaries
        assert torch.equal(got.batch(b), next(ref)), b


def test_uint32_for_large_vocab(tmp_path):
    (tmp_path / "a.txt").write_text("one\ntwo words\n")
    meta = T.tokenize(tmp_path / "a.txt", tmp_path / "out", BigVocab())
    ts = T.TokenSet(tmp_path / "out")
    assert meta["dtype"] == "uint32" and ts.dtype == np.uint32
    assert ts.tokens.tolist() == [65539, 1, 69998, 69999, 65545, 1, 69998, 69999]


@pytest.fixture(scope="module")
def two_sets(tmp_path_factory):
    d = tmp_path_factory.mktemp("sets")
    return fake_set(d / "a", 40_000, seed=1, low=0, high=1000), fake_set(d / "b", 25_000, seed=2, low=1000, high=2048)


def _blend(two_sets, spec="0.7 {a} 0.3 {b}"):
    return T.open_tokens(spec.format(a=two_sets[0], b=two_sets[1]))


@pytest.mark.parametrize("kind", ["single", "blend"])
def test_resume_and_dp_rows(two_sets, kind):
    data = T.TokenSet(two_sets[0]) if kind == "single" else _blend(two_sets)
    full = list(S.sequences(data, 64, 8, seed=3, stop=150, prefetch=0))  # 40000 // 64 // 8 = 78 per epoch
    with S.sequences(data, 64, 8, seed=3, start=97, stop=150, prefetch=3) as it:
        resumed = list(it)
    assert len(resumed) == 53 and all(torch.equal(a, b) for a, b in zip(resumed, full[97:]))
    for dp in (2, 4):
        ranks = [list(S.sequences(data, 64, 8, seed=3, start=70, stop=90, dp_rank=r, dp_size=dp, prefetch=0))
                 for r in range(dp)]
        for b in range(20):
            assert torch.equal(torch.cat([ranks[r][b] for r in range(dp)]), full[70 + b])
    other = list(S.sequences(data, 64, 8, seed=4, stop=5, prefetch=0))
    assert not torch.equal(torch.stack(other), torch.stack(full[:5]))


def test_blend_fractions(two_sets):
    B, steps = 32, 200
    s = S.SequenceSampler(_blend(two_sets), 64, B, seed=0)
    from_a = []
    for b in range(steps):
        rows = s.indices(b)
        from_a.append(sum(k == 0 for k, _ in rows))
        x = s.batch(b)
        assert ((x < 1000).all(dim=1) == torch.tensor([k == 0 for k, _ in rows])).all()  # rows come from their set
    assert all(abs(n - 0.7 * B) <= 1 for n in from_a)
    assert abs(sum(from_a) / (B * steps) - 0.7) < 1e-3
    n_a = 40_000 // 64
    firsts = [i for b in range(steps) for k, i in s.indices(b) if k == 0][:n_a]
    assert sorted(firsts) == list(range(n_a))  # set a's own shuffled epoch: every sequence once
    again = S.SequenceSampler(_blend(two_sets), 64, B, seed=0)
    assert all(torch.equal(again.batch(b), s.batch(b)) for b in (0, 17, 199))
    quarter = S.SequenceSampler(_blend(two_sets, "1 {a} 3 {b}"), 64, B, seed=0)
    share = np.mean([k == 0 for b in range(50) for k, _ in quarter.indices(b)])
    assert abs(share - 0.25) < 1e-3


def test_doc_split_keeps_newlines(tmp_path, tok):
    text = "def f():\n    return 1\n\n\nIn the beginning\nGod created.\n  \nAmen.\n"
    (tmp_path / "a.txt").write_text(text)
    assert load_texts(tmp_path / "a.txt")["text"] == ["def f():", "    return 1", "In the beginning",
                                                      "God created.", "Amen."]
    paras = ["def f():\n    return 1", "In the beginning\nGod created.", "Amen."]
    assert load_texts(tmp_path / "a.txt", doc_split="paragraph")["text"] == paras
    assert load_texts(tmp_path / "a.txt", doc_split="file")["text"] == [text]
    T.tokenize(tmp_path / "a.txt", tmp_path / "p", tok, doc_split="paragraph")
    ts = T.TokenSet(tmp_path / "p")
    assert ts.n_docs == 3 and ts.meta["doc_split"] == "paragraph"
    assert [tok.decode(ts.document(i)[:-1]) for i in range(3)] == paras
    with pytest.raises(RemodelError, match="doc_split"):
        load_texts(tmp_path / "a.txt", doc_split="sentence")


RSS_SCRIPT = PEAK_RSS + textwrap.dedent('''
    import sys, json
    from remodel.pipelines.data.sampler import sequences
    from remodel.pipelines.data.tokens import TokenSet
    with sequences(TokenSet(sys.argv[1]), 256, 16, seed=0, prefetch=2) as it:
        next(it)
        base = reset_peak()
        for _ in range(400):
            next(it)
    print(json.dumps({"base": base, "peak": status("VmHWM")}))
''')


def test_rss_flat_with_10x_corpus(tmp_path):
    """400 batches of 16 x 256 from 2M and from 20M random tokens: whole-process peak RSS within 5%."""
    small, big = fake_set(tmp_path / "small", 2_000_000), fake_set(tmp_path / "big", 20_000_000, seed=1)
    (tmp_path / "rss.py").write_text(RSS_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = [json.loads(subprocess.run([sys.executable, str(tmp_path / "rss.py"), str(p)], env=env, check=True,
                                     capture_output=True, text=True, cwd=ROOT).stdout) for p in (small, big)]
    growth = [r["peak"] - r["base"] for r in run]
    assert run[1]["peak"] <= 1.05 * run[0]["peak"], run
    assert growth[1] < 8 << 20, growth  # the 40 MB map of the big set is never resident as a whole


def test_bad_input_writes_nothing(tmp_path, tok):
    with pytest.raises(RemodelError, match="data not found"):
        T.tokenize(tmp_path / "missing.txt", tmp_path / "out", tok)
    assert not (tmp_path / "out").exists()
    (tmp_path / "a.txt").write_text("some words\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    with pytest.raises(RemodelError, match="not empty"):
        T.tokenize(tmp_path / "a.txt", tmp_path / "out", tok)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep"]
    for kw, match in (({"num_proc": 0}, "num_proc"), ({"doc_split": "x"}, "doc_split")):
        with pytest.raises(RemodelError, match=match):
            T.tokenize(tmp_path / "a.txt", tmp_path / "o2", tok, **kw)
    (tmp_path / "blank.txt").write_text("\n\n")
    with pytest.raises(RemodelError, match="empty"):
        T.tokenize(tmp_path / "blank.txt", tmp_path / "o2", tok)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "blank.txt", "out"]
    with pytest.raises(RemodelError, match="not a token set"):
        T.TokenSet(tmp_path / "out")
    bad = fake_set(tmp_path / "trunc", 1000)
    with open(bad / "tokens.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(RemodelError, match="truncated"):
        T.TokenSet(bad)
    for spec, match in (("0.5 a 0.5", "WEIGHT PATH"), ("x a y b", "not a weight"), ("-1 a 1 b", "positive")):
        with pytest.raises(RemodelError, match=match):
            T.parse_blend(spec)
    good = fake_set(tmp_path / "good", 10_000)
    with pytest.raises(RemodelError, match="divisible"):
        S.SequenceSampler(T.TokenSet(good), 16, 6, dp_size=4)
    with pytest.raises(RemodelError, match="fewer than one batch"):
        S.SequenceSampler(T.TokenSet(good), 5000, 4)


def test_prefetch_stops_and_reports_errors(two_sets):
    it = S.sequences(str(two_sets[0]), 64, 8, prefetch=2)
    next(it)
    it.close()
    assert not it._thread.is_alive()

    class Broken(S.SequenceSampler):
        def batch(self, b):
            if b == 2:
                raise RemodelError("disk gone")
            return super().batch(b)

    with S.Prefetch(Broken(T.TokenSet(two_sets[0]), 64, 8), depth=2) as it:
        next(it), next(it)
        with pytest.raises(RemodelError, match="disk gone"):
            next(it)


def test_ensure_tokens_caches(tmp_path, monkeypatch, tok):
    monkeypatch.setenv("REMODEL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "c.txt"
    src.write_text("alpha beta\ngamma\n")
    first = T.ensure_tokens(src, embedded_tokenizer_path())
    assert first.parent == tmp_path / "cache" / "tokens" and T.TokenSet(first).n_docs == 2
    stamp = (first / "meta.json").stat().st_mtime_ns
    assert T.ensure_tokens(src, tok) == first and (first / "meta.json").stat().st_mtime_ns == stamp
    assert T.ensure_tokens(first, tok) == first  # a token set is used as it is
    assert T.ensure_tokens(src, tok, doc_split="file") != first
    src.write_text("alpha beta\ngamma\ndelta\n")
    os.utime(src, ns=(stamp + 10**9, stamp + 10**9))
    changed = T.ensure_tokens(src, tok)
    assert changed != first and T.TokenSet(changed).n_docs == 3
    with pytest.raises(RemodelError, match="another tokenizer"):
        T.ensure_tokens(first, BigVocab())


def test_cli_tokenize(tmp_path, capsys):
    out = tmp_path / "valid"
    argv = ["tokenize", str(VALID), str(out), "--tokenizer", str(embedded_tokenizer_path()), "--num-proc", "1",
            "--doc-split", "file"]
    assert cli.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    ts = T.TokenSet(out)
    assert printed["n_tokens"] == ts.n_tokens > 0 and printed["n_docs"] == ts.n_docs == 1
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("remodel tokenize: error:") and "not empty" in err and "\n" not in err
    assert cli.main(argv + ["--overwrite", "--no-eos", "--doc-split", "line"]) == 0
    ts2 = T.TokenSet(out)
    assert ts2.meta["eos"] is False and ts2.n_docs > 1 and ts2.n_tokens < ts.n_tokens
