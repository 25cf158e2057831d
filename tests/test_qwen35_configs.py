"""The released dense Qwen3.5 text models (models/configs/qwen3.5-*.json, provenance in its README): `inspect`
by name counts exactly what transformers' Qwen3_5ForCausalLM built from each file holds, that total rounds to
the size in the model's name, and `plan` over the 27B at full size (-> 20B) returns candidates whose exported
configs transformers counts exactly as plan does. The same for the Qwen3.5 MoE text models (35B-A3B, 122B-A10B,
397B-A17B; active counts too, plan 35B-A3B -> 24B) and Qwen3-Next-80B-A3B."""
import json
from pathlib import Path

import pytest

from remodel.models.families import FAMILIES
from remodel.models.hf import config_from_hf, config_to_hf
from remodel.pipelines.commands.inspection import inspect
from remodel.pipelines.commands.plan import candidate_config, plan
from tests.conftest import hf_meta_model

CONFIGS = Path(__file__).resolve().parents[1] / "models" / "configs"
README = (CONFIGS / "README.md").read_text()
# name -> (our total, the size in the name as (value, decimals of 1e9) it is rounded to)
SIZES = {"qwen3.5-0.8b": (752_393_024, (0.8, 1)), "qwen3.5-2b": (1_881_825_088, (2, 0)),
         "qwen3.5-4b": (4_205_751_296, (4, 0)), "qwen3.5-9b": (8_953_803_264, (9, 0)),
         "qwen3.5-27b": (26_895_998_464, (27, 0))}


def load(name) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def hf_total(d: dict) -> int:
    return sum(p.numel() for p in hf_meta_model(d).parameters())


@pytest.mark.parametrize("name", sorted(SIZES))
def test_inspect_equals_transformers_and_the_name(name):
    """Dense: active == total; the text model alone (no vision tower, no MTP layer) rounds to the name."""
    d = load(name)
    assert d["model_type"] == "qwen3_5_text" and len(d["layer_types"]) == d["num_hidden_layers"]
    p = inspect(name)["params"]
    total, (card, digits) = SIZES[name]
    assert p["total"] == p["active"] == p["hf_total"] == hf_total(d) == total
    assert round(total / 1e9, digits) == card
    assert f"`{name}.json`" in README and f"{total:,}" in README  # the provenance table states this count


def test_plan_27b_to_20b_counts_exactly_in_transformers():
    """Plan at full size: 3 candidates within 2% under 20B, some dropping decoder layers; each exported as a
    qwen3_5_text config.json builds a transformers model of exactly plan's count."""
    budget = 20e9
    d = plan("qwen3.5-27b", params=budget, top=3, verbose=False)
    cands, src = d["candidates"], config_from_hf(load("qwen3.5-27b"))
    assert d["family"] == "qwen3_5_text" and d["source_params"]["params"] == SIZES["qwen3.5-27b"][0]
    assert len(cands) == 3 and all(0.98 * budget <= c["params"] <= budget for c in cands)
    assert any(c["prune_targets"].get("drop_layers") for c in cands)
    for c in cands:
        hf = config_to_hf(candidate_config(src, c, d["family"]), d["family"])
        assert hf["model_type"] == "qwen3_5_text"
        assert hf_total(hf) == c["params"] == c["active_params"], c["widths"]


def test_qwen3_next_80b_counts_and_plan_to_50b():
    """Qwen3-Next-80B-A3B (qwen3_next; provenance in models/configs/README.md): inspect == transformers'
    Qwen3NextForCausalLM built from the file == the total published for Qwen3-Coder-Next, the same shape
    (79,674,391,296); plan at full size to 50B returns candidates transformers counts exactly (total and
    active: the routed experts' top-k share, counted by our plan, checked here on the total)."""
    d = load("qwen3-next-80b-a3b")
    p = inspect("qwen3-next-80b-a3b")["params"]
    assert p["total"] == p["hf_total"] == hf_total(d) == 79_674_391_296 and round(p["total"] / 1e9) == 80
    assert p["active"] < p["total"] / 15  # A3B: ~3.9B active with the embeddings and lm_head
    budget = 50e9
    plan_d = plan("qwen3-next-80b-a3b", params=budget, top=3, verbose=False)
    cands, src = plan_d["candidates"], config_from_hf(d)
    assert plan_d["family"] == "qwen3_next" and len(cands) == 3
    assert all(0.98 * budget <= c["params"] <= budget for c in cands)
    for c in cands:
        hf = config_to_hf(candidate_config(src, c, plan_d["family"]), plan_d["family"])
        assert hf["model_type"] == "qwen3_next" and hf_total(hf) == c["params"], c["widths"]


