import gzip
import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from remodel.models.errors import RemodelError
from remodel.pipelines.data.data import batches, embedded_corpus, embedded_tokenizer_path, load_texts, pack

DOCS = ["In the beginning God created the heaven and the earth.",
        "And the earth was without form, and void.",
        "  Leading spaces, ünïcödé and a tab\tstay.",
        "Jesus wept."]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(embedded_tokenizer_path())


def _one_line_error(fn, *args, match):
    with pytest.raises(RemodelError, match=match) as e:
        fn(*args)
    assert "\n" not in str(e.value)


def test_every_format_gives_the_same_texts(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0] + "\n\n" + DOCS[1] + "\n")
    with gzip.open(tmp_path / "a.txt.gz", "wt") as f:
        f.write("\n".join(DOCS[:2]) + "\n")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "1.txt").write_text(DOCS[0] + "\n")
    with gzip.open(folder / "2.txt.gz", "wt") as f:
        f.write(DOCS[1] + "\n")
    (folder / "ignored.md").write_text("not data\n")
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS[:2])))
    (tmp_path / "a.json").write_text(json.dumps([{"text": t} for t in DOCS[:2]]))
    pq.write_table(pa.table({"id": [0, 1], "text": DOCS[:2]}), tmp_path / "a.parquet")
    datasets.Dataset.from_dict({"text": DOCS[:2], "n": [1, 2]}).save_to_disk(tmp_path / "ds")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:2]}),
                          "validation": datasets.Dataset.from_dict({"text": DOCS[2:]})}).save_to_disk(tmp_path / "dd")
    for name in ["a.txt", "a.txt.gz", "folder", "a.jsonl", "a.json", "a.parquet", "ds", "dd"]:
        ds = load_texts(tmp_path / name)
        assert ds.column_names == ["text"], name
        assert list(ds["text"]) == DOCS[:2], name
    train, valid = load_texts(tmp_path / "dd", split_valid=True)
    assert list(train["text"]) == DOCS[:2] and list(valid["text"]) == DOCS[2:]


def test_split_valid_holds_out_every_20th(tmp_path):
    (tmp_path / "t.txt").write_text("".join(f"doc {i}\n" for i in range(45)))
    train, valid = load_texts(tmp_path / "t.txt", split_valid=True)
    assert list(valid["text"]) == ["doc 19", "doc 39"]
    assert len(train) == 43 and "doc 19" not in list(train["text"])


def test_errors_are_one_line(tmp_path):
    _one_line_error(load_texts, tmp_path / "missing.txt", match="not found")
    (tmp_path / "empty.txt").write_text("\n  \n")
    _one_line_error(load_texts, tmp_path / "empty.txt", match="empty")
    (tmp_path / "bad.jsonl").write_text('{"content": "x"}\n')
    _one_line_error(load_texts, tmp_path / "bad.jsonl", match="'text' field")
    (tmp_path / "a.csv").write_text("text\nx\n")
    _one_line_error(load_texts, tmp_path / "a.csv", match="unsupported")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    _one_line_error(load_texts, tmp_path / "b.parquet", match="no 'text' column")


def test_pack_exact_ids(tok):
    ds = datasets.Dataset.from_dict({"text": DOCS})
    eos = tok.eos_token_id
    stream = [i for t in DOCS for i in tok.encode(t, add_special_tokens=False) + [eos]]
    out = pack(ds, tok, seq_len=8)
    n = len(stream) // 8
    assert out.dtype == torch.long and out.shape == (n, 8)
    assert out.flatten().tolist() == stream[:n * 8]
    no_eos = pack(ds, tok, seq_len=8, eos=False).flatten().tolist()
    assert eos not in no_eos
    assert pack(ds, tok, seq_len=4, max_tokens=13).flatten().tolist() == stream[:12]
    _one_line_error(pack, ds, tok, 10_000, match="fewer than one sequence")


def test_pack_max_tokens_stops_early(tok):
    calls = []
    ds = datasets.Dataset.from_dict({"text": [DOCS[0]] * 2000})
    real = tok.__call__

    class Counting:
        eos_token_id = tok.eos_token_id

        def __call__(self, texts, **kw):
            calls.append(len(texts))
            return real(texts, **kw)

    out = pack(ds, Counting(), seq_len=16, max_tokens=64)
    assert out.shape == (4, 16)
    assert sum(calls) < 2000  # the whole corpus was not tokenized


def test_batches_deterministic_and_resumable():
    blocks = torch.arange(10 * 3).view(10, 3)
    full = list(batches(blocks, 3, shuffle_seed=1, epochs=2))
    assert len(full) == 8 and full[3].shape == (1, 3)  # 4 batches per epoch, last one partial
    again = list(batches(blocks, 3, shuffle_seed=1, epochs=2))
    assert all(torch.equal(a, b) for a, b in zip(full, again))
    other = list(batches(blocks, 3, shuffle_seed=2, epochs=2))
    assert not all(torch.equal(a, b) for a, b in zip(full, other))
    assert sorted(torch.cat(full[:4])[:, 0].tolist()) == list(range(0, 30, 3))  # an epoch covers every block
    assert not all(torch.equal(a, b) for a, b in zip(full[:4], full[4:]))  # reshuffled each epoch
    for k in (0, 1, 4, 6, 8):
        tail = list(batches(blocks, 3, shuffle_seed=1, start=k, epochs=2))
        assert len(tail) == 8 - k and all(torch.equal(a, b) for a, b in zip(full[k:], tail))
    seq = list(batches(blocks, 4, drop_last=True))
    assert [b[:, 0].tolist() for b in seq] == [[0, 3, 6, 9], [12, 15, 18, 21]]


def test_embedded_tokenizer_and_corpus(tok):
    train, valid = embedded_corpus()
    assert train.exists() and valid.exists()
    assert len(tok) == 2048 and tok.convert_ids_to_tokens(tok.eos_token_id) == "<|endoftext|>"
    assert tok.pad_token_id == tok.eos_token_id == tok.bos_token_id
    with gzip.open(valid, "rt") as f:
        sample = f.readline().rstrip("\n")
    for s in [sample[:500], *DOCS, "  two  spaces\nnew line, 日本語 🙂 x<y", ""]:
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    assert len(tok.encode(sample)) < len(sample) / 3  # the BPE actually compresses English
