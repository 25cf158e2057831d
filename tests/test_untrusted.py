"""Untrusted checkpoints and run directories (issue 25): no pickle is ever loaded, safetensors headers and
index files are validated as strictly as the safetensors library does, DCP metadata and meta.json are
checked against their directory, and bounded JSON never blocks or recurses. Each case is a one-line
error (exit 2), nothing written."""
import json
import os
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch

from remodel import cli
from remodel.models.checkpoint import CheckpointReader, read_header
from remodel.models.files import read_json
from remodel.models.errors import RemodelError
from remodel.models.regions import RegionReader
from tests.cli_contract import fails, listing

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "data" / "embedded"
CORPUS = ROOT / "data" / "corpus" / "train.txt.gz"


# ---- a training run directory with a planted pickle ---------------------------------------------------

class _Payload:
    """Unpickling this writes the marker file: proof that code from the checkpoint ran."""
    marker = None

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def _plant(step_dir: Path, marker: Path):
    import pickle
    _Payload.marker = str(marker)
    (step_dir / ".metadata").write_bytes(pickle.dumps(_Payload()))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step `remodel train` of the embedded model: (work dir, OUT)."""
    work = tmp_path_factory.mktemp("run")
    out = work / "out"
    assert cli.main(["train", str(EMBEDDED), str(out), "--data", str(CORPUS), "--steps", "2", "--seq-len", "32",
                     "--batch", "2", "--checkpoint-every", "1", "--keep-last", "0", "--log-every", "0"]) == 0
    return work, out


def _copy_run(run, tmp_path) -> Path:
    work, out = run
    shutil.copytree(Path(str(out) + ".run"), tmp_path / "out.run")
    return tmp_path / "out.run"


def test_planted_pickle_never_runs_on_convert(run, tmp_path, capsys):
    rd = _copy_run(run, tmp_path)
    marker = tmp_path / "PWNED"
    for step in rd.glob("step-*"):
        _plant(step, marker)
    assert cli.main(["convert", str(rd), str(tmp_path / "hf")]) == 0
    assert not marker.exists()
    w = __import__("safetensors.torch").torch.load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in w.values())


def test_planted_pickle_never_runs_on_resume(run, tmp_path, capsys):
    rd = _copy_run(run, tmp_path)
    marker = tmp_path / "PWNED"
    shutil.rmtree(rd / "step-000002")  # resume from step 1: a real load of the planted checkpoint
    for step in rd.glob("step-*"):
        _plant(step, marker)
    assert cli.main(["train", str(EMBEDDED), str(tmp_path / "out"), "--data", str(CORPUS), "--steps", "2",
                     "--seq-len", "32", "--batch", "2", "--log-every", "0", "--resume"]) == 0
    assert not marker.exists()
    rep = json.loads((tmp_path / "out" / "remodel_report.json").read_text())
    assert rep["resumed_from"].endswith("step-000001")


def test_old_pickled_checkpoint_refused(run, tmp_path, capsys):
    rd = _copy_run(run, tmp_path)
    marker = tmp_path / "PWNED"
    step = sorted(rd.glob("step-*"))[-1]
    (step / "dcp_metadata.json").unlink()
    _plant(step, marker)
    fails(capsys, "convert", rd, tmp_path / "hf", match="pickled DCP metadata")
    assert not marker.exists() and not (tmp_path / "hf").exists()


def _edit_json(path: Path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _first_chunk(d):
    return next(iter(d["tensors"].values()))["chunks"][0]


DCP_TAMPER = {
    "offset_past_file": (lambda d: _first_chunk(d).update(offset=10**12), "byte range"),
    "length_mismatch": (lambda d: _first_chunk(d).update(length=_first_chunk(d)["length"] + 4), "byte range"),
    "file_outside": (lambda d: _first_chunk(d).update(file="../../etc/passwd"), "data file"),
    "chunk_outside": (lambda d: _first_chunk(d).update(offsets=[10**6] * len(_first_chunk(d)["offsets"])),
                      "outside its size"),
    "unknown_dtype": (lambda d: next(iter(d["tensors"].values())).update(dtype="PICKLE"), "malformed"),
    "not_covered": (lambda d: next(v for v in d["tensors"].values() if len(v["chunks"]) == 1)["chunks"].clear(),
                    "cover"),
    "shared_bytes": (lambda d: _first_chunk(d).update(offset=_first_chunk(d)["offset"] + 0), None),
}


@pytest.mark.parametrize("case", [c for c in DCP_TAMPER if DCP_TAMPER[c][1]])
def test_tampered_dcp_metadata_is_one_line(run, tmp_path, capsys, case):
    rd = _copy_run(run, tmp_path)
    fn, match = DCP_TAMPER[case]
    for step in rd.glob("step-*"):
        _edit_json(step / "dcp_metadata.json", fn)
    fails(capsys, "convert", rd, tmp_path / "hf", match=match)
    assert not (tmp_path / "hf").exists()


def test_overlapping_dcp_chunks_refused(run, tmp_path, capsys):
    """Two tensors pointing at the same bytes of a data file (same size): refused, not read twice."""
    rd = _copy_run(run, tmp_path)

    def alias(d):
        by = {}
        for c in (c for v in d["tensors"].values() for c in v["chunks"]):
            by.setdefault(c["length"], []).append(c)
        a, b = next(v for v in by.values() if len(v) >= 2)[:2]
        b.update(file=a["file"], offset=a["offset"])
    for step in rd.glob("step-*"):
        _edit_json(step / "dcp_metadata.json", alias)
    fails(capsys, "convert", rd, tmp_path / "hf", match="share bytes")


META_TAMPER = {
    "step_moved": (lambda m: m.update(step=1), "does not match its directory"),
    "negative_batches": (lambda m: m.update(consumed_batches=-5), "consumed_batches"),
    "missing_args": (lambda m: m.pop("args"), "'args'"),
    "adam_nan_step": (lambda m: m["adam_steps"].update({next(iter(m["adam_steps"])): 1e9}), "AdamW step"),
    "history_too_long": (lambda m: m.update(history=m["history"] * 5), "'history'"),
}


@pytest.mark.parametrize("case", list(META_TAMPER))
def test_tampered_meta_refused_on_resume_and_convert(run, tmp_path, capsys, case):
    rd = _copy_run(run, tmp_path)
    fn, match = META_TAMPER[case]
    _edit_json(sorted(rd.glob("step-*"))[-1] / "meta.json", fn)
    before = listing(tmp_path)
    fails(capsys, "convert", rd, tmp_path / "hf", match=match)
    fails(capsys, "train", EMBEDDED, tmp_path / "out", "--data", CORPUS, "--steps", "2", "--seq-len", "32",
          "--batch", "2", "--resume", match=match)
    assert listing(tmp_path) == before


def _relabel_int(d):
    for v in d["tensors"].values():
        v["dtype"] = {"F32": "I32", "BF16": "I16", "F16": "I16"}.get(v["dtype"], v["dtype"])


def test_dcp_integer_relabel_refused_on_resume_and_convert(run, tmp_path, capsys):
    rd = _copy_run(run, tmp_path)
    shutil.rmtree(rd / "step-000002")
    _edit_json(rd / "step-000001" / "dcp_metadata.json", _relabel_int)
    fails(capsys, "convert", rd, tmp_path / "hf", match="wants a float")
    fails(capsys, "train", EMBEDDED, tmp_path / "out", "--data", CORPUS, "--steps", "2", "--seq-len", "32",
          "--batch", "2", "--resume", match="this run holds")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "out").exists()


def test_dcp_shape_checked_against_config_on_export(run, tmp_path, capsys):
    rd = _copy_run(run, tmp_path)
    for step in rd.glob("step-*"):
        _edit_json(step / "meta.json", lambda m: m["hf_config"].update(hidden_size=m["hf_config"]["hidden_size"] * 2))
    fails(capsys, "convert", rd, tmp_path / "hf", match="its config wants")


# ---- safetensors headers and index files ---------------------------------------------------------------

def _rewrite(path: Path, fn, pad=b""):
    """Rewrite a safetensors file's header through fn(header) (the data section unchanged, + pad)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    fn(header)
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:] + pad)


