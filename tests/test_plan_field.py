"""`plan` proposes the field's shapes (issue 56 Deliver 5): beside its budget candidates, the published cuts of
fine-grained MoEs -- 25% and 50% of the routed experts removed (GLM-4.5-Air for the GLM-4.x / GLM-4.7-Flash class,
a Qwen3-30B-A3B config, DeepSeek-V3 with its 8 expert groups kept equal) -- and on MLA models the heads and the
key / value latent rank cut by 25% / 50%. Each row, exported as the family's config.json, builds a transformers
model of exactly the row's total and active counts."""
import pytest

from remodel.models.hf import config_from_hf, config_to_hf
from remodel.pipelines.commands.field_shapes import cut_value
from remodel.pipelines.commands.plan import candidate_config, format_plan, plan
from tests.conftest import hf_counts, released_config as load

# Qwen/Qwen3-30B-A3B's shape (its config.json: 48 layers, 2048, 32 / 4 heads of 128, 128 experts top-8 of 768)
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
                 "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                 "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
CASES = {"glm-4.5-air": (70e9, {"experts -25%": ("experts", 96), "experts -50%": ("experts", 64)}),
         "qwen3-30b-a3b": (20e9, {"experts -25%": ("experts", 96), "experts -50%": ("experts", 64)}),
         "deepseek-v3": (400e9, {"experts -25%": ("experts", 192), "experts -50%": ("experts", 128),
                                 "mla_heads -25%": ("mla_heads", 96), "mla_heads -50%": ("mla_heads", 64),
                                 "kv_lora_rank -25%": ("kv_lora_rank", 384), "kv_lora_rank -50%": ("kv_lora_rank", 256)})}


def _source(name):
    return QWEN3_30B_A3B if name == "qwen3-30b-a3b" else load(name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_proposes_the_fields_cuts_counted_exactly(name):
    budget, want = CASES[name]
    d = plan(_source(name) if name == "qwen3-30b-a3b" else name, params=budget, top=1, verbose=False)
    rows = {c["field"]: c for c in d["field"]}
    assert sorted(rows) == sorted(want)
    src = config_from_hf(_source(name))
    for label, (axis, value) in want.items():
        c = rows[label]
        assert c["prune_targets"] == {axis: value} and c["rank"] == "field"
        hf = config_to_hf(candidate_config(src, c, d["family"]), d["family"])
        assert hf_counts(hf) == (c["params"], c["active_params"]), label
        assert c["under_budget"]["params"] == budget - c["params"]
    table = format_plan(d)
    assert all(f"--{axis.replace('_', '-')} {value}" in table for axis, value in want.values())


def test_an_expert_cut_keeps_the_groups_equal():
    """DeepSeek's 256 experts in 8 groups: 25% off is 192 (24 per group); a count off the groups rounds down."""
    cfg = config_from_hf(load("deepseek-v3"))
    assert (cut_value(cfg, "experts", 0.25), cut_value(cfg, "experts", 0.3)) == (192, 176)
    assert cut_value(cfg, "experts", 0.0) is None and cut_value(cfg, "experts", 1.0) is None
