"""`remodel plan --out PLAN` -> `remodel prune MODEL OUT --plan PLAN [--candidate K]` (issue 59, item 1): the
written model's parameter count is the plan row's; PLAN is refused in one line naming --plan when it is not a
plan for this model (hostile input), before anything is written."""
import json
from pathlib import Path

import pytest

from remodel import cli
from remodel.models.hf import config_from_hf
from remodel.models.params import count_params

EMBEDDED = Path(__file__).resolve().parents[1] / "data" / "embedded"  # 3.36M parameters, dense (M-M*M-M-)


def _plan(tmp_path, capsys, *extra) -> tuple[Path, dict, str]:
    p = tmp_path / "plan.json"
    assert cli.main(["plan", str(EMBEDDED), "--params", "3M", "--top", "3", "--out", str(p), *extra]) == 0
    return p, json.loads(p.read_text()), capsys.readouterr().out


def _written_params(out: Path) -> int:
    hf = json.loads((out / "config.json").read_text())
    return count_params(config_from_hf(hf), hf["model_type"])["total"]


def test_plan_to_weights_count_equals_the_row(tmp_path, capsys):
    plan, doc, table = _plan(tmp_path, capsys)
    rows = doc["candidates"]
    first = rows[0]
    assert first["changed"] and first["drop_layers"]  # 3M cuts a width and a layer of the 3.36M model
    for c in rows:  # each printed row carries the command that writes it
        assert f"remodel prune {EMBEDDED} OUT --plan {plan} --candidate {c['rank']}" in table
    assert not {"experts", "expert_ffn_size", "shared_expert_size"} & (set(first["widths"]) | set(doc["space"]))
    assert cli.main(["prune", str(EMBEDDED), str(tmp_path / "o1"), "--plan", str(plan)]) == 0
    assert _written_params(tmp_path / "o1") == first["params"]
    report = json.loads((tmp_path / "o1" / "remodel_report.json").read_text())
    assert report["pattern_after"] == first["pattern"]  # no --scores: the plan's layers exactly
    assert cli.main(["prune", str(EMBEDDED), str(tmp_path / "o2"), "--plan", str(plan), "--candidate", "2"]) == 0
    assert _written_params(tmp_path / "o2") == rows[1]["params"]


def test_existing_plan_needs_overwrite(tmp_path, capsys):
    plan, _, _ = _plan(tmp_path, capsys)
    plan.write_text("keep")
    assert cli.main(["plan", str(EMBEDDED), "--params", "3M", "--out", str(plan)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--overwrite" in err and plan.read_text() == "keep"
    _plan(tmp_path, capsys, "--overwrite")
    assert json.loads(plan.read_text())["format"] == "remodel-plan"


def _edit(doc, path):
    """Mutations of a valid plan, each a file prune must refuse."""
    c = doc["candidates"][0]
    return {
        "not json": lambda: path.write_text("{nope"),
        "nan": lambda: path.write_text(json.dumps(doc).replace(str(c["params"]), "NaN", 1)),
        "not a plan": lambda: path.write_text(json.dumps({"candidates": doc["candidates"]})),
        "huge": lambda: path.open("wb").truncate(65 * 1024**2),
        "width type": lambda: (c["widths"].update(ffn_size="512"), path.write_text(json.dumps(doc))),
        "drop range": lambda: (c.update(drop_layers=[99]), path.write_text(json.dumps(doc))),
        "edited count": lambda: (c.update(params=c["params"] + 1), path.write_text(json.dumps(doc))),
        "other model": lambda: (doc["config"].update(hidden_size=512), path.write_text(json.dumps(doc))),
        "no rows": lambda: (doc.update(candidates=[]), path.write_text(json.dumps(doc))),
    }


BAD = ["not json", "nan", "not a plan", "huge", "width type", "drop range", "edited count", "other model", "no rows"]


@pytest.mark.parametrize("what", BAD)
def test_hostile_plan_is_one_line_nothing_written(what, tmp_path, capsys):
    plan, doc, _ = _plan(tmp_path, capsys)
    _edit(doc, plan)[what]()
    out = tmp_path / "out"
    assert cli.main(["prune", str(EMBEDDED), str(out), "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"--plan {plan}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no OUT, no sibling


def test_candidate_out_of_range_and_flags_beside_plan(tmp_path, capsys):
    plan, _, _ = _plan(tmp_path, capsys)
    assert cli.main(["prune", str(EMBEDDED), str(tmp_path / "o"), "--plan", str(plan), "--candidate", "4"]) == 2
    assert "--candidate 4" in capsys.readouterr().err
    assert cli.main(["prune", str(EMBEDDED), str(tmp_path / "o"), "--plan", str(plan), "--ffn-size", "512"]) == 2
    assert "--ffn-size" in capsys.readouterr().err and not (tmp_path / "o").exists()
