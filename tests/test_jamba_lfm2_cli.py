"""Jamba, LFM2 and LFM2-MoE by the CLI alone (issue 54: each new family runs through the CLI on a checkpoint saved
by transformers): tiny models built and saved by transformers' own classes go through inspect, score, prune on every
width at once (Jamba: hidden, heads, experts, expert FFN and the Mamba-1 state; LFM2: hidden, heads, FFN, and the
experts of LFM2-MoE) and by decoder layer, and eval; transformers reloads each pruned checkpoint with the logits of
the same pruning done in memory."""
import json

import pytest

from remodel import cli
from remodel.compress.prune import plan_keep, prune_model
from remodel.pipelines.data.data import embedded_corpus
from tests.conftest import cli_flags, cli_inspect_and_score, cli_pair, prune_axes, reloaded_equals_in_memory

# family -> (tiny case, the widths its prune must include, the HF decoder layer dropped: Jamba's last, since dropping
# an inner one of "SE*ESE*E" leaves attention where no period and offset place it, which prune refuses)
CASES = {"jamba": ("plain", {"hidden_size", "attn_heads", "experts", "expert_ffn_size", "mamba1_d_state"}, "3"),
         "lfm2": ("plain", {"hidden_size", "attn_heads", "ffn_size"}, "2"),
         "lfm2_moe": ("plain", {"hidden_size", "attn_heads", "ffn_size", "experts", "expert_ffn_size"}, "2")}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    family = request.param
    _, ours, d = cli_pair(family, CASES[family][0], tmp_path_factory.mktemp(family))
    return family, ours, d


def test_cli_inspect_score_prune_every_width_and_depth_eval(pair, tmp_path, capsys):
    family, ours, d = pair
    data = str(embedded_corpus()[1])
    scores = cli_inspect_and_score(d, ours, tmp_path / "s", capsys)
    targets = prune_axes(ours.cfg)
    assert CASES[family][1] <= set(targets), sorted(targets)
    out = tmp_path / "widths"
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s"), *cli_flags(targets)]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == family and hf["hidden_size"] == targets["hidden_size"]
    reloaded_equals_in_memory(out, prune_model(ours, plan_keep(ours.cfg, scores, targets)))
    assert cli.main(["eval", str(out), "--data", data, "--seq-len", "32", "--max-tokens", "2048"]) == 0
    out, drop = tmp_path / "depth", CASES[family][2]  # one HF decoder layer (its mixer and its MLP / MoE) dropped
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s"), "--drop-layers", drop]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["num_hidden_layers"] == ours.cfg.num_layers // 2 - 1
    reloaded_equals_in_memory(out, prune_model(ours, plan_keep(ours.cfg, scores, {"drop_layers": drop})))
