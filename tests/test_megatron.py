"""Megatron-Core indexed datasets (issue 27, Deliver 2), against megatron-core's own reader and writer:
`tokenize --format megatron` writes the bytes IndexedDatasetBuilder writes (uint16 and int32), megatron-core
reads them back document for document, a dataset megatron-core wrote trains (and distills) with the same
batches and losses as our token set of the same documents, blends with token sets, and a hostile .idx
or .bin ends in one line before a token is read."""
import json
import shutil
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from remodel import cli
from remodel.models.errors import RemodelError
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path
from remodel.pipelines.data.megatron import HEADER, MegatronSet, write_megatron
from remodel.pipelines.data.sampler import SequenceSampler
from remodel.pipelines.data.tokens import Blend, TokenSet, open_set, tokenize
from tests.cli_contract import fails, listing

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core warns that Apex / Transformer Engine are absent
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "data" / "embedded"
CORPUS = embedded_corpus()[1]
DTYPES = [np.uint16, np.int32]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Our token set of the corpus, the same documents written by megatron-core in both dtypes, and ours."""
    d = tmp_path_factory.mktemp("megatron")
    tokenize(CORPUS, d / "ts", str(embedded_tokenizer_path()))
    ts = TokenSet(d / "ts")
    for dt in DTYPES:
        b = IndexedDatasetBuilder(str(d / f"ref_{dt.__name__}.bin"), dtype=dt)
        for i in range(ts.n_docs):
            doc = ts.document(i)
            b.add_document(torch.from_numpy(doc.astype(np.int64)), [len(doc)])
        b.finalize(str(d / f"ref_{dt.__name__}.idx"))
    assert cli.main(["tokenize", str(CORPUS), str(d / "ours"), "--tokenizer", str(embedded_tokenizer_path()),
                     "--format", "megatron"]) == 0
    return d


@pytest.mark.parametrize("dt", DTYPES, ids=lambda t: t.__name__)
def test_ours_is_byte_identical_to_megatron_cores_builder(work, tmp_path, dt):
    ours = tmp_path / "x"
    write_megatron(TokenSet(work / "ts"), ours, dtype=dt)
    for ext in ("bin", "idx"):
        assert (work / f"ref_{dt.__name__}.{ext}").read_bytes() == Path(f"{ours}.{ext}").read_bytes(), ext
    if dt is np.uint16:  # what the CLI wrote (a uint16 vocabulary) is the same bytes
        for ext in ("bin", "idx"):
            assert (work / "ours" / f"data.{ext}").read_bytes() == Path(f"{ours}.{ext}").read_bytes()


def test_megatron_core_reads_ours_document_for_document(work):
    ts, ds = TokenSet(work / "ts"), IndexedDataset(str(work / "ours" / "data"))
    assert len(ds) == ts.n_docs and list(ds.document_indices) == list(range(ts.n_docs + 1))
    assert ds.sequence_lengths.sum() == ts.n_tokens
    for i in range(ts.n_docs):
        assert np.array_equal(ds[i], ts.document(i)), i
    rep = json.loads((work / "ours" / "remodel_report.json").read_text())
    assert rep["format"] == "megatron" and rep["n_tokens"] == ts.n_tokens and rep["dtype"] == "uint16"
    assert not list(work.glob(".ours*"))  # the work token set is gone


@pytest.mark.parametrize("dt", DTYPES, ids=lambda t: t.__name__)
def test_a_megatron_core_dataset_reads_as_our_token_set(work, dt):
    ts, ms = TokenSet(work / "ts"), MegatronSet(work / f"ref_{dt.__name__}.idx")  # PREFIX.idx names it too
    assert (ms.n_tokens, ms.n_docs, ms.dtype) == (ts.n_tokens, ts.n_docs, np.dtype(dt))
    assert np.array_equal(ms.read(0, ms.n_tokens), ts.read(0, ts.n_tokens))
    assert all(np.array_equal(ms.document(i), ts.document(i)) for i in (0, 7, ts.n_docs - 1))
    a = SequenceSampler(ts, 32, 4, seed=3)
    b = SequenceSampler(ms, 32, 4, seed=3)
    for k in (0, 1, 17, 300):  # past the first epoch too
        assert torch.equal(a.batch(k), b.batch(k)), k
    ms.check_vocab(2048)
    with pytest.raises(RemodelError, match="outside the model's vocabulary"):
        ms.check_vocab(100)


def test_blend_of_a_megatron_dataset_and_a_token_set(work):
    ts = TokenSet(work / "ts")
    blend = Blend([(0.7, MegatronSet(work / "ref_int32")), (0.3, work / "ts")])
    assert isinstance(blend.sets[0], MegatronSet) and blend.sets[1].n_tokens == ts.n_tokens
    s = SequenceSampler(blend, 32, 8, seed=0)
    rows = s.indices(0) + s.indices(1)
    assert {d for d, _ in rows} == {0, 1} and sum(d == 0 for d, _ in rows) in range(10, 13)  # 0.7 of 16
    assert isinstance(open_set(work / "ours"), MegatronSet)  # the folder tokenize wrote names its pair


def _train(work, out, data, *extra):
    return cli.main(["train", str(EMBEDDED), str(out), "--data", str(data), "--steps", "2", "--seq-len", "32",
                     "--batch", "2", "--log-every", "0", "--lr", "1e-3", *extra])


def test_training_on_megatron_core_data_equals_our_token_set(work, tmp_path):
    """Same documents, same batches: the losses of two steps are equal, to the bit."""
    assert _train(work, tmp_path / "a", work / "ts") == 0
    assert _train(work, tmp_path / "b", work / "ref_int32") == 0
    ha = json.loads((tmp_path / "a" / "remodel_report.json").read_text())["history"]
    hb = json.loads((tmp_path / "b" / "remodel_report.json").read_text())["history"]
    assert [r["loss"] for r in ha] == [r["loss"] for r in hb] and len(ha) == 2
    blend = f"0.7 {work / 'ref_uint16'} 0.3 {work / 'ts'}"
    assert cli.main(["distill", "--teacher", str(EMBEDDED), "--student", str(EMBEDDED), str(tmp_path / "c"),
                     "--data", blend, "--steps", "1", "--seq-len", "32", "--batch", "2", "--log-every", "0"]) == 0
    rep = json.loads((tmp_path / "c" / "remodel_report.json").read_text())
    # the student is its own teacher here: the distillation loss of the blended batches is ~0
    assert len(rep["args"]["data_fingerprint"]) == 2 and 0 <= rep["history"][-1]["loss"] < 1e-4


# ---- hostile input ---------------------------------------------------------------------------------

def _corrupt(src: Path, dst: Path, how: str):
    shutil.copy(f"{src}.bin", f"{dst}.bin")
    idx = bytearray(Path(f"{src}.idx").read_bytes())
    S = struct.unpack_from("<Q", idx, 18)[0]
    at_sizes, at_ptr, at_doc = HEADER.size, HEADER.size + 4 * S, HEADER.size + 12 * S
    if how == "magic":
        idx[0:4] = b"PK\x03\x04"
    elif how == "version":
        struct.pack_into("<Q", idx, 9, 2)
    elif how == "dtype":
        idx[17] = 6  # float64
    elif how == "truncated":
        idx = idx[:-5]
    elif how == "trailing":
        idx += b"\0" * 3
    elif how == "count":
        struct.pack_into("<Q", idx, 18, 1 << 62)
    elif how == "negative_size":
        struct.pack_into("<i", idx, at_sizes + 4, -3)
    elif how == "pointer":
        struct.pack_into("<q", idx, at_ptr + 8 * 2, 10 ** 12)
    elif how == "doc_index":
        struct.pack_into("<q", idx, at_doc + 8, S + 5)
    elif how == "multimodal":
        idx += b"\0" * S
    elif how == "bin_short":
        Path(f"{dst}.bin").write_bytes(Path(f"{src}.bin").read_bytes()[:-2])
    Path(f"{dst}.idx").write_bytes(bytes(idx))


HOSTILE = ["magic", "version", "dtype", "truncated", "trailing", "count", "negative_size", "pointer", "doc_index",
           "multimodal", "bin_short"]


@pytest.mark.parametrize("how", HOSTILE)
def test_a_hostile_index_fails_in_one_line(work, tmp_path, how, capsys):
    bad = tmp_path / "bad"
    _corrupt(work / "ref_int32", bad, how)
    with pytest.raises(RemodelError) as e:
        MegatronSet(bad)
    assert "\n" not in str(e.value) and str(bad) in str(e.value)
    before = listing(tmp_path)
    fails(capsys, "train", EMBEDDED, tmp_path / "o", "--data", bad, "--steps", "1", "--seq-len", "32", "--batch", "2")
    assert listing(tmp_path) == before


def test_ids_outside_the_vocabulary_are_refused(work, tmp_path, capsys):
    """int32 Megatron data can hold negative ids, any data ids past the model's vocabulary (2048)."""
    for name, value in (("neg", -7), ("big", 5000)):
        shutil.copy(work / "ref_int32.idx", tmp_path / f"{name}.idx")
        tokens = np.fromfile(work / "ref_int32.bin", np.int32)
        tokens[1234] = value
        tokens.tofile(tmp_path / f"{name}.bin")
        ms = MegatronSet(tmp_path / name)
        with pytest.raises(RemodelError, match=str(value)):
            ms.check_vocab(2048)
        s = SequenceSampler(ms, 32, 2, seed=None, vocab_size=2048)
        with pytest.raises(RemodelError, match=f"token id {value} at token 1234"):
            s.batch(1234 // 64)
        fails(capsys, "train", EMBEDDED, tmp_path / "o", "--data", tmp_path / name, "--steps", "1", "--seq-len", "32",
              "--batch", "2", match=str(value))
        assert not (tmp_path / "o").exists()


def test_bad_tokenize_format_input_writes_nothing(work, tmp_path, capsys):
    before = listing(tmp_path)
    fails(capsys, "tokenize", tmp_path / "missing.txt", tmp_path / "o", "--tokenizer", embedded_tokenizer_path(),
          "--format", "megatron", match="not found")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    fails(capsys, "tokenize", CORPUS, tmp_path / "full", "--tokenizer", embedded_tokenizer_path(), "--format",
          "megatron", match="--overwrite")
    assert listing(tmp_path) == before | {"full", "full/x"}
