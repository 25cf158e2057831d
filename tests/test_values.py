"""Values that used to pass silently (issue 39): NaN scores, casts that overflow the output dtype, config
fields of the wrong type or an unknown kind, an error message holding a newline, and third-party noise
(torchao's load failures, DCP's single-process warning) in the normal output of a command."""
import copy
import json
import logging
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from remodel import cli
from remodel.compress.scores import FORMAT, load_scores, write_scores
from remodel.models.errors import RemodelError, one_line
from remodel.models.hf import config_to_hf
from tests.cli_contract import fails, listing
from tests.conftest import FAMILY_CONFIGS, random_model, write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "data" / "embedded"
CORPUS = ROOT / "data" / "corpus" / "train.txt.gz"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama checkpoint and its magnitude SCORES: (work dir, model, scores)."""
    work = tmp_path_factory.mktemp("values")
    model = write_checkpoint(random_model(FAMILY_CONFIGS["llama"]), work / "model")
    assert cli.main(["score", str(model), "--method", "magnitude", "--out", str(work / "scores")]) == 0
    return work, model, work / "scores"


def _poisoned_scores(tiny, tmp_path, name, value, count=None):
    """A copy of the tiny model's SCORES with the first `count` (all) entries of `name` set to `value`."""
    d = tmp_path / f"scores-{name}"
    shutil.copytree(tiny[2], d)
    t = load_file(d / "scores.safetensors")
    t[name].view(-1)[:count] = value
    save_file(t, d / "scores.safetensors")
    return d


# ---- Deliver 4: NaN scores -----------------------------------------------------------------------

@pytest.mark.parametrize("count,match", [(None, "are all NaN"), (3, "hold 3 NaN value(s) of 40")])
def test_nan_scores_refused_by_prune(tiny, tmp_path, capsys, count, match):
    """All NaN (refused reading --scores) or a few NaN on the axis being pruned (refused when ranking it):
    one line naming the axis and --scores, nothing written."""
    scores = _poisoned_scores(tiny, tmp_path, "layers.1.ffn", float("nan"), count)
    before = listing(tmp_path)
    line = fails(capsys, "prune", tiny[1], tmp_path / "out", "--scores", scores, "--ffn-size", "32", match=match)
    assert "'layers.1.ffn'" in line and "--scores" in line
    assert listing(tmp_path) == before


