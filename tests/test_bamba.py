"""IBM Bamba (models/families/bamba.py) against transformers' `bamba` (the oracle) beyond the family conformance
suite (tests/test_families.py: logits, gradients, padding, export, convert, inspect, eval of its tiny models,
Family.tiny; inspect showing its kinds' fields, the partial rotary factor among them): the config mapping,
refusals, raw config bounds, pruning every axis then transformers' reload."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from remodel.models.errors import RemodelError
from remodel.models.families import FAMILIES
from remodel.models.hf import check_exportable
from remodel.models.kinds import kind
from remodel.models.load import save_model
from tests.conftest import hf_pair

V, B, L = 128, 2, 37
CASES = FAMILIES["bamba"].tiny  # plain; biased_tied: every bias, tied, head_dim 24, attention last, a dt clamp
BASE = CASES["plain"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("bamba")


def build(case, root):
    """-> (transformers model, our model, checkpoint dir), built once per case (tests/conftest.hf_pair)."""
    return hf_pair("bamba", root, case, len(case), **CASES[case])


def ids(seed=0):
    return torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_config_maps_to_pairs(case, root):
    _, ours, _ = build(case, root)
    attn = CASES[case]["attn_layer_indices"]
    assert ours.cfg.pattern == "".join("*-" if j in attn else "M-" for j in range(4))
    assert ours.cfg.attention.partial_rotary_factor == 0.5 and ours.cfg.mlp.mlp_gated and ours.cfg.mlp.mlp_act == "silu"
    assert FAMILIES["bamba"].depth_units(ours.cfg) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert "partial_rotary_factor" in kind("*").summary(ours.cfg)  # inspect shows it (tests/test_families.py)


def test_refusals(root):
    _, ours, _ = build("plain", root)
    cfg = ours.cfg
    with pytest.raises(RemodelError, match="whole heads"):  # llama would drop the partial rotary
        check_exportable(cfg.replace(pattern="*-*-"), "llama")
    with pytest.raises(RemodelError, match="partial_rotary_factor"):
        check_exportable(cfg.replace(partial_rotary_factor=1.0), "bamba")
    with pytest.raises(RemodelError, match="pattern"):
        check_exportable(cfg.replace(pattern="MM-*"), "bamba")
    with pytest.raises(RemodelError, match="mamba_expand"):
        check_exportable(cfg.replace(mamba_num_heads=6), "bamba")
    with pytest.raises(RemodelError, match="SwiGLU"):
        check_exportable(cfg.replace(mlp_gated=False, mlp_act="relu2"), "bamba")
    with pytest.raises(RemodelError, match="no upcycling target"):
        FAMILIES["bamba"].upcycle_into(cfg, "sigmoid", 0)


@pytest.mark.parametrize("key,value,words", [("mamba_n_heads", 10**9, "'mamba_n_heads' must be in 1..65,536"),
                                             ("mamba_d_conv", "4", "'mamba_d_conv' expected int"),
                                             ("mamba_d_head", "auto", None)])
def test_raw_config_bounds(key, value, words):
    """Bamba's own size fields are bounded on the raw config.json, before transformers allocates from them
    ('auto' head size is transformers' own derivation and passes)."""
    from remodel.models.hf import config_from_hf

    d = {"model_type": "bamba", **BASE, key: value}
    if words is None:
        assert config_from_hf(d).mamba.mamba_head_dim == 2 * BASE["hidden_size"] // BASE["mamba_n_heads"]
        return
    with pytest.raises(RemodelError, match=words):
        config_from_hf(d)


def test_prune_every_axis_then_transformers_reloads(root):
    """Through the generic planner (the kinds' keep rules, bamba's depth unit of mixer + MLP and its
    constraints): hidden, FFN, query heads, Mamba heads and head size and one decoder layer pruned; the
    result exports as bamba, transformers loads it with our logits and our parameter count."""
    from remodel.compress.baselines import random_scores
    from remodel.compress.prune import plan_keep, prune_model
    from remodel.models.params import count_params

    _, ours, _ = build("plain", root)
    cfg = ours.cfg
    targets = dict(hidden_size=32, ffn_size=48, attn_heads=2, mamba_heads=4, mamba_head_dim=8, num_layers=3)
    keep = plan_keep(cfg, random_scores(cfg, seed=1), targets, family="bamba")
    assert len(keep["layers"]) == 6 and all(keep["layers"][1::2] == keep["layers"][0::2] + 1)  # whole pairs
    small = prune_model(ours, keep)
    assert len(small.cfg.pattern) == 6 and small.cfg.pattern[1::2] == "---"  # 3 decoder layers of mixer + MLP
    out = save_model(small, root / "pruned", family="bamba")
    hf = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert sum(p.numel() for p in hf.parameters()) == count_params(small.cfg, family="bamba")["hf_total"]
    with torch.no_grad():
        a, b = hf(ids(5)).logits, small(ids(5))
    assert (a - b).abs().max().item() < 1e-4
