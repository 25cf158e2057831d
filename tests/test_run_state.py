"""Cost bounded before work and run state parsed by schema (issue 39, Deliver 2 and 3): a sparse Megatron
index, a DCP index of many chunks, --seq-len 1 and absurd --tokens end fast in one line; tampered meta.json
rows, RNG bytes, AdamW moments, deep JSON and a meta.json naming another folder as the student end as
one-line errors (exit 2) with nothing written, or as a correct result."""
import json
import os
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from remodel import cli
from remodel.models.errors import RemodelError
from remodel.pipelines.data.megatron import HEADER, MAGIC, MegatronSet
from remodel.pipelines.training.dcp_storage import _disjoint
from tests.cli_contract import fails, listing

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "data" / "embedded"
CORPUS = ROOT / "data" / "corpus" / "train.txt.gz"
TRAIN = ["--data", CORPUS, "--steps", "2", "--seq-len", "32", "--batch", "2", "--log-every", "0"]


# ---- Deliver 2: cost bounded before work ------------------------------------------------------------------

def _sparse_megatron(prefix: Path, S: int, D: int, bin_bytes: int):
    """A uint16 .idx declaring S sequences and D document indices, all zeros past the header (a sparse
    file of the size the header needs), beside a sparse .bin of bin_bytes."""
    with open(f"{prefix}.idx", "wb") as f:
        f.write(HEADER.pack(MAGIC, 1, 8, S, D))
        f.truncate(HEADER.size + 12 * S + 8 * D)
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(bin_bytes)


@pytest.mark.parametrize("S,bin_bytes,match", [
    (1 << 36, 200, "more sequences than tokens"),          # 824 GB of index for 100 tokens
    (1 << 28, 2 << 28, "first and last sequence pointers"),  # a sparse .bin big enough: the ends disagree
])
def test_a_sparse_megatron_index_is_refused_before_the_scan(tmp_path, capsys, S, bin_bytes, match):
    prefix = tmp_path / "data"
    _sparse_megatron(prefix, S, 2, bin_bytes)
    t = time.perf_counter()
    with pytest.raises(RemodelError, match=match):
        MegatronSet(prefix)
    assert time.perf_counter() - t < 2.0
    before = listing(tmp_path)
    fails(capsys, "train", EMBEDDED, tmp_path / "o", "--data", prefix, "--steps", "1", "--seq-len", "32",
          match=match)
    assert listing(tmp_path) == before


def test_chunk_disjointness_is_n_log_n_and_still_refuses_overlap():
    """200k chunks (a 400 x 500 grid of one-element boxes) checked in seconds (all pairs: 4e10 tests);
    one extra chunk over a cell already covered, or two boxes crossing, still refused."""
    grid = [{"offsets": [i, j], "sizes": [1, 1]} for i in range(400) for j in range(500)]
    t = time.perf_counter()
    _disjoint(grid, "t")
    assert time.perf_counter() - t < 10.0
    with pytest.raises(RemodelError, match="overlapping chunks"):
        _disjoint(grid + [{"offsets": [399, 499], "sizes": [1, 1]}], "t")
    cross = [{"offsets": [0, 1], "sizes": [3, 1]}, {"offsets": [1, 0], "sizes": [1, 3]}]
    with pytest.raises(RemodelError, match="overlapping chunks"):
        _disjoint(cross, "t")
    _disjoint([{"offsets": [0, 0], "sizes": [2, 1]}, {"offsets": [0, 1], "sizes": [1, 2]},
               {"offsets": [1, 1], "sizes": [1, 2]}], "t")  # a valid non-grid tiling is accepted


@pytest.mark.parametrize("argv", [
    ["eval", EMBEDDED, "--data", CORPUS],
    ["score", EMBEDDED, "--data", CORPUS, "--out", "{t}/s"],
    ["search", EMBEDDED, "{t}/o", "--data", CORPUS, "--params", "1M"],
    ["train", EMBEDDED, "{t}/o", "--data", CORPUS, "--steps", "1"],
    ["distill", "--teacher", EMBEDDED, "--student", EMBEDDED, "{t}/o", "--data", CORPUS, "--steps", "1"],
])
def test_seq_len_below_two_is_refused_up_front(tmp_path, capsys, argv):
    argv = [str(a).replace("{t}", str(tmp_path)) for a in argv]
    t = time.perf_counter()
    fails(capsys, *argv, "--seq-len", "1", match="seq_len must be an integer in 2..")
    assert time.perf_counter() - t < 5.0 and listing(tmp_path) == set()


