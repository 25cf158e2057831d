"""Task folders are hostile input (issue 53): `--task-dir` runs no code from the folder unless
--trust-task-code is given (`!function`, custom datasets and filters, `include:` outside the folder, Python
YAML tags, dataset folders), templates render in jinja's sandbox, hangs (billion laughs, huge repeats, a
FIFO) end at once, and every fault is one line naming the file (exit 2, no traceback), before MODEL is
loaded or OUT written."""
import dataclasses
import json
import os
import time

import pytest

from remodel.models.errors import RemodelError
from tests.cli_contract import fails
from tests.conftest import FAMILY_CONFIGS, random_model, write_checkpoint

pytest.importorskip("lm_eval")

ROWS = [{"context": f"item {i} says", "choices": ["red", "green", "blue", "gold"], "label": i % 4}
        for i in range(6)]
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
# the module a !function imports: importing it, or calling f, leaves MARKER beside it
UTILS = """import pathlib
pathlib.Path(__file__).with_name("MARKER").touch()
def f(dataset, *a):
    pathlib.Path(__file__).with_name("MARKER").touch()
    return dataset
def ds(**kw):
    raise SystemExit("custom dataset ran")
"""


def folder(root, extra: str = "", rows=None, name="t", data="d.jsonl", utils=True, raw=None):
    """A task folder: t.yaml (TASK plus `extra` fields, or `raw` text), its JSONL and utils.py."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (ROWS if rows is None else rows)))
    (root / "t.yaml").write_text(raw if raw is not None else TASK.format(name=name, data=data) + extra)
    if utils:
        (root / "utils.py").write_text(UTILS)
    return root


def eval_fails(capsys, tmp_path, d, *more, task="t", match=None, model=None):
    """`remodel eval` on a missing (or given) model with --task-dir d: one error line; no MARKER anywhere."""
    line = fails(capsys, "eval", model or tmp_path / "no_model", "--tasks", task, "--task-dir", d, *more,
                 match=match)
    assert not list(tmp_path.rglob("MARKER")), "code from the task folder ran"
    return line


@pytest.fixture(scope="module", autouse=True)
def warm():
    """lm-eval imported once (~10 s) so the timed cases time the check alone."""
    from remodel.pipelines.training.tasks import _lm_eval
    _lm_eval()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny llama checkpoint with the shipped tokenizer (vocab 2048)."""
    cfg = dataclasses.replace(FAMILY_CONFIGS["llama"], vocab_size=2048)
    return write_checkpoint(random_model(cfg, seed=1, std=0.5), tmp_path_factory.mktemp("m") / "llama",
                            family="llama")


# ---- code from the folder is refused without --trust-task-code -------------------------------------------

CODE = {
    "process_docs": ("process_docs: !function utils.f\n", "t.yaml:15: !function utils.f runs Python"),
    "custom_dataset": ("custom_dataset: !function utils.ds\n", "!function utils.ds runs Python"),
    "filter": ("filter_list:\n  - name: x\n    filter:\n      - function: !function utils.f\n",
               "t.yaml:18: !function utils.f"),
    "metric": ("process_results: !function utils.f\n", "!function utils.f"),
    "python_tag": ("doc_to_text: !!python/object/apply:os.system ['touch {tmp}/MARKER']\n", "t.yaml:15: not a valid"),
    "dataset_folder": ("dataset_path: ./here\n", "dataset_path './here' is not one of datasets' file readers"),
    "remote_code": ("dataset_kwargs:\n  trust_remote_code: true\n  data_files: d.jsonl\n", "trust_remote_code"),
}


@pytest.mark.parametrize("case", sorted(CODE))
def test_code_in_a_task_yaml_is_refused(case, tmp_path, capsys):
    extra, msg = CODE[case]
    d = folder(tmp_path / "tasks", extra.replace("{tmp}", str(tmp_path)))
    line = eval_fails(capsys, tmp_path, d, match=msg)
    assert "--trust-task-code" in line or case == "python_tag"