def test_partial_nan_in_an_unpruned_axis_still_prunes(tiny, tmp_path, capsys):
    """NaN where no ranking is asked for (the hidden axis, pruning only the FFN) is not in the way."""
    scores = _poisoned_scores(tiny, tmp_path, "hidden", float("nan"), 2)
    assert cli.main(["prune", str(tiny[1]), str(tmp_path / "out"), "--scores", str(scores),
                     "--ffn-size", "32"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["intermediate_size"] == 32


def test_load_scores_refuses_an_all_nan_axis(tmp_path):
    d = tmp_path / "scores"
    d.mkdir()
    (d / "scores.json").write_text(json.dumps({"format": FORMAT}))
    save_file({"hidden": torch.tensor([1.0, 2.0]), "block_importance": torch.full((3,), float("nan"))},
              d / "scores.safetensors")
    with pytest.raises(RemodelError, match=r"'block_importance' are all NaN.*\(--scores\)|\(--scores\).*'block_importance' are all NaN"):
        load_scores(d)


def test_scores_computed_as_nan_are_not_written(tiny, tmp_path, capsys, monkeypatch):
    """`remodel score` whose computation comes out NaN stops in one line with no SCORES written; only a
    per-layer depth score may hold a NaN (a layer scoring never saw)."""
    from remodel.pipelines.commands import score as score_cmd
    real = score_cmd.weight_scores

    def nan_ffn(*a, **k):
        s = real(*a, **k)
        s["layers.3.ffn"][5] = float("nan")
        return s
    monkeypatch.setattr(score_cmd, "weight_scores", nan_ffn)
    before = listing(tmp_path)
    fails(capsys, "score", tiny[1], "--method", "magnitude", "--out", tmp_path / "s",
          match="'layers.3.ffn' came out NaN in 1 of 40")
    assert listing(tmp_path) == before
    write_scores(tmp_path, {"block_importance": torch.tensor([0.5, float("nan")])}, {})  # allowed
    with pytest.raises(RemodelError, match="'hidden' came out NaN"):
        write_scores(tmp_path, {"hidden": torch.tensor([0.5, float("nan")])}, {})


# ---- Deliver 4: casts that overflow ----------------------------------------------------------------

@pytest.fixture()
def big_weight(tmp_path):
    """A tiny llama checkpoint (float32) whose layer-1 up_proj holds 1e5, beyond float16's 65504."""
    model = random_model(FAMILY_CONFIGS["llama"])
    with torch.no_grad():
        model.layers[1].mixer.up_proj.weight[0, 0] = 1e5
    return write_checkpoint(model, tmp_path / "model")


def test_convert_to_float16_refuses_an_overflowing_weight(big_weight, tmp_path, capsys):
    before = listing(tmp_path)
    line = fails(capsys, "convert", big_weight, tmp_path / "out", "--dtype", "float16",
                 match="1 value(s) beyond float16's range")
    assert "layers.1.mixer.up_proj.weight" in line and "100000" in line
    assert listing(tmp_path) == before
    assert cli.main(["convert", str(big_weight), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0  # fits
    assert load_file(tmp_path / "bf16" / "model.safetensors")["model.layers.0.mlp.up_proj.weight"].max() > 5e4


def test_float16_export_refuses_overflow_and_nan(tmp_path):
    """The export every writer shares (save_model / train's export_sharded: models.load.iter_hf_tensors)."""
    from remodel.models.load import save_model
    model = random_model(FAMILY_CONFIGS["llama"])
    with torch.no_grad():
        model.layers[0].mixer.q_proj.weight[1, 2] = -7e4
    with pytest.raises(RemodelError, match=r"'layers.0.mixer.q_proj.weight': 1 value\(s\) beyond float16"):
        save_model(model, tmp_path / "a", dtype=torch.float16)
    with torch.no_grad():
        model.layers[0].mixer.q_proj.weight[1, 2] = float("nan")
    with pytest.raises(RemodelError, match=r"'layers.0.mixer.q_proj.weight' holds 1 non-finite"):
        save_model(model, tmp_path / "b", dtype=torch.float16)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---- Deliver 5: config values ------------------------------------------------------------------------

def _rope(d, **kw):
    d["rope_parameters"] = {**(d.get("rope_parameters") or {"rope_type": "default", "rope_theta": 1e4}), **kw}


BAD_FIELDS = [(fam, "rope_type", lambda d: _rope(d, rope_type="bogus")) for fam in sorted(FAMILY_CONFIGS)] + [
    (fam, "partial_rotary_factor", lambda d: d.update(partial_rotary_factor="abc")) for fam in sorted(FAMILY_CONFIGS)
] + [
    ("bamba", "partial_rotary_factor", lambda d: _rope(d, partial_rotary_factor="abc")),
    ("llama", "partial_rotary_factor", lambda d: _rope(d, partial_rotary_factor=0.5)),  # llama: whole heads
    ("qwen3", "partial_rotary_factor", lambda d: _rope(d, partial_rotary_factor=1.5)),
    ("mistral", "rope_parameters", lambda d: d.update(rope_parameters="default")),
    ("llama", "factor", lambda d: _rope(d, rope_type="llama3", factor="x")),
    ("granitemoehybrid", "layer_types", lambda d: d.update(layer_types=["mamba", "sliding_attention"])),
    ("granitemoehybrid", "layer_types", lambda d: d.update(layer_types=["mamba", "bogus"])),
    ("granitemoehybrid", "position_embedding_type", lambda d: d.update(position_embedding_type="alibi")),
    ("falcon_h1", "ssm_multipliers", lambda d: d.update(ssm_multipliers=[1.0, 2.0])),
    ("falcon_h1", "ssm_multipliers", lambda d: d.update(ssm_multipliers=[1.0, 1.0, 1.0, 1.0, "x"])),
    ("falcon_h1", "mlp_multipliers", lambda d: d.update(mlp_multipliers=[1.0, 2.0, 3.0])),
    ("falcon_h1", "mlp_multipliers", lambda d: d.update(mlp_multipliers="abc")),
]


@pytest.mark.parametrize("family,field,spoil", BAD_FIELDS, ids=[f"{f}-{k}-{i}" for i, (f, k, _) in enumerate(BAD_FIELDS)])
def test_config_field_of_the_wrong_type_or_kind_is_one_line(tmp_path, capsys, family, field, spoil):
    d = json.loads(json.dumps(config_to_hf(FAMILY_CONFIGS[family], family)))
    assert cli.main(["inspect", str(_write(tmp_path / "good", d))]) == 0  # the unspoilt config reads
    bad = copy.deepcopy(d)
    spoil(bad)
    fails(capsys, "inspect", _write(tmp_path / "bad", bad), match=field)


def _write(folder, d):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(d))
    return folder


# ---- an error line with a newline in it ------------------------------------------------------------

def test_a_path_holding_a_newline_stays_one_line(tmp_path, capsys):
    missing = tmp_path / "no\nsuch\rmodel\u2028x"
    line = fails(capsys, "convert", missing, tmp_path / "out", match="no\\nsuch\\rmodel\\u2028x")
    assert str(tmp_path) in line
    assert one_line("tab\there é") == "tab\\there é"


# ---- Deliver 7: quiet output -----------------------------------------------------------------------

NOISE = ("Failed to load", "UserWarning", "Deprecat", "deprecat", "torch.distributed is disabled")


def test_train_checkpoint_resume_and_convert_print_no_third_party_noise(tmp_path, capfd, caplog):
    """Warnings are recorded (pytest would otherwise swallow them) and log records caught, besides the
    file descriptors: a third-party notice in any of the three fails the test."""
    out = tmp_path / "out"
    args = ["train", str(EMBEDDED), str(out), "--data", str(CORPUS), "--steps", "2", "--seq-len", "32",
            "--batch", "2", "--checkpoint-every", "1", "--keep-last", "0", "--log-every", "0"]
    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert cli.main(args) == 0
        shutil.rmtree(out)  # as after a crash before step 2: resume loads step 1
        shutil.rmtree(tmp_path / "out.run" / "step-000002")
        assert cli.main(args + ["--resume"]) == 0, capfd.readouterr().err
        assert json.loads((out / "remodel_report.json").read_text())["resumed_from"].endswith("step-000001")
        assert cli.main(["convert", str(out.parent / "out.run"), str(tmp_path / "conv")]) == 0
    text = "".join(capfd.readouterr()) + "\n".join(r.getMessage() for r in caplog.records)
    text += "\n".join(f"{w.category.__name__}: {w.message}" for w in seen if not issubclass(w.category, ResourceWarning))
    assert not [n for n in NOISE if n in text], [ln for ln in text.splitlines() if any(n in ln for n in NOISE)]


def test_loading_through_transformers_after_the_quiet_import_prints_nothing():
    """A fresh process: torchao's CUDA-library notices and torch's pytree deprecations never show."""
    code = ("from remodel.pipelines.training.fp8 import import_torchao_quietly as q; assert q(); "
            "from transformers import AutoModelForCausalLM; "
            f"AutoModelForCausalLM.from_pretrained({str(EMBEDDED)!r})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    text = r.stdout + r.stderr
    assert not [n for n in NOISE if n in text], text[-2000:]
