"""Depth pruning that removes every attention layer (issue 59, item 6): refused in one line naming
--allow-attention-free before anything is written; with the flag it proceeds, and --tasks scores the
attention-free result (transformers' hybrid cache cannot count tokens without an attention layer)."""
import json
from pathlib import Path

import pytest

from remodel import cli

EMBEDDED = Path(__file__).resolve().parents[1] / "data" / "embedded"  # pattern M-M*M-M-: one attention layer


@pytest.fixture(scope="module")
def scores(tmp_path_factory):
    s = tmp_path_factory.mktemp("scores") / "S"
    assert cli.main(["score", str(EMBEDDED), "--method", "magnitude", "--out", str(s)]) == 0
    return s


@pytest.mark.parametrize("depth", [["--num-layers", "6"], ["--drop-layers", "3"]])
def test_removing_every_attention_layer_is_refused_in_one_line(depth, scores, tmp_path, capsys):
    capsys.readouterr()
    out = tmp_path / "O"
    assert cli.main(["prune", str(EMBEDDED), str(out), "--scores", str(scores), *depth]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--allow-attention-free" in err and "M-M*M-M-" in err
    assert list(tmp_path.iterdir()) == []  # no OUT, no temporary sibling


def test_attention_free_allowed_and_tasks_score_it(scores, tmp_path, capsys):
    out = tmp_path / "O"
    argv = ["prune", str(EMBEDDED), str(out), "--scores", str(scores), "--num-layers", "6", "--allow-attention-free",
            "--tasks", "remodel_cloze", "--limit", "8"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    report = json.loads((out / "remodel_report.json").read_text())
    assert report["pattern_after"] == "M-M-M-"
    acc = report["tasks"]["remodel_cloze"]
    assert acc["samples"] == 8 and 0 <= acc["acc"] <= 1
    assert cli.main(["eval", str(out), "--tasks", "remodel_cloze", "--limit", "8"]) == 0  # eval scores it too
    assert json.loads(capsys.readouterr().out)["tasks"]["remodel_cloze"]["acc"] == acc["acc"]