def test_function_through_include_is_refused(tmp_path, capsys):
    """A !function reached by include: (a YAML inside the folder; one outside it, refused by its path)."""
    d = folder(tmp_path / "tasks", raw="include: base.yaml\ntask: t\n")
    (d / "base.yaml").write_text(TASK.format(name="base_t", data="d.jsonl") + "process_docs: !function utils.f\n")
    eval_fails(capsys, tmp_path, d, match="base.yaml:15: !function utils.f runs Python")
    out = folder(tmp_path / "elsewhere", utils=True)
    (d / "base.yaml").unlink()
    (d / "t.yaml").write_text("include: ../elsewhere/t.yaml\ntask: t2\n")
    eval_fails(capsys, tmp_path, d, task="t2", match="t.yaml:1: include '../elsewhere/t.yaml' leaves the task folder")
    assert out.exists()


def test_include_cycle_and_depth_are_one_line(tmp_path, capsys):
    d = folder(tmp_path / "tasks", raw="include: t.yaml\ntask: t\n")
    eval_fails(capsys, tmp_path, d, match="includes itself")
    for i in range(2000):  # a chain of includes deeper than Python's recursion limit
        (d / f"i{i}.yaml").write_text(f"include: i{i + 1}.yaml\n")
    (d / "t.yaml").write_text("include: i0.yaml\ntask: t\n")
    eval_fails(capsys, tmp_path, d, match="more than 64 nested includes")
    for p in d.glob("i*.yaml"):
        p.unlink()
    for n in (100, 5000):  # deeper than the bound; deeper than the YAML parser's recursion
        (d / "t.yaml").write_text("task: t\nx: " + "[" * n + "]" * n + "\n")
        eval_fails(capsys, tmp_path, d, match="t.yaml: nested more than 64 levels deep")


def test_template_runs_no_shell_command(tmp_path, capsys):
    """A Jinja template reaching os through lipsum.__globals__ (no .py anywhere) renders in the sandbox."""
    marker = tmp_path / "MARKER"
    extra = f"""doc_to_text: "{{{{ lipsum.__globals__['os'].system('touch {marker}') }}}}"\n"""
    d = folder(tmp_path / "tasks", extra, utils=False)
    eval_fails(capsys, tmp_path, d, match="SecurityError")
    assert not marker.exists()


def test_trust_task_code_runs_the_function_and_scores_as_lm_eval(tmp_path, capsys, model, monkeypatch):
    """With --trust-task-code the !function task runs (MARKER) and its accuracy is lm-eval's own figure."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from remodel import cli
    d = folder(tmp_path / "tasks", "process_docs: !function utils.f\n")
    assert cli.main(["eval", str(model), "--tasks", "t", "--task-dir", str(d), "--trust-task-code"]) == 0
    ours = json.loads(capsys.readouterr().out)["tasks"]["t"]
    assert (d / "MARKER").exists() and ours["samples"] == len(ROWS)
    (d / "MARKER").unlink()
    monkeypatch.chdir(d)  # lm-eval reads a relative data_files from the current directory
    args = {"pretrained": str(model), "dtype": "float32", "device": "cpu", "batch_size": 8}
    theirs = lm_eval.simple_evaluate(model="hf", model_args=args, tasks=["t"], bootstrap_iters=100000,
                                     task_manager=TaskManager(include_path=str(d), include_defaults=False))
    assert ours["acc"] == theirs["results"]["t"]["acc,none"]
    assert ours["acc_stderr"] == theirs["results"]["t"]["acc_stderr,none"]
    assert (d / "MARKER").exists()


def test_trusted_code_waits_for_a_valid_model(tmp_path, capsys):
    """With --trust-task-code a missing MODEL is refused before the folder's code runs."""
    d = folder(tmp_path / "tasks", "process_docs: !function utils.f\n")
    line = eval_fails(capsys, tmp_path, d, "--trust-task-code")
    assert "no_model" in line and "!function" not in line


def test_trust_task_code_needs_tasks(tmp_path, capsys):
    fails(capsys, "eval", tmp_path, "--data", "x.txt", "--trust-task-code",
          match="--trust-task-code applies to --tasks")


