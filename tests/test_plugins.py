"""Layer kinds and model families are plug-ins (issue 26): every registered kind and family has one tiny
builder in tests/conftest.py, and the generic operations work on each through its spec alone."""
from pathlib import Path

import torch

from remodel.compress.baselines import random_scores
from remodel.compress.prune import plan_keep, prune_model
from remodel.models.families import FAMILIES
from remodel.models.hf import check_exportable, config_from_hf, config_to_hf, from_hf_name, weight_table
from remodel.models.hf_adapter import to_hf_part
from remodel.models.kinds import KINDS
from remodel.models.model import HybridLM, init_weights
from remodel.models.params import count_params
from remodel.models.kinds import WIDTHS
from tests.conftest import FAMILY_CONFIGS, KIND_CONFIGS

TESTS = Path(__file__).resolve().parent


def test_every_kind_and_family_has_one_builder():
    assert set(KIND_CONFIGS) == {k.name for k in KINDS.values()}
    assert set(FAMILY_CONFIGS) == set(FAMILIES)


def test_family_config_and_names_round_trip(family_config):
    """Config out through transformers' own class and back is the same model; every tensor name maps
    back to ours through the same key map."""
    name, cfg = family_config
    check_exportable(cfg, name)
    back = config_from_hf(config_to_hf(cfg, name))
    assert {**back.to_dict(), "extra": {}} == {**cfg.to_dict(), "extra": {}}
    for ours, hf, e in weight_table(cfg, name):  # a part of an HF tensor that concatenates several of ours
        assert from_hf_name(cfg, name, hf, to_hf_part(cfg, name, ours, e).index) == (ours, e)


def test_kind_counts_and_prunes_by_its_spec(kind_config):
    """Parameter count from the spec's layout equals the built model's; halving every prunable width of
    the kind (its units) through the generic planner gives a model of the counted size that runs."""
    name, cfg = kind_config
    model = init_weights(HybridLM(cfg), std=0.1, seed=0).eval()
    assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters())
    kind = next(k for k in KINDS.values() if k.name == name)
    targets = {w.name: w.of(cfg) // 2 for w in WIDTHS.values()
               if w.name in kind.widths and w.unit in kind.units and w.of(cfg)}
    if kind.hidden_units:  # its units kept at hidden's count (the short conv's channels): pruned with hidden_size
        targets["hidden_size"] = cfg.hidden_size // 2
    if "mamba_heads" in targets:
        targets["mamba_heads"] = cfg.mamba.n_groups * (cfg.mamba.mamba_num_heads // cfg.mamba.n_groups // 2)
    if "attn_heads" in targets:
        targets["attn_heads"] = cfg.attention.num_key_value_heads
    if "experts" in targets:
        targets["experts"] = max(targets["experts"], cfg.moe.num_experts_per_tok)
    targets.pop("expert_ffn_size", None)  # transformers' grouped expert matmul wants multiples of 8
    targets.pop("shared_expert_size", None)
    assert targets or name == "moe", name
    if not targets:
        return
    small = prune_model(model, plan_keep(cfg, random_scores(cfg), targets, family="nemotron_h"))
    assert sum(p.numel() for p in small.parameters()) == count_params(small.cfg)["total"]
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        assert torch.isfinite(small(torch.randint(0, cfg.vocab_size, (2, 9)))).all()


def test_no_test_module_imports_another():
    """Shared builders live in tests/conftest.py (and plain helpers such as tests/rss.py), never in a
    test module another one imports."""
    offenders = [f"{path.name}:{i} {line.strip()}" for path in sorted(TESTS.glob("*.py"))
                 for i, line in enumerate(path.read_text().splitlines(), 1)
                 if line.lstrip().startswith(("from tests.test_", "import tests.test_"))]  # code or a child's script
    assert not offenders, offenders