def test_an_eval_without_a_full_block_is_one_line(tmp_path, capsys):
    """--max-tokens under one block: refused before loading; data shorter than a block: one line after
    tokenizing; blocks given as ids with no row or one token each: one line (were a RuntimeError on the
    empty blocks' max, and a ZeroDivisionError)."""
    from remodel.pipelines.training import evaluate as E
    fails(capsys, "eval", EMBEDDED, "--data", CORPUS, "--seq-len", "64", "--max-tokens", "63",
          match="less than one block")
    short = tmp_path / "short.txt"
    short.write_text("a few words\n")
    fails(capsys, "eval", EMBEDDED, "--data", short, "--seq-len", "256", match="fewer than one sequence")
    with pytest.raises(RemodelError, match="seq_len must be >= 2"):
        E.evaluate(EMBEDDED, short, seq_len=1)
    from remodel.models.load import load_model
    model = load_model(EMBEDDED)
    for blocks in (torch.zeros(0, 32, dtype=torch.long), torch.zeros(4, 1, dtype=torch.long)):
        with pytest.raises(RemodelError, match="no full block"):
            E.evaluate(model, blocks)


def test_tokens_implying_an_endless_run_are_refused(tmp_path, capsys):
    t = time.perf_counter()
    fails(capsys, "train", EMBEDDED, tmp_path / "o", "--data", CORPUS, "--tokens", "1e18", "--seq-len", "2",
          match="more than 1000000000000")
    assert time.perf_counter() - t < 10.0 and listing(tmp_path) == set()


# ---- Deliver 3: run state parsed by schema ------------------------------------------------------------------

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step `remodel train` of the embedded model with checkpoints at steps 1 and 2: its OUT.run/."""
    work = tmp_path_factory.mktemp("run")
    assert cli.main(["train", str(EMBEDDED), str(work / "out"), *map(str, TRAIN), "--checkpoint-every", "1",
                     "--keep-last", "0", "--eval-data", str(CORPUS), "--eval-tokens", "256"]) == 0
    return work / "out.run"


def _copy(run, tmp_path) -> Path:
    """The run's OUT.run/ copied to tmp_path, step 2 removed (a resume then really loads step 1)."""
    rd = tmp_path / "out.run"
    shutil.copytree(run, rd)
    shutil.rmtree(rd / "step-000002")
    return rd


def _edit_meta(rd: Path, fn):
    path = rd / "step-000001" / "meta.json"
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m))


def _refused(capsys, rd: Path, tmp_path, match, convert=True):
    """`train --resume` (and `convert`) of the tampered run: exit 2, one line, nothing written."""
    before = listing(tmp_path)
    if convert:
        fails(capsys, "convert", rd, tmp_path / "hf", match=match)
    fails(capsys, "train", EMBEDDED, tmp_path / "out", *TRAIN, "--resume", match=match)
    assert listing(tmp_path) == before


META_ROWS = {
    "row_without_step": (lambda m: m["history"][0].pop("step"), "'history' row 0 has no step"),
    "step_past_the_checkpoint": (lambda m: m["history"][0].update(step=2), "'history' row 0 has no step in 1..1"),
    "moe_a_list": (lambda m: m["history"][0].update(moe=[1, 2]), "bad 'moe'"),
    "loss_a_string": (lambda m: m["history"][0].update(loss="low"), "bad 'loss'"),
    "eval_after_int": (lambda m: m["eval"].update(after=3), "'eval' entry 'after'"),
    "eval_figure_str": (lambda m: m["eval"]["before"].update(loss="x"), "'eval' entry 'before'"),
    "args_object": (lambda m: m["args"].update(seq_len={"a": 1}), "'args' entry 'seq_len'"),
    "moe_init_list": (lambda m: m.update(moe_init=[0.5]), "'moe_init'"),
    "overflowing_float": (None, "overflows a float"),
    "nested_600": (lambda m: m["args"].update(extra=json.loads("[" * 600 + "]" * 600)), "nested too deeply"),
}


