"""`remodel search MODEL OUT --data D --plan PLAN [--candidate K]` (issue 59, item 1): search ranks the plan's
candidates (or the one picked) instead of a budget's, layers placed by the scores as `prune --plan` places
them; the written model's parameter count is its plan row's. Refusals are one line, nothing written."""
import gzip
import json
from pathlib import Path

import pytest
import torch

from remodel import cli
from remodel.compress.scores import load_scores, save_scores
from remodel.models.config import ModelConfig
from remodel.models.hf import config_from_hf
from remodel.models.params import count_params
from remodel.pipelines.commands.search import search_job
from remodel.pipelines.data.data import embedded_corpus

EMBEDDED = Path(__file__).resolve().parents[1] / "data" / "embedded"  # 3.36M parameters, dense (M-M*M-M-)
KW = dict(seq_len=32, batch=4, score_samples=8, eval_tokens=512, progress=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "data.txt"
    with gzip.open(embedded_corpus()[0], "rt") as f:
        p.write_text("".join(next(f) for _ in range(300)))
    return p


@pytest.fixture()
def plan_file(tmp_path, capsys):
    p = tmp_path / "plan.json"
    assert cli.main(["plan", str(EMBEDDED), "--params", "3M", "--top", "3", "--out", str(p)]) == 0
    capsys.readouterr()
    return p, json.loads(p.read_text())["candidates"]


def _written(out: Path) -> tuple[int, str]:
    hf = json.loads((out / "config.json").read_text())
    cfg = config_from_hf(hf)
    return count_params(cfg, hf["model_type"])["total"], cfg.pattern


def test_search_plan_candidate_writes_the_row(tmp_path, data, plan_file):
    plan, rows = plan_file
    assert len({r["params"] for r in rows}) == 3 and rows[2]["drop_layers"]
    out = tmp_path / "one"
    rep = search_job(EMBEDDED, out, data, plan=plan, candidate=3, **KW)
    assert [r["plan_rank"] for r in rep["candidates"]] == [3] and rep["candidates"][0]["chosen"]
    params, pattern = _written(out)
    assert params == rows[2]["params"] == rep["pick"]["params"]
    assert rep["plan"] == {"file": str(plan), "candidate": 3} and rep["budgets"] is None
    # the layers: as many of each type as the row drops, the least important of their type by the scores
    src = json.loads((EMBEDDED / "config.json").read_text())
    src_pattern = config_from_hf(src).pattern
    assert sorted(pattern) == sorted(rows[2]["pattern"])
    s = load_scores(out / "scores")[0]["loss_increase"].tolist()
    drop = rep["candidates"][0]["drop_layers"]
    for ch in set(src_pattern):
        of_type = sorted((i for i, x in enumerate(src_pattern) if x == ch), key=lambda i: (s[i], i))
        n = src_pattern.count(ch) - rows[2]["pattern"].count(ch)
        assert sorted(i for i in drop if src_pattern[i] == ch) == sorted(of_type[:n])
    assert pattern == "".join(x for i, x in enumerate(src_pattern) if i not in drop)


def test_search_plan_ranks_every_row(tmp_path, data, plan_file):
    plan, rows = plan_file
    out = tmp_path / "all"
    rep = search_job(EMBEDDED, out, data, plan=plan, scores=None, **KW)
    got = rep["candidates"]
    assert [r["plan_rank"] for r in got] == [1, 2, 3] and [r["params"] for r in got] == [r["params"] for r in rows]
    pick = min(got, key=lambda r: r["loss"])
    assert pick["chosen"] and _written(out)[0] == pick["params"] == rows[pick["plan_rank"] - 1]["params"]


def test_search_plan_refusals_one_line(tmp_path, data, plan_file, capsys):
    plan, _ = plan_file
    base = ["search", str(EMBEDDED), str(tmp_path / "o"), "--data", str(data)]
    cases = [(["--plan", str(plan), "--params", "3M"], "--plan sets the candidates; drop --params"),
             (["--params", "3M", "--candidate", "2"], "--candidate picks a row of --plan"),
             (["--plan", str(plan), "--candidate", "4"], "--candidate 4"),
             ([], "give a budget")]
    doc = json.loads(plan.read_text())
    doc["candidates"][0]["params"] += 1
    (tmp_path / "edited.json").write_text(json.dumps(doc))
    cases.append((["--plan", str(tmp_path / "edited.json")], f"--plan {tmp_path / 'edited.json'}: candidate 1"))
    other = tmp_path / "other"  # scores of another model
    cfg = ModelConfig(vocab_size=96, hidden_size=16, pattern="M-", mamba_num_heads=4, mamba_head_dim=8,
                      ssm_state_size=8, chunk_size=8, intermediate_size=32)
    save_scores(other, {"hidden": torch.rand(16), "block_importance": torch.rand(2)}, {"config": cfg.to_dict()})
    cases.append((["--plan", str(plan), "--scores", str(other)], "scores were computed for a different model"))
    for extra, want in cases:
        assert cli.main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and want in err, (extra, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edited.json", "other", "plan.json"]
