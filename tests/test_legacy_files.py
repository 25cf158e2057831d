"""Files written by an earlier remodel still read (issue 54 Deliver 1: a versioned reader, tested on files main
wrote before the config tree): a score directory applies to prune, a distill checkpoint resumes, the reports' and
the score file's remodel configs load equal to the model's. The files: tests/data/legacy/files, made by
tests/data/legacy/make_legacy.py at f2afb30 (a tiny nemotron_h: Mamba-2, attention, MLP and MoE layers)."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from remodel import cli
from remodel.models.config import ModelConfig
from remodel.models.load import load_config
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path

LEGACY = Path(__file__).resolve().parent / "data" / "legacy" / "files"
PRUNE = ["--ffn-size", "16", "--experts", "6"]  # what make_legacy.py pruned with
DISTILL = ["--steps", "2", "--seq-len", "32", "--batch", "2", "--checkpoint-every", "1", "--keep-last", "0",
           "--log-every", "0"]


def _copy(name: str, tmp: Path) -> Path:
    """The legacy folder `name` copied under tmp, with the embedded tokenizer beside a checkpoint."""
    d = tmp / name
    shutil.copytree(LEGACY / name, d)
    if (d / "config.json").is_file():
        for f in embedded_tokenizer_path().iterdir():
            shutil.copy(f, d / f.name)
    return d


def _json(*parts) -> dict:
    return json.loads(LEGACY.joinpath(*parts).read_text())


def test_legacy_configs_load_equal_to_the_models():
    """The remodel config file, the score file's config and the prune report's configs before / after read as
    the configs of the checkpoints they describe (MoE layers included: their activation included)."""
    model, pruned = load_config(LEGACY / "model"), load_config(LEGACY / "pruned")
    assert ModelConfig.from_dict(_json("remodel_config.json")) == model
    assert ModelConfig.from_dict(_json("scores", "scores.json")["config"]) == model
    report = _json("pruned", "remodel_report.json")
    assert ModelConfig.from_dict(report["config_before"]) == model
    assert ModelConfig.from_dict(report["config_after"]) == pruned
    assert "E" in model.pattern and pruned.moe.n_routed_experts == 6


def test_legacy_scores_prune_to_the_same_tensors(tmp_path):
    """prune --scores with the legacy score directory writes, tensor for tensor, the student prune wrote then,
    and now the tied embedding again as lm_head (transformers' nemotron_h never ties: models.load.head_copy)."""
    model = _copy("model", tmp_path)
    assert cli.main(["prune", str(model), str(tmp_path / "out"), "--scores", str(LEGACY / "scores"), *PRUNE]) == 0
    got, want = load_file(tmp_path / "out" / "model.safetensors"), load_file(LEGACY / "pruned" / "model.safetensors")
    assert got.keys() - want.keys() == {"lm_head.weight"} and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(got["lm_head.weight"], got["backbone.embeddings.weight"])
    report = json.loads((tmp_path / "out" / "remodel_report.json").read_text())
    assert report["kept"] == _json("pruned", "remodel_report.json")["kept"]


def test_legacy_distill_checkpoint_resumes(tmp_path, capsys):
    """distill --resume from the legacy run's step-1 checkpoint (its paths moved to where the copies lie) runs
    step 2 to the loss the uninterrupted run logged."""
    teacher, student = _copy("model", tmp_path), _copy("pruned", tmp_path)
    run = _copy("dist.run", tmp_path)
    meta_path = run / "step-000001" / "meta.json"
    meta = json.loads(meta_path.read_text())
    corpus = str(embedded_corpus()[1])
    meta["args"].update(student_dir=str(student), teacher_dir=str(teacher), out=str(tmp_path / "dist"), data=corpus)
    meta_path.write_text(json.dumps(meta))
    assert cli.main(["distill", "--teacher", str(teacher), "--student", str(student), str(tmp_path / "dist"),
                     "--data", corpus, *DISTILL, "--resume"]) == 0
    report = json.loads((tmp_path / "dist" / "remodel_report.json").read_text())
    assert report["resumed_from"] is not None and "step-000001" in str(report["resumed_from"])
    want = {h["step"]: h for h in _json("dist", "remodel_report.json")["history"]}[2]
    got = {h["step"]: h for h in report["history"]}[2]
    for key in ("loss", "kl", "lm", "lb"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9), key
