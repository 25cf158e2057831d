"""`remodel run RECIPE` (issue 59, Deliver 2): the shipped recipes run end to end on the embedded checkpoint and
their outputs load; a run killed (SIGKILL) during a later step resumes from its last complete step, which it
skips; --dry-run prints the shell-quoted commands and writes nothing; a bad recipe (hostile input) is one error
line naming the step and field, exit 2, and no workdir."""
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remodel import cli
from remodel.models.hf import config_from_hf
from remodel.models.params import count_params
from tests.cli_contract import fails

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "data" / "embedded"


def _run(capsys, *argv) -> tuple[dict, str]:
    """`remodel run ...` in-process -> (WORKDIR/recipe_report.json, stderr)."""
    capsys.readouterr()
    assert cli.main(["run", *map(str, argv)]) == 0
    err = capsys.readouterr().err
    work = Path(argv[argv.index("--workdir") + 1])
    return json.loads((work / "recipe_report.json").read_text()), err


def _params(model: Path) -> int:
    hf = json.loads((model / "config.json").read_text())
    return count_params(config_from_hf(hf), hf["model_type"])["total"]


def _status(report: dict) -> dict:
    return {s["name"]: s["status"] for s in report["steps"]}


def test_shrink_recipe_end_to_end_then_every_step_skipped(tmp_path, capsys):
    work = tmp_path / "w"
    report, err = _run(capsys, "shrink-56b-47b", "--workdir", work)
    assert report["status"] == "complete" and set(_status(report).values()) == {"ran"}
    assert list(_status(report)) == ["plan-56b", "score", "plan", "prune", "distill", "eval"]
    big = json.loads((work / "plan-56b" / "plan.json").read_text())  # the 56B plan, on the shipped config
    assert big["candidates"][0]["params"] <= 47e9
    row = json.loads((work / "plan" / "plan.json").read_text())["candidates"][0]
    assert _params(work / "prune") == _params(work / "distill") == row["params"] < _params(EMBEDDED)
    from transformers import AutoModelForCausalLM  # the distilled model loads without remote code
    hf = AutoModelForCausalLM.from_pretrained(work / "distill", trust_remote_code=False, local_files_only=True)
    assert sum(p.numel() for p in hf.parameters()) == row["params"]
    ev = json.loads((work / "eval" / "remodel_report.json").read_text())
    assert ev["command"] == "eval" and ev["tokens"] == 8192 and math.isfinite(ev["ppl"]) and ev["ppl"] > 1
    assert "[6/6] eval: done in" in err and "ppl " in err and "run: 6 steps (6 ran, 0 skipped)" in err
    again, err = _run(capsys, "shrink-56b-47b", "--workdir", work)
    assert set(_status(again).values()) == {"skipped"} and "[4/6] prune: skipped, complete" in err


def test_dense_to_moe_recipe_end_to_end(tmp_path, capsys):
    work = tmp_path / "w"
    report, _ = _run(capsys, "dense-to-moe", "--workdir", work)
    assert _status(report) == {"upcycle": "ran", "train": "ran", "eval": "ran"}
    cfg = json.loads((work / "train" / "config.json").read_text())
    assert cfg["n_routed_experts"] == 16 and cfg["num_experts_per_tok"] == 8  # README's defaults: G = 4, top-k 2G
    assert _params(work / "train") == _params(work / "upcycle") > _params(EMBEDDED)
    assert json.loads((work / "train" / "remodel_report.json").read_text())["steps"] == 6
    assert math.isfinite(json.loads((work / "eval" / "remodel_report.json").read_text())["ppl"])
    made = {n: (work / n / "remodel_report.json").stat().st_mtime_ns for n in ("upcycle", "train")}
    again, err = _run(capsys, "dense-to-moe", "--workdir", work, "--from", "train")  # outputs replaced from train on
    assert _status(again) == {"upcycle": "skipped", "train": "ran", "eval": "ran"} and "--overwrite" in err
    now = {n: (work / n / "remodel_report.json").stat().st_mtime_ns for n in ("upcycle", "train")}
    assert now["upcycle"] == made["upcycle"] and now["train"] > made["train"]
    edited = tmp_path / "r.yaml"  # a step whose command line changed since its output: run again from there
    edited.write_text((ROOT / "data" / "recipes" / "dense-to-moe.yaml").read_text().replace("8192", "4096"))
    again, err = _run(capsys, edited, "--workdir", work)
    assert _status(again) == {"upcycle": "skipped", "train": "skipped", "eval": "ran"}
    assert json.loads((work / "eval" / "remodel_report.json").read_text())["tokens"] == 4096
    fails(capsys, "run", "dense-to-moe", "--workdir", work, "--from", "evl", match="--from evl: no such step")


