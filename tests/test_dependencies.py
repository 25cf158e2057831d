"""pyproject declares exactly what the product imports: every third-party module imported by the
packages (models, compress, upcycle, pipelines, data, cli.py) is a declared dependency or extra, and every
declared runtime dependency or `gpu` / `eval` / `tensorboard` / `wandb` extra is imported somewhere (a package that nothing imports goes).
Modules loaded by name (importlib.import_module, as models/mamba.py does for the GPU kernels, or through
its optional_import) count as imported from the files that use either."""
import ast
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
REPO = Path(__file__).resolve().parents[1]
MODULE_OF = {"mamba-ssm": "mamba_ssm", "causal-conv1d": "causal_conv1d", "lm-eval": "lm_eval", "fla-core": "fla",
             "liger-kernel": "liger_kernel", "pyyaml": "yaml"}  # distribution -> import name
LOCAL = {"models", "compress", "upcycle", "pipelines", "data", "cli"}  # the folders, installed as remodel.*


def _declared():
    proj = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[<>=!~ \[;]", req, maxsplit=1)[0]  # noqa: E731
    runtime = [name(r) for r in proj["dependencies"]]
    extras = [name(r) for x in ("gpu", "eval", "tensorboard", "wandb") for r in proj["optional-dependencies"][x]]
    return {MODULE_OF.get(d, d): d for d in runtime + extras}


def _imported(declared=()):
    """Third-party top-level modules imported by the product; by-name strings count when declared."""
    files = [REPO / "cli.py"] + [f for p in sorted(LOCAL - {"cli"}) for f in (REPO / p).rglob("*.py")]
    mods = set()
    for f in files:
        text = f.read_text()
        for node in ast.walk(ast.parse(text)):
            if ("importlib" in text or "optional_import" in text) and isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.split(".")[0] in declared:
                mods.add(node.value.split(".")[0])
            if isinstance(node, ast.Import):
                mods |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods.add(node.module.split(".")[0])
    return mods - set(sys.stdlib_module_names) - LOCAL - {"remodel"}


def test_imports_and_declarations_agree():
    declared = _declared()
    imported = _imported(declared)
    assert sorted(imported - set(declared)) == [], "imported but not declared in pyproject.toml"
    assert sorted(set(declared) - imported) == [], "declared in pyproject.toml but never imported"
