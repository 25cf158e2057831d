"""`remodel eval --tasks`: lm-eval tasks on local data (pipelines/training/tasks.py). Its accuracy equals
lm-eval's own CLI on the same checkpoint, for every family remodel writes; its bad inputs are one line,
before any model is loaded."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from remodel import cli
from remodel.pipelines.training.tasks import TASK_DIR
from remodel.models.families import FAMILIES
from tests.conftest import FAMILY_CONFIGS, random_model, write_checkpoint

LIMIT = 8


def tiny_checkpoint(family, root):
    """A random tiny model of `family` with the shipped tokenizer (vocab 2048, so every id fits); weights
    N(0, 0.5), so its choices differ by more than rounding (at the default 0.15 they nearly tie)."""
    cfg = dataclasses.replace(FAMILY_CONFIGS[family], vocab_size=2048)
    if cfg.moe.n_routed_experts:  # transformers' grouped_mm on CPU wants 16-byte strides
        cfg = dataclasses.replace(cfg, moe_intermediate_size=16)  # (16: also divides glm4 / deepseek shared experts)
    return write_checkpoint(random_model(cfg, seed=1, std=0.5), root / family, family=family)


# every family remodel reads and writes from a model alone (one carrying a vision tower through needs a source
# checkpoint; its text model is its text family's, here, and tests/test_qwen35_vision.py evaluates it)
CLI_FAMILIES = sorted(f for f in FAMILY_CONFIGS if not FAMILIES[f].passthrough)
# lm-eval's own CLI entry, run once per argv in one process; its TaskManager leaves out lm-eval's built-in
# tasks (indexing those ~13 s of CPU per run, and none is run here), as remodel's own TaskManager does
_CLI = """import json, sys
from lm_eval.tasks import TaskManager
init = TaskManager.__init__
TaskManager.__init__ = lambda self, *a, **k: init(self, *a, **{"include_defaults": False, **k})
from lm_eval.__main__ import cli_evaluate
for argv in json.loads(sys.argv[1]):
    sys.argv = ["lm_eval", *argv]
    cli_evaluate()