def _f32(h):  # the embedded model's weights (bf16)
    return sorted((k for k, e in h.items() if k != "__metadata__" and e["dtype"] == "BF16"),
                  key=lambda k: h[k]["data_offsets"][0])


def _same_size_pair(h):
    by = {}
    for k in _f32(h):
        by.setdefault(tuple(h[k]["shape"]), []).append(k)
    return next(v for v in by.values() if len(v) >= 2)


def _overlap(h):
    a, b = _same_size_pair(h)[:2]
    h[b]["data_offsets"] = list(h[a]["data_offsets"])


def _shift(h):
    for k in h:
        if k != "__metadata__":
            h[k]["data_offsets"] = [h[k]["data_offsets"][0] + 4, h[k]["data_offsets"][1] + 4]


def _swap(h):  # two same-size tensors' offsets exchanged: still contiguous, still valid, different weights
    a, b = _same_size_pair(h)[:2]
    h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]


HEADERS = {
    "overlap": (_overlap, b"", "contiguous"),
    "shifted": (_shift, b"\0" * 4, "starts at byte 4"),
    "int_relabel": (lambda h: h[_f32(h)[0]].update(dtype="I16"), b"", "floating point"),
    "trailing_bytes": (lambda h: None, b"\0" * 16, "padded"),
    "bad_metadata": (lambda h: h.update(__metadata__={"format": 1}), b"", "string map"),
    "offsets_three": (lambda h: h[_f32(h)[0]].update(data_offsets=[0, 4, 8]), b"", "corrupt"),
    "float_shape": (lambda h: h[_f32(h)[0]].update(shape=[1.5]), b"", "corrupt"),
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_safetensors_header_as_strict_as_the_library(tmp_path, capsys, case):
    from safetensors import safe_open
    shutil.copytree(EMBEDDED, tmp_path / "model")
    fn, pad, match = HEADERS[case]
    f = tmp_path / "model" / "model.safetensors"
    _rewrite(f, fn, pad)
    if case != "int_relabel":  # the library refuses these too (ours says why in one line)
        with pytest.raises(Exception):
            with safe_open(str(f), "pt") as g:
                [g.get_tensor(k) for k in g.keys()]
    before = listing(tmp_path)
    fails(capsys, "convert", tmp_path / "model", tmp_path / "out", match=match)
    assert listing(tmp_path) == before
    with pytest.raises(RemodelError, match=match):
        r = RegionReader(tmp_path / "model")
        for name, shape in r.shapes.items():
            r.read(name, [None] * len(shape))


def test_swapped_offsets_still_valid(tmp_path):
    """A header the library accepts stays accepted (the strict checks do not refuse valid files)."""
    shutil.copytree(EMBEDDED, tmp_path / "model")
    _rewrite(tmp_path / "model" / "model.safetensors", _swap)
    with CheckpointReader(tmp_path / "model") as r:
        assert len(r.keys()) > 0


def _sharded(tmp_path) -> Path:
    from remodel.models.checkpoint import copy_checkpoint
    copy_checkpoint(EMBEDDED, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    return tmp_path / "sharded"


@pytest.mark.parametrize("case,edit,match", [
    ("escape", lambda m: m.update({next(iter(m)): "../model.safetensors"}), "file name"),
    ("empty", lambda m: m.clear(), "weight_map"),
    ("not_str", lambda m: m.update({next(iter(m)): 3}), "weight_map"),
])
def test_index_file_checked(tmp_path, capsys, case, edit, match):
    d = _sharded(tmp_path)
    _edit_json(d / "model.safetensors.index.json", lambda j: edit(j["weight_map"]))
    fails(capsys, "convert", d, tmp_path / "out", match=match)
    with pytest.raises(RemodelError, match=match):
        RegionReader(d)


# ---- bounded JSON ---------------------------------------------------------------------------------------

def test_config_fifo_refused_without_blocking(tmp_path, capsys):
    shutil.copytree(EMBEDDED, tmp_path / "model")
    (tmp_path / "model" / "config.json").unlink()
    os.mkfifo(tmp_path / "model" / "config.json")
    done = []
    t = threading.Thread(target=lambda: done.append(fails(capsys, "inspect", tmp_path / "model",
                                                          match="not a regular file")), daemon=True)
    t.start()
    t.join(20)
    assert done, "reading a FIFO config blocked"


@pytest.mark.parametrize("text,match", [
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    ('{"a": 1, "a": 2}', "duplicate key"),
    ('{"rms_norm_eps": NaN}', "NaN is not JSON"),
    ('{"x": "\\ud800"}' + " " * 10, None),
])
def test_strict_json(tmp_path, text, match):
    f = tmp_path / "c.json"
    f.write_text(text)
    if match is None:
        assert read_json(f) == {"x": "\ud800"}
        return
    with pytest.raises(RemodelError, match=match):
        read_json(f)


def test_json_size_bound(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('{"a": "' + "x" * 2000 + '"}')
    with pytest.raises(RemodelError, match="more than the 1000"):
        read_json(f, max_bytes=1000)


def test_header_size_bound(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(RemodelError, match="declares"):
        read_header(f)


# ---- faults -------------------------------------------------------------------------------------------

def test_full_disk_during_checkpoint_is_one_line_and_no_partial(tmp_path, capsys, monkeypatch):
    import errno

    from remodel.pipelines.training import dcp_storage

    def full(self, plan, planner):
        with open(self.path / plan.storage_data, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path / plan.storage_data))
    monkeypatch.setattr(dcp_storage.RawWriter, "write_data", full)
    fails(capsys, "train", EMBEDDED, tmp_path / "out", "--data", CORPUS, "--steps", "2", "--seq-len", "32",
          "--batch", "2", match="No space left on device")
    assert not (tmp_path / "out").exists()
    run_dir = tmp_path / "out.run"
    assert not run_dir.exists() or not [p for p in run_dir.iterdir() if p.name.startswith((".step", "step"))]


# ---- scores directories and JSON data ----------------------------------------------------------------

def test_scores_must_be_float_and_not_infinite(tmp_path):
    from safetensors.torch import save_file

    from remodel.compress.scores import FORMAT, load_scores
    d = tmp_path / "scores"
    d.mkdir()
    (d / "scores.json").write_text(json.dumps({"format": FORMAT}))
    save_file({"hidden": torch.tensor([1.0, float("inf")])}, d / "scores.safetensors")
    with pytest.raises(RemodelError, match="not finite"):
        load_scores(d)
    save_file({"hidden": torch.tensor([1, 2], dtype=torch.int32)}, d / "scores.safetensors")
    with pytest.raises(RemodelError, match="not finite"):
        load_scores(d)
    save_file({"hidden": torch.tensor([1.0, float("nan")])}, d / "scores.safetensors")  # NaN: a layer unseen
    assert load_scores(d)[0]["hidden"].shape == (2,)


@pytest.mark.parametrize("text,match", [
    ('{"text": ' + "[" * 100000 + "]" * 100000 + "}\n", "nested too deeply"),
    ('{"text": 5}\n', "holding a string"),
])
def test_hostile_jsonl_data_is_one_line(tmp_path, capsys, text, match):
    f = tmp_path / "data.jsonl"
    f.write_text(text)
    fails(capsys, "eval", EMBEDDED, "--data", f, match=match)
