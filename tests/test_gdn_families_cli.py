"""Qwen3.5-MoE and Qwen3-Next by the CLI alone, as a new user runs them (issue 41 acceptance): tiny models
built and saved by transformers' own classes in their non-default variants (grouped value heads, partial
RoPE, biases, tied embeddings; Qwen3-Next with a dense MLP layer and unnormalised top-k) go through inspect,
score, prune on every width at once (Gated DeltaNet widths, attention heads, experts, expert and shared
expert sizes, hidden) and by decoder layer, and eval; transformers reloads each pruned checkpoint with the
logits of the same pruning done in memory. (Qwen3.5 dense: tests/test_gated_deltanet.py; convert, export
and upcycling of every family: tests/test_families.py.)"""
import json

import pytest

from remodel import cli
from remodel.compress.prune import plan_keep, prune_model
from remodel.models.families import FAMILIES
from remodel.pipelines.data.data import embedded_corpus
from tests.conftest import cli_flags, cli_inspect_and_score, cli_pair, prune_axes, reloaded_equals_in_memory

CASES = {"qwen3_5_moe_text": "grouped_biased_tied", "qwen3_next": "grouped_dense_layer"}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    family = request.param
    _, ours, d = cli_pair(family, CASES[family], tmp_path_factory.mktemp(family))
    return family, ours, d


def test_cli_inspect_score_prune_every_width_and_depth_eval(pair, tmp_path, capsys):
    family, ours, d = pair
    data = str(embedded_corpus()[1])
    scores = cli_inspect_and_score(d, ours, tmp_path / "s", capsys)
    targets = {**prune_axes(ours.cfg), "linear_key_heads": 1, "linear_value_heads": 2}  # one group of 3 -> 2
    assert {"experts", "expert_ffn_size", "shared_expert_size", "attn_heads", "hidden_size", "linear_key_heads",
            "linear_value_heads", "linear_key_head_dim", "linear_value_head_dim"} <= set(targets)
    out = tmp_path / "widths"
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s"), *cli_flags(targets)]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == family and hf["num_experts"] == targets["experts"]
    assert (hf["linear_num_value_heads"], hf["hidden_size"]) == (targets["linear_value_heads"], targets["hidden_size"])
    reloaded_equals_in_memory(out, prune_model(ours, plan_keep(ours.cfg, scores, targets)))
    assert cli.main(["eval", str(out), "--data", data, "--seq-len", "32", "--max-tokens", "2048"]) == 0
    # depth by decoder layer: HF layer 2 (its mixer with its MoE / MLP) dropped whole
    out = tmp_path / "depth"
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s"), "--drop-layers", "2"]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["num_hidden_layers"] == ours.cfg.num_layers // 2 - 1
    assert hf["layer_types"] == [t for j, t in enumerate(FAMILIES[family].tiny[CASES[family]]["layer_types"]) if j != 2]


def test_cli_search_writes_a_model_of_the_family_within_budget(pair, tmp_path):
    """search (score, plan, prune the top candidates, rank them, distill the pick briefly) on the family:
    the written model is the source's family, within the budget, and transformers loads it."""
    from transformers import AutoModelForCausalLM
    family, ours, d = pair
    total = sum(p.numel() for p in ours.parameters())
    budget = int(total * 0.8)
    out = tmp_path / "searched"
    assert cli.main(["search", str(d), str(out), "--data", str(embedded_corpus()[1]), "--params", str(budget),
                     "--candidates", "4", "--top", "2", "--distill-tokens", "256", "--seq-len", "32",
                     "--batch", "4"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == family
    got = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())
    assert 0.5 * total < got <= budget