"""


def lm_eval_cli(model_dirs, tasks, out) -> list[dict]:
    """lm-eval's CLI on each of `model_dirs` (one process), run from the task folder (its data_files are
    relative to it) -> each one's results."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    argvs = [["--model", "hf", "--model_args", f"pretrained={d},trust_remote_code=False,dtype=float32",
              "--device", "cpu", "--batch_size", "8", "--tasks", tasks, "--include_path", str(TASK_DIR),
              "--limit", str(LIMIT), "--output_path", str(out / str(i))] for i, d in enumerate(model_dirs)]
    p = subprocess.run([sys.executable, "-c", _CLI, json.dumps(argvs)], cwd=TASK_DIR, env=env, capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    results = []
    for i in range(len(model_dirs)):
        (path,) = (out / str(i)).rglob("results_*.json")
        results.append(json.loads(path.read_text())["results"])
    return results


def direct_accuracy(model_dir, task, limit) -> float:
    """The multiple-choice accuracy computed here, independently of lm-eval: transformers' model, each
    choice's summed log-probability after the context (tokenised as lm-eval does: the continuation is
    what tokenising context + " " + choice adds after the context's own tokens), the first `limit` items."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in open(TASK_DIR / f"{task.removeprefix('remodel_')}.jsonl")][:limit]
    right = 0
    for r in rows:
        lls = []
        for c in r["choices"]:
            ctx = tok(r["context"], add_special_tokens=False)["input_ids"]
            cont = tok(r["context"] + " " + c, add_special_tokens=False)["input_ids"][len(ctx):]
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                logp = model(ids[:, :-1]).logits.float().log_softmax(-1)[0, len(ctx) - 1:]
            lls.append(logp.gather(-1, torch.tensor(cont)[:, None]).sum().item())
        right += max(range(len(lls)), key=lls.__getitem__) == r["label"]
    return right / len(rows)


def remodel_eval(d, capsys, tasks="remodel_cloze") -> dict:
    """`remodel eval --tasks` -> its report's figures of the first task (all of them with a comma)."""
    assert cli.main(["eval", str(d), "--tasks", tasks, "--limit", str(LIMIT)]) == 0
    out = capsys.readouterr()
    assert all(t in out.err for t in tasks.split(","))  # the table
    r = json.loads(out.out)["tasks"]
    return r if "," in tasks else r[tasks]


@pytest.mark.parametrize("family", CLI_FAMILIES)
def test_eval_tasks_equals_a_direct_computation(family, tmp_path, capsys):
    d = tiny_checkpoint(family, tmp_path)
    ours = remodel_eval(d, capsys)
    assert ours["samples"] == LIMIT
    assert ours["acc"] == pytest.approx(direct_accuracy(d, "remodel_cloze", LIMIT), abs=1e-12)


@pytest.fixture(scope="module")
def lm_eval_runs(tmp_path_factory):
    """{family: (checkpoint, lm-eval CLI's results)} for every family (lm-eval imported once, ~10 s; ~37 s in all)."""
    root = tmp_path_factory.mktemp("lm_eval")
    dirs = [tiny_checkpoint(f, root) for f in CLI_FAMILIES]
    return dict(zip(CLI_FAMILIES, zip(dirs, lm_eval_cli(dirs, "remodel_cloze,remodel_nextphrase", root / "out"))))


@pytest.mark.parametrize("family", CLI_FAMILIES)
def test_eval_tasks_equals_lm_eval_cli(family, lm_eval_runs, capsys):
    d, theirs = lm_eval_runs[family]
    ours = remodel_eval(d, capsys, "remodel_cloze,remodel_nextphrase")
    assert ours["remodel_cloze"]["acc"] == theirs["remodel_cloze"]["acc,none"]
    nl, their_nl = ours["remodel_nextphrase"], theirs["remodel_nextphrase"]
    assert (nl["acc"], nl["acc_norm"]) == (their_nl["acc,none"], their_nl["acc_norm,none"])


def test_prune_tasks_reports_the_result_accuracy(tmp_path, capsys):
    """prune --tasks: the report carries the pruned checkpoint's accuracy and the unpruned one's on the same items,
    the figures eval --tasks gives each, and the summary line prints them before -> after; a bad task name is
    refused before OUT is written."""
    d = tiny_checkpoint("llama", tmp_path)
    assert cli.main(["score", str(d), "--method", "magnitude", "--out", str(tmp_path / "s")]) == 0
    prune = ["prune", str(d), "--scores", str(tmp_path / "s"), "--ffn-size", "20", "--limit", str(LIMIT)]
    assert cli.main([*prune[:2], str(tmp_path / "bad"), *prune[2:], "--tasks", "nope"]) == 2
    assert "unknown task 'nope' (--tasks)" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    assert cli.main([*prune[:2], str(tmp_path / "p"), *prune[2:], "--tasks", "remodel_cloze"]) == 0
    err = capsys.readouterr().err
    full = json.loads((tmp_path / "p" / "remodel_report.json").read_text())
    report, before = full["tasks"]["remodel_cloze"], full["tasks_before"]["remodel_cloze"]
    assert report["samples"] == before["samples"] == LIMIT and report["acc"] == remodel_eval(tmp_path / "p", capsys)["acc"]
    assert before["acc"] == remodel_eval(d, capsys)["acc"]
    assert f"acc remodel_cloze {before['acc']:.3g} -> {report['acc']:.3g}" in err


def test_shipped_tasks_load_with_every_item():
    """Both shipped tasks resolve their JSONL beside the YAML; 150 / 300 four-way items, labels in range."""
    from remodel.pipelines.training.tasks import check_tasks
    _, specs = check_tasks(["remodel_cloze", "remodel_nextphrase"])
    for spec in specs:
        path = spec["dataset_kwargs"]["data_files"]["test"]
        assert os.path.isabs(path)
        rows = [json.loads(line) for line in open(path)]
        assert len(rows) == {"cloze.jsonl": 150, "nextphrase.jsonl": 300}[os.path.basename(path)]
        assert all(len(r["choices"]) == 4 and 0 <= r["label"] < 4 for r in rows)


@pytest.mark.parametrize("args, msg", [
    (["--tasks", "no_such_task"], "unknown task 'no_such_task' (--tasks); the local tasks are: remodel_cloze"),
    (["--tasks", "remodel_cloze", "--task-dir", "{tmp}/missing"], "not a folder of lm-eval task YAMLs (--task-dir)"),
    (["--tasks", ","], "--tasks needs at least one task name"),
    (["--limit", "3"], "nothing to evaluate"),
    (["--data", "x.txt", "--limit", "3"], "--task-dir and --limit apply to --tasks"),
])
def test_bad_task_inputs_are_one_line_before_loading(args, msg, tmp_path, capsys, monkeypatch):
    import remodel.pipelines.training.tasks as tasks
    monkeypatch.setattr(tasks, "run_tasks", lambda *a, **k: pytest.fail("model evaluated"))
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert cli.main(["eval", str(tmp_path / "no_model"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err


def test_missing_lm_eval_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    assert cli.main(["eval", str(tmp_path), "--tasks", "remodel_cloze"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("pip install remodel[eval]") and "\n" not in err


def test_search_tasks_reports_the_written_pick_accuracy(tmp_path, capsys):
    """search --tasks: the report (file and stdout) carries the accuracy of the checkpoint search wrote, the
    figure eval --tasks gives on OUT (not the source's); a bad task name is refused before OUT is written;
    --help names the options and their defaults."""
    import gzip

    from remodel.models.load import load_config
    from remodel.models.params import count_params
    from remodel.pipelines.data.data import embedded_corpus
    d = tiny_checkpoint("llama", tmp_path)
    data = tmp_path / "data.txt"
    with gzip.open(embedded_corpus()[0], "rt") as f:
        data.write_text("".join(next(f) for _ in range(400)))
    budget = str(int(0.9 * count_params(load_config(d))["total"]))
    search = ["search", str(d), "--data", str(data), "--params", budget, "--top", "2", "--candidates", "1",
              "--seq-len", "32", "--batch", "4", "--limit", str(LIMIT)]
    assert cli.main([*search[:2], str(tmp_path / "bad"), *search[2:], "--tasks", "nope"]) == 2
    assert "unknown task 'nope' (--tasks)" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    assert cli.main([*search[:2], str(tmp_path / "bad"), *search[2:]]) == 2  # --limit without --tasks
    assert "--task-dir and --limit apply to --tasks" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    assert cli.main([*search[:2], str(tmp_path / "s"), *search[2:], "--tasks", "remodel_cloze"]) == 0
    out = capsys.readouterr()
    assert "remodel_cloze" in out.err  # the table
    printed = json.loads(out.out[out.out.index("{"):])["tasks"]["remodel_cloze"]
    report = json.loads((tmp_path / "s" / "remodel_report.json").read_text())["tasks"]["remodel_cloze"]
    written, source = remodel_eval(tmp_path / "s", capsys), remodel_eval(d, capsys)
    assert report == printed and report["samples"] == LIMIT
    assert report["acc"] == written["acc"] != source["acc"]
    with pytest.raises(SystemExit):
        cli.main(["search", "--help"])
    h = " ".join(capsys.readouterr().out.split())
    assert "--tasks TASKS comma-separated lm-eval task names run on the written best candidate" in h
    assert "(None: no tasks;" in h and "--limit LIMIT items per task (None: every item)" in h
