"""Typed commands (issue 40, Deliver 4): each command's options are one dataclass and its parser is generated from
it; a width declared in models.kinds.WIDTHS is a prune flag and reaches the target check on the --scores path and
the --data path alike (it was silently dropped with --scores when prune() did not name it)."""
import dataclasses
import shutil
from pathlib import Path

import pytest

import remodel.compress.search_space  # noqa: F401 - imported before a test adds a width (it derives its axes once)
from remodel import cli
from remodel.models import kinds
from remodel.models.errors import RemodelError
from remodel.pipelines.commands import prune as prune_mod
from remodel.pipelines.commands.configs import COMMAND_OPTIONS, PruneOptions
from remodel.pipelines.commands.options import from_args
from tests.cli_contract import fails, listing

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "data" / "embedded"
CORPUS = ROOT / "data" / "corpus" / "valid.txt.gz"
# a width declared after prune() was written (a copy of ffn_size's declaration under a new name)
NEW = dataclasses.replace(kinds.WIDTHS["ffn_size"], name="foo_size", help="a width declared after prune() was written")


@pytest.fixture()
def new_width(monkeypatch):
    """A width added to the registry (as a new kind would declare one): WIDTHS and PRUNABLE gain it."""
    monkeypatch.setattr(kinds, "WIDTHS", {**kinds.WIDTHS, NEW.name: NEW})
    monkeypatch.setattr(kinds, "PRUNABLE", kinds.PRUNABLE + (NEW.name,))
    return NEW.name


@pytest.fixture()
def work(tmp_path):
    shutil.copytree(EMBEDDED, tmp_path / "model")
    (tmp_path / "scores").mkdir()
    return tmp_path


def _prune_parser():
    return cli.build_parser()._subparsers._group_actions[0].choices["prune"]


def test_every_width_is_a_prune_flag(new_width):
    flags = {a.dest: a.option_strings for a in _prune_parser()._actions}
    for name in kinds.PRUNABLE:
        assert flags[name] == ["--" + name.replace("_", "-")], name
    a = cli.build_parser().parse_args(["prune", "m", "o", "--scores", "s", "--foo-size", "24", "--ffn-size", "32"])
    assert from_args(PruneOptions, a).widths == {"ffn_size": 32, "foo_size": 24}


@pytest.mark.parametrize("source", ["--scores", "--data"])
def test_new_width_reaches_the_target_check_on_both_paths(work, new_width, monkeypatch, capsys, source):
    seen = []

    def record(cfg, targets, family=None):
        seen.append(dict(targets))
        raise RemodelError("stop here")

    monkeypatch.setattr(prune_mod, "validate_targets", record)
    src = work / "scores" if source == "--scores" else CORPUS
    fails(capsys, "prune", work / "model", work / "o", source, src, "--foo-size", "24", match="stop here")
    assert seen[0]["foo_size"] == 24
    with pytest.raises(RemodelError, match="stop here"):  # the Python API by name, too
        prune_mod.prune(work / "model", work / "o2", **{source[2:] + ("_dir" if source == "--scores" else ""): src},
                        foo_size=16)
    assert seen[1]["foo_size"] == 16


@pytest.mark.parametrize("source", ["--scores", "--data"])
def test_width_the_pruner_lacks_is_refused_on_both_paths(work, new_width, capsys, source):
    before = listing(work)
    src = work / "scores" if source == "--scores" else CORPUS
    line = fails(capsys, "prune", work / "model", work / "o", source, src, "--foo-size", "24", "--ffn-size", "512")
    assert "foo_size" in line
    assert listing(work) == before


@pytest.mark.parametrize("kw", [{"scores_dir": "s"}, {"data": "d"}])
def test_unknown_prune_keyword_refused_on_both_paths(work, kw):
    with pytest.raises(RemodelError, match=r"unknown scoring options.*\['sampels'\]"):
        prune_mod.prune(work / "model", work / "o", ffn_size=512, sampels=4, **kw)
    assert not (work / "o").exists()


