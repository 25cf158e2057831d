"""GLM-4.7-Flash (transformers' `glm4_moe_lite`) by the CLI alone (issue 56 acceptance): a tiny model built and saved
by transformers' own class -- MLA with a query latent, a dense first layer then sigmoid-routed MoE layers over 2
expert groups with 2 shared experts, as `mlp_layer_types` lists them -- goes through inspect, score, prune on every
width at once (the MLA widths, experts, expert and shared sizes, the dense FFN, hidden) and by decoder layer, and eval;
transformers reloads each pruned checkpoint with the logits of the same pruning done in memory and the dense layers
named where they are. (The family suite: test_families, which includes the case with a dense layer between MoE ones.)"""
import json

from remodel import cli
from remodel.compress.prune import plan_keep, prune_model
from remodel.pipelines.data.data import embedded_corpus
from tests.conftest import cli_flags, cli_inspect_and_score, cli_pair, prune_axes, reloaded_equals_in_memory

FAMILY, CASE = "glm4_moe_lite", "flash"


def test_cli_inspect_score_prune_every_width_and_depth(tmp_path, capsys):
    _, ours, d = cli_pair(FAMILY, CASE, tmp_path / "src")
    scores = cli_inspect_and_score(d, ours, tmp_path / "s", capsys)
    targets = {**prune_axes(ours.cfg), "expert_ffn_size": 8, "shared_expert_size": 16}  # 2 x 8: n_shared_experts
    assert {"experts", "mla_heads", "v_head_dim", "qk_nope_head_dim", "kv_lora_rank", "q_lora_rank", "ffn_size",
            "hidden_size"} <= set(targets)
    out = tmp_path / "widths"
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s"), *cli_flags(targets)]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == FAMILY and "first_k_dense_replace" not in hf
    assert (hf["hidden_size"], hf["n_routed_experts"], hf["num_attention_heads"], hf["kv_lora_rank"], hf["n_group"],
            hf["n_shared_experts"], hf["mlp_layer_types"]) == (targets["hidden_size"], targets["experts"],
                                                               targets["mla_heads"], targets["kv_lora_rank"], 2, 2,
                                                               ["dense", "sparse", "sparse"])
    reloaded_equals_in_memory(out, prune_model(ours, plan_keep(ours.cfg, scores, targets)))
    assert cli.main(["eval", str(out), "--data", str(embedded_corpus()[1]), "--seq-len", "32",
                     "--max-tokens", "2048"]) == 0
    out = tmp_path / "depth"  # the dense decoder layer 0 dropped: the rest are MoE, and mlp_layer_types says so
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s"), "--drop-layers", "0"]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert (hf["num_hidden_layers"], hf["mlp_layer_types"]) == (2, ["sparse", "sparse"])
    reloaded_equals_in_memory(out, prune_model(ours, plan_keep(ours.cfg, scores, {"drop_layers": [0]})))