# ---- hangs end at once ------------------------------------------------------------------------------------

LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")) + "task: t\n"


@pytest.mark.parametrize("case", ["laughs", "repeats", "fifo", "self_alias", "huge"])
def test_hangs_end_in_one_line_within_10s(case, tmp_path, capsys):
    d = folder(tmp_path / "tasks", "repeats: 100000000\n" if case == "repeats" else "")
    if case == "laughs":
        (d / "t.yaml").write_text(LAUGHS)
    if case == "self_alias":
        (d / "t.yaml").write_text("a: &a [1, *a]\ntask: t\n")
    if case == "huge":
        (d / "t.yaml").write_text("task: t\nx: '" + "y" * (2 << 20) + "'\n")
    if case == "fifo":
        os.mkfifo(d / "x.yaml")
    msg = {"laughs": "more than 100000 values once its aliases are expanded", "fifo": "x.yaml: not a regular file",
           "repeats": "t.yaml:15: repeats must be an integer in [1, 1000]", "self_alias": "refers to itself",
           "huge": "bytes, more than"}[case]
    t0 = time.monotonic()
    eval_fails(capsys, tmp_path, d, match=msg)
    assert time.monotonic() - t0 < 10


# ---- every task fault is one line, before the model -------------------------------------------------------

FAULTS = {
    "truncated_jsonl": (dict(rows=None), "truncate", "d.jsonl:6: not a JSON line"),
    "broken_json": (dict(data="d.json"), "json", "t.yaml: task 't': DatasetGenerationError"),
    "empty_data": (dict(rows=[]), "", "d.jsonl is empty: no documents"),
    "empty_choices": (dict(rows=[{"context": "c", "choices": [], "label": 0}]), "",
                      "t.yaml:9: task 't': item 0 (doc_to_choice): no choices"),
    "label_past_end": (dict(rows=[{"context": "c", "choices": ["a", "b"], "label": 2}]), "",
                       "item 0 (doc_to_target): label 2 is not an index in [0, 1]"),
    "label_negative": (dict(rows=[{"context": "c", "choices": ["a", "b"], "label": -1}]), "",
                       "label '-1' is neither an index nor one of its 2 choices"),
    "label_not_a_choice": (dict(rows=[{"context": "c", "choices": ["a", "b"], "label": "zebra"}]), "",
                           "label 'zebra' is neither an index"),
    "label_nan": (dict(rows=None), "nan", "t.yaml:10: task 't': item 0 (doc_to_target): label 'nan' is"),
    "missing_label": (dict(rows=[{"context": "c", "choices": ["a", "b"]}]), "", "UndefinedError"),
    "unknown_metric": (dict(extra="metric_list:\n  - metric: nope\n"), "", "unknown metric 'nope'"),
    "unknown_output_type": (dict(extra="output_type: poem\n"), "", "output_type 'poem' is not one of"),
    "huge_fewshot": (dict(extra="num_fewshot: 100000000\n"), "", "num_fewshot must be an integer"),
    "more_shots_than_docs": (dict(extra="num_fewshot: 10\nfewshot_split: test\n"), "", "few-shot documents"),
    "huge_gen": (dict(extra="output_type: generate_until\ngeneration_kwargs:\n  max_gen_toks: 100000000\n"), "",
                 "generation_kwargs.max_gen_toks must be an integer"),
    "data_not_beside": (dict(data="sub/d.jsonl"), "", "t.yaml:3: data_files 'sub/d.jsonl': no file matches it beside"),
    "duplicate_name": (dict(), "dup", "is also declared by"),
    "shipped_name": (dict(name="remodel_cloze"), "", "task 'remodel_cloze' is also declared by"),
    "group_cycle": (dict(), "cycle", "contains itself"),
}


