"""Vision towers checked before anything is written (issue 53, Deliver 3): a tower tensor missing, of the wrong
shape, unknown to transformers' class for the tower's config, or holding NaN is refused by `convert` and `prune`
in one line (exit 2) with no OUT and no temporary sibling (it was copied into OUT); a `vision_config.out_hidden_size`
other than the text model's hidden size is refused by `inspect`, `convert` and `prune` (inspect accepted it);
and `inspect` / `prune` of a tower family print nothing on stderr, as the text families (torchao's load failures
and torch's pytree warnings came through, 4 lines)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from remodel import cli
from remodel.models.families import FAMILIES
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path
from tests.cli_contract import fails, listing

TOWER = "model.visual."
PKG_PARENT = Path(cli.__file__).parents[1]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(a tiny released-layout qwen3_5 checkpoint with its vision tower, importance scores of it)."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    tiny = FAMILIES["qwen3_5"].tiny["plain"]
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3_5", text_config=dict(tiny["text_config"], vocab_size=2048),
                               vision_config=tiny["vision_config"])
    work = tmp_path_factory.mktemp("vl")
    AutoModelForImageTextToText.from_config(cfg).float().save_pretrained(work / "model")
    for f in embedded_tokenizer_path().iterdir():
        shutil.copy(f, work / "model" / f.name)
    assert cli.main(["score", str(work / "model"), "--data", str(embedded_corpus()[1]), "--out", str(work / "scores"),
                     "--samples", "4", "--seq-len", "16", "--no-loss-increase"]) == 0
    return work / "model", work / "scores"


def _copy(vl, tmp_path) -> Path:
    shutil.copytree(vl[0], tmp_path / "m")
    return tmp_path / "m"


def _edit_tensors(model: Path, fn):
    from safetensors.torch import load_file, save_file
    t = load_file(model / "model.safetensors")
    fn(t)
    save_file(t, model / "model.safetensors", metadata={"format": "pt"})


def _refused_by_convert_and_prune(capsys, vl, tmp_path, model, match):
    """convert, prune, upcycle and train of `model`: exit 2, one line with `match`, nothing new under tmp_path."""
    before = listing(tmp_path)
    fails(capsys, "convert", model, tmp_path / "o", match=match)
    fails(capsys, "prune", model, tmp_path / "p", "--scores", vl[1], "--ffn-size", "24", match=match)
    fails(capsys, "upcycle", model, tmp_path / "u", "--experts", "2", "--granularity", "1", "--top-k", "1",
          match=match)
    fails(capsys, "train", model, tmp_path / "t", "--data", embedded_corpus()[1], "--steps", "1", match=match)
    assert listing(tmp_path) == before  # no OUT, no temporary sibling


TOWER_FAULTS = {  # what is done to the tower's tensors, what the one line says
    "missing": (lambda t: t.pop(TOWER + "merger.linear_fc2.weight"),
                f"tower tensor '{TOWER}merger.linear_fc2.weight' is missing"),
    "wrong_shape": (lambda t: t.update({TOWER + "blocks.0.mlp.linear_fc1.weight":
                                        torch.zeros(25, 16)}),
                    f"tower tensor '{TOWER}blocks.0.mlp.linear_fc1.weight' has shape [25, 16], its vision_config "
                    "builds [24, 16]"),
    "unknown": (lambda t: t.update({TOWER + "blocks.1.attn.qkv.weight": torch.zeros(48, 16)}),
                f"tower tensor '{TOWER}blocks.1.attn.qkv.weight' is not one transformers builds"),
    "nan": (lambda t: t[TOWER + "pos_embed.weight"].view(-1)[:3].fill_(float("nan")),
            f"tower tensor '{TOWER}pos_embed.weight' holds 3 non-finite value(s)"),
    "inf": (lambda t: t[TOWER + "merger.linear_fc1.bias"].view(-1)[:1].fill_(float("inf")),
            f"tower tensor '{TOWER}merger.linear_fc1.bias' holds 1 non-finite value(s)"),
}


@pytest.mark.parametrize("fault", list(TOWER_FAULTS))
def test_a_bad_tower_is_refused_before_writing(vl, tmp_path, capsys, fault):
    model = _copy(vl, tmp_path)
    edit, match = TOWER_FAULTS[fault]
    _edit_tensors(model, edit)
    _refused_by_convert_and_prune(capsys, vl, tmp_path, model, match)


def test_a_good_tower_still_passes(vl, tmp_path):
    """The check refuses nothing transformers writes: convert and prune of the untouched checkpoint succeed."""
    assert cli.main(["convert", str(vl[0]), str(tmp_path / "o")]) == 0
    assert cli.main(["prune", str(vl[0]), str(tmp_path / "p"), "--scores", str(vl[1]), "--ffn-size", "24"]) == 0
    assert (tmp_path / "p" / "config.json").is_file()


def test_out_hidden_size_other_than_the_hidden_size_is_refused(vl, tmp_path, capsys):
    model = _copy(vl, tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["vision_config"]["out_hidden_size"] == cfg["text_config"]["hidden_size"] == 32
    cfg["vision_config"]["out_hidden_size"] = 48
    (model / "config.json").write_text(json.dumps(cfg))
    match = "vision_config.out_hidden_size=48 differs from the text model's hidden_size 32"
    before = listing(tmp_path)
    fails(capsys, "inspect", model, match=match)
    assert listing(tmp_path) == before
    _refused_by_convert_and_prune(capsys, vl, tmp_path, model, match)


def _stderr_lines(args, cwd) -> list[str]:
    """The CLI in a fresh process (the warnings come once per process, at an import): its stderr lines that
    are not progress bars (nor prune's summary line)."""
    code = "import sys; from remodel import cli; sys.exit(cli.main(sys.argv[1:]))"
    path = os.pathsep.join(p for p in (str(PKG_PARENT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return [ln for ln in r.stderr.replace("\r", "\n").splitlines()
            if ln.strip() and "%|" not in ln and "it/s]" not in ln and "s/it]" not in ln
            and not ln.startswith("prune: parameters ")]  # prune's own summary line (issue 59)


def test_inspect_and_prune_of_a_tower_family_are_quiet(vl, tmp_path):
    assert _stderr_lines(["inspect", vl[0]], tmp_path) == []
    assert _stderr_lines(["prune", vl[0], tmp_path / "p", "--scores", vl[1], "--ffn-size", "24"], tmp_path) == []
