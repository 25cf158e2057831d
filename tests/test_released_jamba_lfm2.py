"""The released Jamba 1.5 Mini / Large, LFM2-2.6B and LFM2-8B-A1B configs (models/configs, provenance in its README):
`remodel inspect NAME` prints the parameter count of transformers' own model built from each file (meta device), its
per-token active count likewise, and the published sizes: LFM2-2.6B's exact count on its model card, the others at
the rounding their cards state them (AI21 and Liquid AI truncate: 398.56B is "398B", 1.558B active "1.5B")."""
import json
import math
from pathlib import Path

import pytest

from remodel import cli
from remodel.models.hf import config_from_hf
from remodel.models.params import count_params
from tests.conftest import hf_meta_model

CONFIGS = Path(__file__).resolve().parents[1] / "models" / "configs"
# name -> (total, active per token) as published: an int is exact, a (value, digits) pair truncated to digits
CARDS = {"jamba-1.5-mini": ((52, 0, round), (12, 0, round)), "jamba-1.5-large": ((398, 0, math.floor), (94, 0, round)),
         "lfm2-2.6b": (2_569_272_320, None), "lfm2-8b-a1b": ((8.3, 1, round), (1.5, 1, math.floor))}


def hf_counts(d: dict) -> tuple[int, int]:
    """(total, active per token) of transformers' model: routed expert tensors count k/E of their size."""
    m = hf_meta_model(d)
    total = sum(p.numel() for p in m.parameters())
    routed = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)
    E, k = d.get("num_experts") or 0, d.get("num_experts_per_tok") or 0
    return total, total - routed + (routed * k // E if E > 1 else 0)


def _published(n: int, card) -> bool:
    if isinstance(card, int):
        return n == card
    value, digits, how = card
    return how(n / 1e9 * 10**digits) == round(value * 10**digits)


@pytest.mark.parametrize("name", sorted(CARDS))
def test_inspect_counts_equal_transformers_and_the_card(name, capsys):
    d = json.loads((CONFIGS / f"{name}.json").read_text())
    c = count_params(config_from_hf(d))
    total, active = hf_counts(d)
    print(f"{name}: {c['total']:,} params, {c['active']:,} active")
    assert (c["total"], c["active"]) == (total, active) and c["total"] == c["hf_total"]
    card_total, card_active = CARDS[name]
    assert _published(total, card_total) and (card_active is None or _published(active, card_active))
    assert cli.main(["inspect", name]) == 0
    shown = capsys.readouterr().out
    assert f"{total:,}" in shown and f"{active:,}" in shown
