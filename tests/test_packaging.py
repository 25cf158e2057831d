"""The install puts one name on a user's path (issue 26): `pip install --target DIR .` leaves remodel/
(with models, compress, upcycle, pipelines, data and cli inside) and its metadata, no top-level models,
data, cli, pipelines, compress or upcycle; the installed copy runs from anywhere."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERIC = {"models", "data", "cli", "cli.py", "pipelines", "compress", "upcycle"}


def test_install_target_has_one_namespace(tmp_path):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    top = {p.name for p in target.iterdir()}
    assert not top & GENERIC, top
    assert {"models", "compress", "upcycle", "pipelines", "data", "cli.py"} <= {p.name for p in (target / "remodel").iterdir()}
    tasks = {p.name for p in (target / "remodel" / "data" / "tasks").iterdir()}  # eval --tasks' shipped set
    assert {"remodel_cloze.yaml", "cloze.jsonl", "remodel_nextphrase.yaml", "nextphrase.jsonl"} <= tasks, tasks
    recipes = {p.name for p in (target / "remodel" / "data" / "recipes").iterdir()}  # `remodel run NAME`
    assert {"shrink-56b-47b.yaml", "dense-to-moe.yaml"} <= recipes, recipes
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = ("import remodel.cli, remodel.models.model, remodel.pipelines.training.trainer, sys; "
            "print(remodel.cli.__file__); "
            "import importlib.util as u; sys.exit(any(u.find_spec(m) for m in ('models', 'pipelines', 'cli')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0 and str(target) in r.stdout, r.stdout + r.stderr
