"""`remodel demo --quick` end to end: the README's first command, checked by its numbers."""
import json
import logging

import pytest
from transformers.utils import logging as hf_logging

from remodel.cli import main


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_demo_quick(tmp_path, capsys):
    out = tmp_path / "demo"
    seen = _Records()
    logging.Logger.warning_once.cache_clear()  # transformers warns once per process: let it warn here again
    hf_logging.get_logger("transformers").addHandler(seen)
    try:
        assert main(["demo", "--out", str(out), "--quick"]) == 0
    finally:
        hf_logging.get_logger("transformers").removeHandler(seen)
    # transformers' CPU notice asks to install CUDA-only kernels: not shown by the demo's parity step
    assert not [m for m in seen.messages if "falling back to its reference" in m], seen.messages
    r = json.loads((out / "remodel_report.json").read_text())
    rows = {row["model"]: row for row in r["rows"]}
    teacher, pruned = rows["embedded (teacher)"], rows["pruned"]
    distilled, moe = rows["pruned + distilled"], rows["upcycled MoE"]
    assert r["round_trip_tensors_identical"] > 0
    assert pruned["params"] < 0.6 * teacher["params"]
    assert distilled["ppl"] < pruned["ppl"]            # distillation recovers part of the pruning loss
    assert moe["ppl"] == pytest.approx(teacher["ppl"], rel=1e-3)  # exact upcycling
    assert moe["active"] < moe["params"]
    trained = rows["embedded MoE (trained)"]  # the shipped MoE: same shape, trained further
    assert trained["params"] == moe["params"] and trained["ppl"] < 0.9 * teacher["ppl"]
    for d in r["loaded_in_transformers"].values():
        assert d["max_abs_logit_diff_vs_remodel"] <= 1e-4
    assert "pruned + distilled" in (out / "table.txt").read_text()
    # the shipped lm-eval tasks (20 items each under --quick): the teacher above chance (0.25), the exact
    # upcycle within one item of it
    assert teacher["cloze"] >= 0.4 and abs(moe["cloze"] - teacher["cloze"]) <= 0.05
    assert all(0 <= row["nextphrase"] <= 1 for row in rows.values())
    # a second run replaces a previous demo output; a foreign non-empty directory is refused
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    assert main(["demo", "--out", str(other), "--quick"]) == 2
    assert (other / "keep.txt").read_text() == "x"
    assert "not a previous demo output" in capsys.readouterr().err
