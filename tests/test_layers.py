"""The package layering holds: `lint-imports` (import-linter, contracts in pyproject.toml's
[tool.importlinter]) passes, and no package imports the top-level `cli` module (import-linter takes
packages only as roots, so `cli`, the top layer, is checked here instead)."""
import ast
import re
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


def test_no_import_cycle():
    """No module imports, directly or through others, a module that imports it (lazy imports count)."""
    import grimp  # import-linter's own import graph
    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph(*PACKAGES)
    cycles = sorted({tuple(sorted((m, n))) for m in graph.modules for n in graph.find_modules_directly_imported_by(m)
                     if graph.find_shortest_chain(importer=n, imported=m)})
    assert not cycles, cycles


def test_no_private_name_imported_across_modules():
    offenders = []
    for path in [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))] + [ROOT / "cli.py"]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {a.name}" for a in node.names
                              if a.name.startswith("_")]
    assert not offenders, offenders


def test_product_functions_and_files_are_short():
    """Issue 18's size rule for the product code: no function over 60 lines, no file over 500."""
    long = []
    for path in [p for pkg in ("models", "compress", "upcycle", "pipelines") for p in sorted((ROOT / pkg).rglob("*.py"))] \
            + [ROOT / "cli.py"]:
        src = path.read_text()
        if len(src.splitlines()) > 500:
            long.append(f"{path.relative_to(ROOT)}: {len(src.splitlines())} lines")
        long += [f"{path.relative_to(ROOT)}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines"
                 for n in ast.walk(ast.parse(src)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long


def test_no_product_function_takes_more_than_8_parameters():
    """Issue 40 Deliver 4: no product function takes more than 8 parameters (positional-only, ordinary and
    keyword-only ones, *args and **kwargs each one; a leading self / cls / ctx not counted): long lists
    become an options dataclass or a small group of values that travel together."""
    many = []
    for path in [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))] + [ROOT / "cli.py"]:
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = n.args
                names = [x.arg for x in a.posonlyargs + a.args]
                count = len(names) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None) \
                    - (names[:1] in (["self"], ["cls"], ["ctx"]))
                if count > 8:
                    many.append(f"{path.relative_to(ROOT)}:{n.lineno} {n.name}: {count} parameters")
    assert not many, many


def _product_trees():
    for path in [p for pkg in ("models", "compress", "upcycle", "pipelines") for p in sorted((ROOT / pkg).rglob("*.py"))] \
            + [ROOT / "cli.py"]:
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def test_no_method_rebound_on_an_instance():
    """Issue 26: behaviour changes from outside through hooks, swapped modules or data the module reads,
    never by assigning a method (forward, logits, expert, ...) on an instance or binding with MethodType."""
    offenders = []
    for rel, tree in _product_trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                offenders += [f"{rel}:{node.lineno} assigns .{t.attr}" for t in targets
                              if isinstance(t, ast.Attribute) and t.attr in ("forward", "logits", "expert")]
            if isinstance(node, ast.Attribute) and node.attr == "MethodType":
                offenders.append(f"{rel}:{node.lineno} uses types.MethodType")
    assert not offenders, offenders


PATTERN_CHARS = set("M*-E")


def _tests_pattern(node) -> bool:
    """A comparison against a pattern character, a membership test of one (`"E" in cfg.pattern`), or a
    count of one (`cfg.count("*")`)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "count":
        consts = [a.value for a in node.args if isinstance(a, ast.Constant)]
    elif isinstance(node, ast.Compare):
        consts = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
    else:
        return False
    return any(isinstance(v, str) and v and set(v) <= PATTERN_CHARS for v in consts)


def test_pattern_characters_are_tested_only_in_the_model_definition():
    """Issue 26: operations ask the layer kinds' specs (models/kinds.py); at most 4 product files, all in
    models/, compare against a pattern character."""
    files = sorted({rel for rel, tree in _product_trees() for n in ast.walk(tree) if _tests_pattern(n)})
    assert len(files) <= 4 and all(f.startswith("models/") for f in files), files


def test_family_names_only_in_the_families_folder():
    """Issue 26: a family's name is written only in its module under models/families (docstrings aside)."""
    from remodel.models.families import FAMILIES

    offenders = []
    for rel, tree in _product_trees():
        if rel.startswith("models/families/"):
            continue
        docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        offenders += [f"{rel}:{n.lineno} {n.value!r}" for n in ast.walk(tree) if isinstance(n, ast.Constant)
                      and isinstance(n.value, str) and id(n) not in docs
                      and any(re.search(rf"\b{f}\b", n.value) for f in FAMILIES)]
    assert not offenders, offenders