@pytest.mark.parametrize("case", sorted(FAULTS))
def test_task_faults_are_one_line_before_the_model(case, tmp_path, capsys, monkeypatch):
    kw, how, msg = FAULTS[case]
    d = folder(tmp_path / "tasks", **kw)
    if how == "truncate":
        (d / "d.jsonl").write_text((d / "d.jsonl").read_text()[:-20])
    if how == "json":
        (d / "d.json").write_text('[{"context": "c", "choices": ["a"], "label": 0}, {"cont')
    if how == "nan":
        (d / "d.jsonl").write_text('{"context": "c", "choices": ["a", "b"], "label": NaN}\n')
    if how == "dup":
        (d / "u.yaml").write_text(TASK.format(name="t", data="d.jsonl"))
    if how == "cycle":
        (d / "g.yaml").write_text("group: g\ntask: [t, h]\n")
        (d / "h.yaml").write_text("group: h\ntask: [g]\n")
    monkeypatch.chdir(tmp_path)  # a data_files "sub/d.jsonl" exists here, not beside the YAML
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.jsonl").write_text((d / "d.jsonl").read_text())
    eval_fails(capsys, tmp_path, d, task="g" if how == "cycle" else "t" if case != "shipped_name"
               else "remodel_cloze", match=msg)


def test_relative_data_files_are_read_beside_the_yaml(tmp_path, monkeypatch):
    from remodel.pipelines.training.tasks import check_tasks
    d = folder(tmp_path / "tasks" / "deep", data="d.jsonl")
    monkeypatch.chdir(tmp_path)
    _, (spec,) = check_tasks(["t"], tmp_path / "tasks")
    assert spec["dataset_kwargs"]["data_files"]["test"] == str(d / "d.jsonl")


def test_a_group_yaml_runs(tmp_path, capsys, model):
    """A plain group YAML (group: and a task: list) runs its members, each from its own data beside it."""
    from remodel import cli
    d = folder(tmp_path / "tasks")
    folder(d / "other", name="t2", rows=ROWS[:4], utils=False)
    (d / "g.yaml").write_text("group: g\ntask: [t, t2]\n")
    assert cli.main(["eval", str(model), "--tasks", "g", "--task-dir", str(d)]) == 0
    r = json.loads(capsys.readouterr().out)["tasks"]
    assert r["t"]["samples"] == len(ROWS) and r["t2"]["samples"] == 4


def test_lm_eval_faults_at_run_time_are_one_line(tmp_path, monkeypatch, model):
    """An exception inside lm-eval while the model runs is a RemodelError line, not a traceback."""
    import lm_eval

    from remodel.pipelines.training import tasks
    d = folder(tmp_path / "tasks", utils=False)
    checked = tasks.check_tasks(["t"], d)
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda *a, **k: [][1])
    with pytest.raises(RemodelError, match=r"lm-eval on t: IndexError: list index out of range"):
        tasks.run_tasks(model, [], checked=checked)


def test_prune_and_search_refuse_a_code_folder_before_writing(tmp_path, capsys, model):
    """prune --tasks and search --tasks refuse the folder's !function before OUT exists."""
    import gzip

    from remodel.models.load import load_config
    from remodel.models.params import count_params
    from remodel.pipelines.data.data import embedded_corpus
    d = folder(tmp_path / "tasks", "process_docs: !function utils.f\n")
    fails(capsys, "prune", model, tmp_path / "p", "--scores", tmp_path / "s", "--ffn-size", "20", "--tasks", "t",
          "--task-dir", d, match="!function utils.f runs Python")
    data = tmp_path / "data.txt"
    with gzip.open(embedded_corpus()[0], "rt") as f:
        data.write_text("".join(next(f) for _ in range(200)))
    budget = str(int(0.9 * count_params(load_config(model))["total"]))
    fails(capsys, "search", model, tmp_path / "s2", "--data", data, "--params", budget, "--top", "2", "--candidates",
          "1", "--seq-len", "32", "--tasks", "t", "--task-dir", d, match="!function utils.f runs Python")
    assert not (tmp_path / "p").exists() and not (tmp_path / "s2").exists()
    assert not list(tmp_path.rglob("MARKER"))