# Qwen3.5 MoE text models (qwen3_5_moe_text): name -> (total, active, vision tower, what rounds to the name's
# total). The 397B's text model alone is 396.35B; with its vision tower (not in the file) it is 396.80B.
MOE = {"qwen3.5-35b-a3b": (34_660_610_688, 3_454_988_928, 446_571_248, 35, 3, "text"),
       "qwen3.5-122b-a10b": (122_111_526_912, 9_771_288_576, 451_290_864, 122, 10, "text"),
       "qwen3.5-397b-a17b": (396_346_350_336, 17_349_040_896, 456_010_480, 397, 17, "text+vision")}


def hf_active(model, d: dict) -> int:
    """Per-token parameters of transformers' model: all but the routed experts, plus their top-k share."""
    params = dict(model.named_parameters())
    routed = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    return sum(p.numel() for p in params.values()) - routed + routed * d["num_experts_per_tok"] // d["num_experts"]


def hf_vision_total(hidden: int) -> int:
    """transformers' Qwen3.5-MoE vision tower (its default vision config, the released one; merger -> hidden)."""
    import torch
    from transformers.models.qwen3_5_moe import configuration_qwen3_5_moe as c, modeling_qwen3_5_moe as m
    with torch.device("meta"):
        tower = m.Qwen3_5MoeVisionModel._from_config(c.Qwen3_5MoeVisionConfig(out_hidden_size=hidden))
    return sum(p.numel() for p in tower.parameters())


@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_inspect_equals_transformers_and_the_name(name):
    """inspect's total and active == transformers' Qwen3_5MoeForCausalLM from the file (active: all but the
    routed experts + their top-k share); the total rounds to the name's (the 397B with its vision tower, which
    Qwen3_5MoeForCausalLM does not build) and the active count to the name's A<n>B."""
    d = load(name)
    assert d["model_type"] == "qwen3_5_moe_text" and d["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert d["layer_types"] == ["full_attention" if i % 4 == 3 else "linear_attention"
                                for i in range(d["num_hidden_layers"])]
    total, active, vision, card, card_active, rounded = MOE[name]
    model = hf_meta_model(d)
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    p = inspect(name)["params"]
    assert p["total"] == p["hf_total"] == sum(q.numel() for q in model.parameters()) == total
    assert p["active"] == hf_active(model, d) == active
    assert hf_vision_total(d["hidden_size"]) == vision
    assert round((total + vision * (rounded == "text+vision")) / 1e9) == card
    assert round(active / 1e9) == card_active
    assert f"`{name}.json`" in README and f"{total:,}" in README and f"{active:,}" in README


def test_moe_plan_35b_a3b_to_24b_counts_exactly_in_transformers():
    """Plan at full size: Qwen3.5-35B-A3B -> 24B total, 3 candidates within 2% under it, each exported as a
    qwen3_5_moe_text config.json whose transformers model holds exactly plan's total and active counts."""
    budget, name = 24e9, "qwen3.5-35b-a3b"
    d = plan(name, params=budget, top=3, verbose=False)
    cands, src = d["candidates"], config_from_hf(load(name))
    assert d["family"] == "qwen3_5_moe_text" and d["source_params"]["params"] == MOE[name][0]
    assert len(cands) == 3 and all(0.98 * budget <= c["params"] <= budget for c in cands)
    for c in cands:
        hf = config_to_hf(candidate_config(src, c, d["family"]), d["family"])
        model = hf_meta_model(hf)
        assert hf["model_type"] == "qwen3_5_moe_text"
        assert sum(q.numel() for q in model.parameters()) == c["params"], c["widths"]
        assert hf_active(model, hf) == c["active_params"], c["widths"]


# OLMo-hybrid 7B (olmo_hybrid; provenance in models/configs/README.md). Its family lives on branch wt-olmo.
OLMO, OLMO_TOTAL = "olmo-hybrid-7b", 7_430_870_688


def test_olmo_hybrid_7b_file_is_transformers_model_of_the_card_size():
    """transformers' OlmoHybridForCausalLM from the file holds 7,430,870,688 parameters ("7B"), and its tensors
    plus the two extra conv tensors per Gated DeltaNet layer (the checkpoint stores q/k/v convs apart) are the
    523 tensors the released checkpoint holds."""
    d = load(OLMO)
    model = hf_meta_model(d)
    assert type(model).__name__ == "OlmoHybridForCausalLM" and d["model_type"] == "olmo_hybrid"
    assert sum(p.numel() for p in model.parameters()) == OLMO_TOTAL and round(OLMO_TOTAL / 1e9) == 7
    assert len(list(model.parameters())) + 2 * d["layer_types"].count("linear_attention") == 523
    assert f"`{OLMO}.json`" in README and f"{OLMO_TOTAL:,}" in README


def test_olmo_hybrid_7b_inspect_equals_transformers():
    """Enable after merging wt-olmo: inspect by name (total == active: no experts) == transformers' count."""
    d = load(OLMO)
    p = inspect(OLMO)["params"]
    assert p["total"] == p["active"] == p["hf_total"] == hf_total(d) == OLMO_TOTAL
