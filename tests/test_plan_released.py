"""`plan` on a shipped config shows the released pruned shapes of it (issue 59, item 1): NVIDIA's Nemotron-H 47B
from 56B and 4B from 8B, each counted by models.params from the source config with the released widths and
layers, marked "released", only when it meets the budgets."""
import json
from pathlib import Path

from remodel import cli
from remodel.models.hf import config_from_hf
from remodel.models.params import count_params
from remodel.pipelines.commands.plan import candidate_config, plan

CONFIGS = Path(__file__).resolve().parents[1] / "models" / "configs"


def shipped(name):
    return config_from_hf(json.loads((CONFIGS / f"{name}.json").read_text()))


def test_56b_plan_shows_the_released_47b(capsys):
    assert cli.main(["plan", "nemotron-h-56b", "--params", "47B"]) == 0
    table = capsys.readouterr().out
    row = next(r for r in table.splitlines() if r.lstrip().startswith("released "))
    assert "46.792B" in row and " 8192 " in row and " 30720 " in row and " 98 " in row and "--ffn-size 30720" in row
    assert "released: nemotron-h-47b" in table
    src, pub = shipped("nemotron-h-56b"), shipped("nemotron-h-47b")
    d = plan("nemotron-h-56b", params=47e9, verbose=False)
    (r,) = d["released"]
    assert r["released"] == "nemotron-h-47b" and r["params"] == 46_791_554_816
    assert r["widths"]["hidden_size"] == 8192 and r["widths"]["ffn_size"] == 30720
    assert r["pattern"] == pub.pattern and r["layers_removed"] == {"mamba": 9, "mlp": 6, "attention": 5}
    new = candidate_config(src, r)  # the source with the row's widths and layers is the released config
    assert {k: v for k, v in new.to_dict().items() if k != "extra"} == \
        {k: v for k, v in pub.to_dict().items() if k != "extra"}
    assert count_params(new)["total"] == count_params(pub)["total"] == r["params"]
    assert r["under_budget"]["params"] == 47_000_000_000 - 46_791_554_816
    # below its count it is not shown; neither is anything for a source that is no shipped config
    assert plan("nemotron-h-56b", params=46.7e9, verbose=False)["released"] == []
    assert plan(src, params=47e9, verbose=False)["released"] == []


def test_8b_plan_shows_the_released_4b():
    d = plan("nemotron-h-8b", params=4.5e9, axes="width", verbose=False)
    (r,) = d["released"]
    assert r["released"] == "nemotron-h-4b" and r["params"] == 4_489_223_040 and r["drop_layers"] == []
    assert r["prune_targets"] == {"hidden_size": 3072, "ffn_size": 12288, "mamba_heads": 112}
