"""docs/python-api.md cannot rot (issue 59, item 7): its example runs as written on the embedded checkpoint, its
error example prints the line it says, and its table names every command, an importable function for each and
every options dataclass."""
import importlib
import math
import re
import tempfile
from pathlib import Path

from remodel.pipelines.commands.configs import COMMAND_OPTIONS

DOC = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_example_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the example's mkdtemp lands here
    ns = {"__name__": "python_api_example"}
    exec(compile(blocks()[0], str(DOC), "exec"), ns)
    out = capsys.readouterr().out
    assert 3_000_000 < ns["source"] < 3_400_000  # 3.36M
    assert ns["pruned"]["params_after"]["total"] == ns["shapes"]["candidates"][0]["params"] < 3_000_000
    assert len(ns["report"]["history"]) == 4 and math.isfinite(ns["ppl"]) and ns["ppl"] > 1
    assert f"distilled ppl {ns['ppl']:.1f}" in out
    work = ns["work"]
    assert work.parent == tmp_path
    assert {"plan.json", "scores", "pruned", "distilled"} <= {p.name for p in work.iterdir()}


def test_error_example_prints_its_line(capsys):
    exec(compile(blocks()[1], str(DOC), "exec"), {"__name__": "python_api_errors"})
    out = capsys.readouterr().out
    said = re.search(r"print\(e\)  # (.*)", blocks()[1]).group(1)
    assert out == said + "\n"


def test_table_names_every_command_function_and_options_class():
    text = DOC.read_text()
    rows = [r for r in text.splitlines() if r.startswith("| `")]
    commands = {c.strip(" `") for r in rows for c in r.split("|")[1].split(",")}
    assert set(COMMAND_OPTIONS) | {"train", "distill", "run"} == commands
    for cls in list(COMMAND_OPTIONS.values()) + ["TrainConfig", "RunOptions"]:
        assert f"`{getattr(cls, '__name__', cls)}`" in text
    for r in rows:
        path = re.search(r"`(remodel\.[\w.]+)\(", r).group(1)
        module, name = path.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), name)), path
