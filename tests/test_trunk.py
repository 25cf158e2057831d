"""The one trunk walk (models/trunk.py): the only product function that applies the final norm to a walked
trunk is `trunk.finish`, no product function writes norm -> mixer -> join outside the Block, and the walker
driven by pull (walk) and by push (a writer sending one block at a time) gives the same streams. The
bit-identity of HybridLM, streaming scoring and the deviation check per family is in tests/test_families.py."""
import ast
from pathlib import Path

import torch

from remodel.models.trunk import one_pass, walk, walker

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = [p for d in ("models", "compress", "upcycle", "pipelines") for p in sorted((ROOT / d).rglob("*.py"))]
PRODUCT.append(ROOT / "cli.py")


def _calls(fn: ast.AST) -> set[str]:
    """The names a function calls: f(...) -> 'f', x.f(...) -> 'f'."""
    out = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Call):
            f = n.func
            out.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return out


def _functions():
    for path in PRODUCT:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(ROOT)}:{node.name}", node


def test_one_function_applies_the_final_norm():
    users = {name for name, fn in _functions() if _calls(fn) & {"final_hidden", "norm_f"}}
    assert users == {"models/trunk.py:finish"}, users


def test_no_function_but_the_block_writes_norm_mixer_join():
    writers = {name for name, fn in _functions() if {"join", "mixer"} <= _calls(fn)}
    assert writers <= {"models/block.py:_forward"}, writers


class _Add(torch.nn.Module):
    def __init__(self, i):
        super().__init__()
        self.i = i

    def forward(self, x, scale=1.0):
        return x * 1.5 + self.i * scale


def test_pull_and_push_walk_the_same_streams():
    blocks = [_Add(i) for i in range(4)]
    pulled = walk(4, blocks.__getitem__, {"a": torch.ones(2), "b": torch.zeros(2)}, one_pass(("a", "b")),
                  lambda key: (2.0 if key == "b" else 1.0,))
    pushed = {"a": torch.ones(2), "b": torch.zeros(2)}
    g = walker(4, pushed, one_pass(("a", "b")), lambda key: (2.0 if key == "b" else 1.0,))
    order = [next(g)]
    for b in blocks:
        try:
            order.append(g.send(b))
        except StopIteration:
            pass
    assert order == [0, 1, 2, 3]
    want_a, want_b = torch.ones(2), torch.zeros(2)
    for i in range(4):
        want_a, want_b = want_a * 1.5 + i, want_b * 1.5 + 2 * i
    assert torch.equal(pulled["a"], want_a) and torch.equal(pulled["b"], want_b)
    assert torch.equal(pushed["a"], want_a) and torch.equal(pushed["b"], want_b)