def test_plan_axes_accept_every_width_and_refuse_an_unknown_one(work, new_width):
    from remodel.pipelines.commands.plan import plan
    for name in kinds.PRUNABLE[:-1]:  # every real width is an axis (a budget error at most, never "unknown")
        try:
            plan(work / "model", params=2e6, axes=name, top=1, verbose=False)
        except RemodelError as e:
            assert "unknown search axes" not in str(e), (name, str(e))
    with pytest.raises(RemodelError, match=r"unknown search axes \['foo_size'\]"):
        plan(work / "model", params=2e6, axes="foo_size", verbose=False)


@pytest.mark.parametrize("name", sorted(COMMAND_OPTIONS))
def test_parser_is_generated_from_the_options(name):
    """Every CLI field of the dataclass is one argument of the command, with the field's default."""
    cls = COMMAND_OPTIONS[name]
    p = cli.build_parser()._subparsers._group_actions[0].choices[name]
    by_dest = {a.dest: a for a in p._actions}
    for f in dataclasses.fields(cls):
        md = f.metadata
        if md.get("cli", True) is False or md.get("widths"):
            continue
        if md.get("train"):  # TrainConfig's flags that are not the command's own fields (hybridize): TrainConfig's
            from remodel.pipelines.training.train_config import FIELDS, train_flag_names
            names = [n for n in train_flag_names(True) if n not in {g.name for g in dataclasses.fields(cls)}]
            assert names and all(by_dest[n].default == FIELDS[n].default and by_dest[n].help ==
                                 FIELDS[n].metadata["help"] for n in names), name
            continue
        a = by_dest[md.get("negate", f.name)]
        assert a.default == (False if md.get("negate") else md.get("cli_default", f.default)), (name, f.name)
        assert a.help == (md["help"]() if callable(md["help"]) else md["help"]), (name, f.name)


def test_upcycle_and_search_take_their_options_by_name(work):
    from remodel.pipelines.commands.search import search_job
    from remodel.pipelines.commands.upcycle import upcycle
    with pytest.raises(RemodelError, match=r"unknown upcycle options \['expert'\]"):
        upcycle(work / "model", work / "o", experts=8, top_k=2, expert=3)
    with pytest.raises(RemodelError, match=r"unknown search options \['candidats'\]"):  # (candidate: a row of --plan)
        search_job(work / "model", work / "o", CORPUS, params=2e6, candidats=2)
    assert not (work / "o").exists()


@pytest.mark.parametrize("name", sorted(COMMAND_OPTIONS))
def test_every_numeric_flag_has_its_command_rule(name):
    """cli.check_options applies the command's own rules: each numeric flag of the command has one there."""
    from remodel.pipelines.commands.options import parse_count, parse_ints
    p = cli.build_parser()._subparsers._group_actions[0].choices[name]
    rules = cli._options(name)
    numeric = [a.dest for a in p._actions if a.type in (int, float, parse_count, parse_ints)]
    assert numeric or name in ("demo", "inspect", "convert")
    assert [d for d in numeric if d not in rules] == []


def test_upcycle_dtype_by_name_from_the_cli_and_the_api(work, capsys):
    """UpcycleOptions.dtype is a name on the command line and a name or a torch dtype in the API: both write it."""
    import json

    import torch

    from remodel.pipelines.commands.upcycle import upcycle
    argv = ["upcycle", work / "model", work / "cli", "--experts", "4", "--granularity", "2", "--top-k", "2"]
    assert cli.main([str(a) for a in argv + ["--dtype", "float32"]]) == 0
    capsys.readouterr()
    api = upcycle(work / "model", work / "api", experts=4, granularity=2, top_k=2, dtype=torch.float32)
    rep = json.loads((work / "cli" / "remodel_report.json").read_text())
    assert rep["written_dtype"] == api["written_dtype"] == "float32"  # the source is bfloat16
    assert rep["deviation"] == api["deviation"]
