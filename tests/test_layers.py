"""The package layering holds: `lint-imports` (import-linter, contracts in pyproject.toml's
[tool.importlinter]) passes, and no package imports the top-level `cli` module (import-linter takes
packages only as roots, so `cli`, the top layer, is checked here instead)."""
import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("models", "compress", "upcycle", "pipelines", "data")


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    cmd = [str(lint)] if lint.exists() else [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]
    r = subprocess.run(cmd + ["--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_no_package_imports_cli():
    offenders = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}"
                              for n in names if n == "cli" or (n or "").startswith("cli.")]
    assert not offenders, offenders