@pytest.mark.parametrize("case", list(META_ROWS))
def test_meta_of_the_wrong_shape_is_one_line(run, tmp_path, capsys, case):
    rd = _copy(run, tmp_path)
    fn, match = META_ROWS[case]
    if fn is None:
        path = rd / "step-000001" / "meta.json"
        path.write_text(path.read_text().replace('"lr": 0.0001', '"lr": 1e999', 1))
    else:
        _edit_meta(rd, fn)
    _refused(capsys, rd, tmp_path, match)


def _chunk(rd: Path, key: str) -> tuple[Path, int, int, str]:
    """(data file, byte offset, length, dtype) of tensor `key`'s single chunk in step 1."""
    md = json.loads((rd / "step-000001" / "dcp_metadata.json").read_text())["tensors"][key]
    (c,) = md["chunks"]
    return rd / "step-000001" / c["file"], c["offset"], c["length"], md["dtype"]


def _overwrite(path: Path, offset: int, raw: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(raw)


def test_garbage_rng_state_is_one_line(run, tmp_path, capsys):
    rd = _copy(run, tmp_path)
    f, off, n, _ = _chunk(rd, "rng.torch")
    _overwrite(f, off, b"\xff" * n)
    _refused(capsys, rd, tmp_path, "RNG state does not load", convert=False)


@pytest.mark.parametrize("moment,value", [("exp_avg_sq", -1.0), ("exp_avg_sq", float("nan")),
                                          ("exp_avg", float("inf"))])
def test_bad_adamw_moments_are_refused_before_a_step(run, tmp_path, capsys, moment, value):
    """A negative second moment resumed and wrote NaN weights; now one line naming the tensor."""
    rd = _copy(run, tmp_path)
    f, off, n, dtype = _chunk(rd, f"optim.layers.1.mixer.up_proj.weight.{moment}")
    assert dtype == "F32"
    _overwrite(f, off, np.full(n // 4, value, np.float32).tobytes())
    _refused(capsys, rd, tmp_path, f"AdamW state {moment} of 'layers.1.mixer.up_proj.weight'", convert=False)


def test_deep_config_json_is_one_line(tmp_path, capsys):
    shutil.copytree(EMBEDDED, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["rope_scaling"] = json.loads("[" * 600 + "]" * 600)
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    before = listing(tmp_path)
    fails(capsys, "inspect", tmp_path / "m", match="nested too deeply")
    fails(capsys, "convert", tmp_path / "m", tmp_path / "o", match="nested too deeply")
    assert listing(tmp_path) == before


def test_convert_takes_the_tokenizer_from_the_run_never_from_a_path_in_meta(run, tmp_path, capsys):
    """meta.json naming another folder as the student: convert exports the tokenizer the run copied into
    its checkpoint, and nothing from that folder."""
    rd = _copy(run, tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text('{"secret": 1}')
    (other / "vocab.json").write_text('{"secret": 2}')
    _edit_meta(rd, lambda m: m["args"].update(student_dir=str(other)))
    assert cli.main(["convert", str(rd), str(tmp_path / "hf")]) == 0
    out = tmp_path / "hf"
    assert (out / "tokenizer.json").read_bytes() == (EMBEDDED / "tokenizer.json").read_bytes()
    assert not (out / "vocab.json").exists()


def test_a_link_out_of_the_run_as_its_tokenizer_is_refused(run, tmp_path, capsys):
    rd = _copy(run, tmp_path)
    secret = tmp_path / "secret.json"
    secret.write_text('{"secret": 1}')
    tok = rd / "step-000001" / "aux" / "tokenizer.json"
    tok.unlink()
    os.symlink(secret, tok)
    fails(capsys, "convert", rd, tmp_path / "hf", match="not a regular file inside the checkpoint")
    assert not (tmp_path / "hf").exists()


def test_json_depth_counts_brackets_outside_strings_only(tmp_path):
    """64 levels read, 65 refused; brackets and escaped quotes inside strings do not count."""
    from remodel.models.files import MAX_DEPTH, read_json
    f = tmp_path / "c.json"
    inner = lambda n: "[" * n + "]" * n  # noqa: E731
    f.write_text('{"a": ' + inner(MAX_DEPTH - 1) + ', "s": "\\"[[[[{{{{' + "[" * 500 + '"}')
    assert read_json(f)["s"].startswith('"[[[[')
    f.write_text('{"a": ' + inner(MAX_DEPTH) + "}")
    with pytest.raises(RemodelError, match="nested too deeply"):
        read_json(f)
