"""Constraints between widths are rules the family declares (models/families/width_rules.py), not flags that
compress/ tests: a family declaring a new rule has it enforced by prune's validation and the search's grid."""
import dataclasses
import re
from pathlib import Path

import pytest

from remodel.compress.prune import validate_targets
from remodel.compress.search_space import build_space, search
from remodel.models.errors import RemodelError
from remodel.models.families import FAMILIES
from remodel.models.families.width_rules import HIDDEN_DIVIDES_HEADS, WidthRule
from remodel.models.hf import config_from_hf
from remodel.models.params import count_params

ROOT = Path(__file__).resolve().parents[1]


def _llama():
    return config_from_hf({"model_type": "llama", **FAMILIES["llama"].tiny[next(iter(FAMILIES["llama"].tiny))]})


def test_rules_hold_and_refuse():
    w = {"hidden_size": 32, "attn_heads": 6}
    assert not HIDDEN_DIVIDES_HEADS.holds(w) and HIDDEN_DIVIDES_HEADS.holds({**w, "attn_heads": 4})
    assert HIDDEN_DIVIDES_HEADS.holds({"hidden_size": 32, "attn_heads": 0})  # no attention: nothing to hold
    assert "not a multiple of the 6 attention heads" in HIDDEN_DIVIDES_HEADS.refusal(w, "llama")


def test_a_new_rule_is_enforced_by_prune_and_search(monkeypatch):
    """A rule only a test family declares (FFN a multiple of heads x heads = 16): prune refuses a target breaking
    it, naming the nearest valid values, and the search's best candidate moves from FFN 36 to 32; without the
    rule both allow such widths."""
    cfg = _llama()
    budget = {"params": int(count_params(cfg)["total"] * 0.97)}

    def best_ffn():
        rows, _ = search(build_space(cfg, axes=("ffn_size",), family="llama", max_width_cut=0.9), budget, tol=0.5,
                         window_only=False)
        assert all(r["widths"]["ffn_size"] % 16 == 0 for r in rows) or not FAMILIES["llama"].width_rules[1:]
        return rows[0]["widths"]["ffn_size"]

    validate_targets(cfg, {"ffn_size": 36}, "llama")  # allowed before
    assert best_ffn() == 36
    rule = WidthRule(("ffn_size",), ("attn_heads", "attn_heads"), "a test rule", ("ffn {of}", "{by}"))
    monkeypatch.setitem(FAMILIES, "llama", dataclasses.replace(FAMILIES["llama"], width_rules=(HIDDEN_DIVIDES_HEADS, rule)))
    with pytest.raises(RemodelError, match=r"ffn 36 is not a multiple of 16.*a test rule.*nearest valid: --ffn-size"):
        validate_targets(cfg, {"ffn_size": 36}, "llama")
    validate_targets(cfg, {"ffn_size": 32}, "llama")
    assert best_ffn() == 32


def test_compress_names_no_rule():
    """compress/ asks Family.width_rules; it names no rule and no family flag."""
    names = ("HIDDEN_DIVIDES_HEADS", "MAMBA_WIDTH_FROM_HIDDEN", "hidden_divides_heads", "mamba_width_from_hidden")
    hits = [f"{p.name}: {n}" for p in (ROOT / "compress").glob("*.py") for n in names if re.search(n, p.read_text())]
    assert not hits, hits
