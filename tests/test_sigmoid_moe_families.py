"""The sigmoid-routed MoE families by the CLI alone (issue 56 acceptance for each family): tiny models built
and saved by transformers' own classes -- glm4_moe (GLM-4.5: a dense first layer, DeepSeek routing over 2 expert
groups with a correction bias and routed scaling, 2 shared experts, partial RoPE, q/k norm and q/k/v bias) and
minimax_m2 (q/k norms over all heads, which shrink with head pruning; renormalised sigmoid top-k with a
correction bias; the legacy rotary_dim) -- go through inspect, score, prune on every width at once and by decoder layer, and eval (its loss equal to
transformers': test_families.test_eval_loss); transformers reloads each pruned checkpoint with the logits of the same pruning done in memory. An
expert target that would leave the groups unequal is refused in one line. (The family suite: test_families.)"""
import json

import pytest
import torch

from remodel import cli
from remodel.compress.prune import plan_keep, prune_model, validate_targets
from remodel.models.errors import RemodelError
from remodel.models.families import FAMILIES
from remodel.pipelines.data.data import embedded_corpus
from tests.conftest import cli_flags, cli_inspect_and_score, cli_pair, prune_axes, reloaded_equals_in_memory

FAMILY, CASE = "glm4_moe", "grouped"
# family -> (tiny case, targets beside prune_axes' (glm4_moe: 2 x 8 keeps n_shared_experts whole), its config.json
# fields that must follow the targets)
CLI_CASES = {"glm4_moe": ("grouped", {"expert_ffn_size": 8, "shared_expert_size": 16},
                          lambda hf, t: (hf["n_routed_experts"], hf["n_group"], hf["n_shared_experts"] * hf["moe_intermediate_size"])
                          == (t["experts"], 2, t["shared_expert_size"])),
             "minimax_m2": ("plain", {}, lambda hf, t: (hf["num_local_experts"], hf["intermediate_size"], hf["num_attention_heads"])
                            == (t["experts"], t["expert_ffn_size"], t["attn_heads"]))}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return cli_pair(FAMILY, CASE, tmp_path_factory.mktemp(FAMILY))


@pytest.fixture(scope="module", params=list(CLI_CASES))
def cli_case(request, tmp_path_factory):
    return request.param, cli_pair(request.param, CLI_CASES[request.param][0], tmp_path_factory.mktemp(request.param))


def test_cli_inspect_score_prune_every_width_and_depth(cli_case, tmp_path, capsys):
    family, (_, ours, d) = cli_case
    _, extra_targets, follows = CLI_CASES[family]
    data = str(embedded_corpus()[1])
    scores = cli_inspect_and_score(d, ours, tmp_path / "s", capsys)
    targets = {**prune_axes(ours.cfg), **extra_targets}
    assert {"experts", "expert_ffn_size", "attn_heads", "hidden_size"} <= set(targets)
    out = tmp_path / "widths"
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s"), *cli_flags(targets)]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == family and hf["hidden_size"] == targets["hidden_size"] and follows(hf, targets)
    reloaded_equals_in_memory(out, prune_model(ours, plan_keep(ours.cfg, scores, targets)))
    assert cli.main(["eval", str(out), "--data", data, "--seq-len", "32", "--max-tokens", "2048"]) == 0
    out = tmp_path / "depth"  # decoder layer 1 (attention + its MoE) dropped whole (glm4_moe: the dense layer stays)
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s"), "--drop-layers", "1"]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["num_hidden_layers"] == ours.cfg.num_layers // 2 - 1 and hf.get("first_k_dense_replace", 1) == 1


def test_expert_groups_stay_equal_or_the_target_is_refused(pair):
    _, ours, _ = pair
    validate_targets(ours.cfg, {"experts": 6})  # 3 of 4 in each of the 2 groups
    with pytest.raises(RemodelError) as e:
        validate_targets(ours.cfg, {"experts": 5})
    assert "n_group" in str(e.value) and "\n" not in str(e.value)


def test_shared_experts_stay_a_multiple_of_the_expert_size(pair):
    """n_shared_experts = shared size / moe_intermediate_size: a cut that breaks it is refused in one line."""
    _, ours, _ = pair
    validate_targets(ours.cfg, {"shared_expert_size": 16, "expert_ffn_size": 8})
    with pytest.raises(RemodelError) as e:
        validate_targets(ours.cfg, {"shared_expert_size": 20})
    assert "n_shared_experts" in str(e.value) and "\n" not in str(e.value)


def test_search_grid_keeps_the_shared_experts_whole(pair):
    """The search proposes only shapes transformers' glm4_moe config can hold (the family's width rule)."""
    from remodel.compress.search_space import build_space, search
    from remodel.models.hf import config_to_hf
    from remodel.models.params import count_params
    from remodel.pipelines.commands.plan_file import candidate_config
    _, ours, _ = pair
    cfg = ours.cfg
    space = build_space(cfg, axes=("shared_expert_size", "expert_ffn_size"), family=FAMILY, max_width_cut=0.9)
    rows, _ = search(space, {"params": count_params(cfg)["total"]}, tol=0.5, window_only=False)
    assert rows and all(r["widths"]["shared_expert_size"] % r["widths"]["expert_ffn_size"] == 0 for r in rows)
    assert {r["widths"]["expert_ffn_size"] for r in rows} == {8, 16}
    for r in rows:
        config_to_hf(candidate_config(cfg, r, FAMILY), FAMILY)


def test_lfm2_moe_router_weights_equal_transformers(tmp_path):
    """LFM2-MoE renormalises its top-k sigmoid weights over (sum + 1e-6): ours (the MoE kind's topk_norm_eps, set by
    the family) gives transformers' weights to 1e-7 on a router with a nonzero expert bias (with the kind's default
    1e-20 they differ by ~1e-6 of their size)."""
    from tests.conftest import hf_pair
    hf, ours, _ = hf_pair("lfm2_moe", tmp_path, "m", 3, **FAMILIES["lfm2_moe"].tiny["plain"])
    j = next(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.feed_forward, "gate"))
    block, gate = hf.model.layers[j].feed_forward, ours.layers[2 * j + 1].mixer.gate
    with torch.no_grad():
        block.expert_bias.copy_(torch.linspace(-0.3, 0.3, block.expert_bias.numel()))
        gate.e_score_correction_bias.copy_(block.expert_bias)
        x = torch.randn(64, ours.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        _, w_ref, i_ref = block.gate(x, block.expert_bias)
        _, w, i = gate(x)
    order, order_ref = i.sort(-1), i_ref.sort(-1)
    assert torch.equal(order.values, order_ref.values)
    assert (w.gather(1, order.indices) - w_ref.gather(1, order_ref.indices)).abs().max().item() <= 1e-7