def test_killed_run_resumes_from_its_last_complete_step(tmp_path, capsys):
    """SIGKILL once the train step has started (its run folder appears); the rerun skips upcycle, untouched."""
    work = tmp_path / "w"
    log = (tmp_path / "log").open("w")
    p = subprocess.Popen([sys.executable, "-m", "remodel.cli", "run", "dense-to-moe", "--workdir", str(work)],
                         cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log, stderr=log)
    t0 = time.time()
    while p.poll() is None and not (work / "train.run").exists() and time.time() - t0 < 120:
        time.sleep(0.02)
    killed = p.poll() is None
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert killed, (tmp_path / "log").read_text()[-2000:]
    assert not (work / "train").exists()
    before = json.loads((work / "recipe_report.json").read_text())
    assert before["status"] == "running" and _status(before) == {"upcycle": "ran", "train": "pending",
                                                                  "eval": "pending"}
    made = (work / "upcycle" / "remodel_report.json").stat().st_mtime_ns
    report, err = _run(capsys, "dense-to-moe", "--workdir", work)
    assert _status(report) == {"upcycle": "skipped", "train": "ran", "eval": "ran"}
    assert report["status"] == "complete" and "[1/3] upcycle: skipped, complete" in err
    assert (work / "upcycle" / "remodel_report.json").stat().st_mtime_ns == made
    assert (work / "eval" / "remodel_report.json").is_file() and not (work / ".lock").exists()


def test_dry_run_prints_the_commands_and_writes_nothing(tmp_path, capsys):
    work = tmp_path / "w"
    capsys.readouterr()
    assert cli.main(["run", "shrink-56b-47b", "--workdir", str(work), "--dry-run"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("remodel ")]
    assert len(lines) == 6 and not work.exists() and list(tmp_path.iterdir()) == []
    prune = shlex.split(lines[3])
    assert prune[:4] == ["remodel", "prune", str(EMBEDDED), str(work / "prune")]
    assert prune[prune.index("--plan") + 1] == str(work / "plan" / "plan.json")
    a = cli.build_parser().parse_args(prune[1:])  # the printed line is the command's own
    assert (a.candidate, a.scores) == (1, str(work / "score"))
    assert shlex.split(lines[4])[1:3] == ["distill", str(work / "distill")]


def _recipe(tmp_path, steps: str, head: str = "workdir: {w}\n") -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(head.format(w=tmp_path / "w") + "steps:\n" + steps)
    return p


UPCYCLE = "  - name: up\n    command: upcycle\n    options: {model: builtin:embedded, experts: 8}\n"
BAD = {  # recipe steps -> what the one error line names
    "unknown option": (UPCYCLE.replace("experts: 8", "experts: 8, expert: 3"),
                       "step 'up' (upcycle) option 'expert': unknown (did you mean 'experts'?)"),
    "unknown command": ("  - {name: x, command: finetune}\n", "unknown command 'finetune'"),
    "missing reference": (UPCYCLE + "  - name: ev\n    command: eval\n    options: {model: '${steps.upp.out}'}\n",
                          "${steps.upp.out} names no earlier step (earlier: up)"),
    "later reference": ("  - name: ev\n    command: eval\n    options: {model: '${steps.up.out}'}\n" + UPCYCLE,
                        "names no earlier step (earlier: none)"),
    "wrong type": (UPCYCLE.replace("experts: 8", "experts: [8]"), "option 'experts': expected a string, a number"),
    "bad value": (UPCYCLE.replace("experts: 8", "experts: eight"), "argument --experts: invalid int value"),
    "rule": (UPCYCLE.replace("experts: 8", "experts: 8, top-k: 9"), "top_k must be at most --experts=8"),
    "out given": (UPCYCLE.replace("experts: 8", "experts: 8, out: x"), "'out': set by the recipe"),
    "switch": (UPCYCLE.replace("experts: 8", "experts: 8, exact: 1"), "'exact': a switch, true or false"),
    "duplicate key": (UPCYCLE.replace("experts: 8", "experts: 8, experts: 4"), "repeated key 'experts'"),
    "step key": (UPCYCLE + "    option: {}\n", "step 1: unknown key 'option'"),
    "missing required": ("  - {name: up, command: upcycle, options: {model: builtin:embedded}}\n",
                         "required: --experts"),
    "builtin escape": (UPCYCLE.replace("builtin:embedded", "builtin:../cli.py"),
                       "builtin:../cli.py is no shipped file"),
    "same name": (UPCYCLE + UPCYCLE, "name 'up' is used by an earlier step"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_recipe_is_one_line_and_writes_nothing(tmp_path, capsys, case):
    steps, match = BAD[case]
    line = fails(capsys, "run", _recipe(tmp_path, steps), match=match)
    assert not (tmp_path / "w").exists(), line


@pytest.mark.parametrize("text,match", [("workdir: w\nsteps: []\n", "'steps' is empty"),
                                        ("steps: {a: 1}\n", "'steps' must be a list"),
                                        ("- 1\n", "expected a mapping"), ("steps: [\n", "not a valid YAML recipe"),
                                        ("workdir: w\nstep: []\n", "unknown key 'step'"),
                                        ("steps:\n  - {name: a, command: inspect, options: {model: x}}\n",
                                         "give 'workdir'")])
def test_bad_recipe_file_is_one_line(tmp_path, capsys, text, match):
    (tmp_path / "r.yaml").write_text(text)
    fails(capsys, "run", tmp_path / "r.yaml", match=match)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def test_unknown_recipe_names_the_shipped_ones(tmp_path, capsys):
    fails(capsys, "run", tmp_path / "nope.yaml", match="shipped: dense-to-moe, shrink-56b-47b")


def test_readme_example_recipe_is_valid(tmp_path, capsys):
    """README's example recipe passes every check (a dry run prints its two commands)."""
    text = (ROOT / "README.md").read_text().split("### Recipes", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "r.yaml").write_text(text)
    capsys.readouterr()
    assert cli.main(["run", str(tmp_path / "r.yaml"), "--workdir", str(tmp_path / "w"), "--dry-run"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("remodel ")]
    assert [shlex.split(ln)[1] for ln in lines] == ["prune", "eval"] and not (tmp_path / "w").exists()


def test_second_run_on_a_workdir_in_use_is_refused(tmp_path, capsys):
    from remodel.pipelines.distributed.runtime import RunLock
    work = tmp_path / "w"
    lock = RunLock(work, work).acquire()  # as a run in progress holds it
    try:
        fails(capsys, "run", "dense-to-moe", "--workdir", work, match="is in use by another run")
    finally:
        lock.release()
    assert not work.exists()


def test_step_that_fails_is_one_line_naming_it_and_the_report_says_so(tmp_path, capsys):
    steps = UPCYCLE + f"  - name: ev\n    command: eval\n    options: {{model: {tmp_path / 'nothing'}, data: x}}\n"
    capsys.readouterr()
    assert cli.main(["run", str(_recipe(tmp_path, steps))]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("remodel run: error: step 'ev' (eval): ") and "Traceback" not in err
    assert sum("error" in ln for ln in err.splitlines()) == 1, err
    report = json.loads((tmp_path / "w" / "recipe_report.json").read_text())
    assert report["status"] == "failed" and _status(report) == {"up": "ran", "ev": "failed"}
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["recipe_report.json", "up"]  # no empty ev/
