"""The released Granite 4.0-H, Bamba, Falcon-H1, LFM2 and fine-grained MoE (DeepSeek-V3 / V3.1, Kimi-K2, GLM-4.5 / -Air /
4.7 / 4.7-Flash, MiniMax-M2, gpt-oss-20b / -120b) configs (models/configs, provenance in its README): our counts equal transformers' own models built from
each file and the model cards' published sizes at the cards' rounding, and `plan` over them (Granite 4.0-H-Small 32B -> 20B,
Falcon-H1-34B -> 24B, Bamba-9B -> 7B, GLM-4.5-Air 106B -> 70B) returns candidates whose exported configs
transformers counts exactly as plan does."""
import json
from pathlib import Path

import pytest
import torch

from remodel.models.hf import config_from_hf, config_to_hf
from remodel.models.params import count_params
from remodel.pipelines.commands.plan import candidate_config, plan
from tests.conftest import hf_counts, hf_meta_model, released_config as load

CONFIGS = Path(__file__).resolve().parents[1] / "models" / "configs"
# name -> (total as the card rounds it: (value, digits of 1e9)), active per token likewise or None); an active
# entry's third item says what the card leaves out of it: "input" (the input embeddings: DeepSeek's README_WEIGHTS
# "36.6B ... including 0.9B for the output Head") or "embeddings" (input embeddings and lm_head: GLM's and MiniMax's
# active counts match only so). NEAR: totals a card states only loosely, checked within that fraction instead.
CARDS = {"bamba-9b": ((9.78, 2), None), "falcon-h1-0.5b": ((0.5, 1), None), "falcon-h1-7b": ((7.59, 2), None),
         "falcon-h1-34b": ((34, 0), None), "granite-4.0-h-micro": ((3, 0), None),
         "granite-4.0-h-tiny": ((7, 0), (1, 0)), "granite-4.0-h-small": ((32, 0), (9, 0)),
         "lfm2-350m": ((0.354, 3), None), "lfm2-1.2b": ((1.17, 2), None),
         "deepseek-v3": ((671, 0), (36.6, 1, "input")), "kimi-k2": ((1000, -2), (32, 0, "input")), "glm-4.5": ((355, 0), (32, 0, "embeddings")),
         "glm-4.5-air": ((106, 0), (12, 0, "embeddings")), "minimax-m2": ((230, -1), (10, 0, "embeddings")),
         "glm-4.7-flash": ((30, 0), (3, 0, "embeddings")),
         "deepseek-v3.1": ((671, 0), (36.6, 1, "input")), "glm-4.7": ((355, 0), (32, 0, "embeddings")),
         "gpt-oss-20b": ((20.9, 1), (3.6, 1, "input")), "gpt-oss-120b": ((116.8, 1), (5.1, 1, "input"))}
NEAR = {"glm-4.5": 0.01, "glm-4.5-air": 0.01, "glm-4.7": 0.01}  # "355B" / "106B": 352.80B / 106.85B built (MTP apart)


@pytest.mark.parametrize("name", sorted(CARDS))
def test_counts_equal_transformers_and_the_card(name):
    d = load(name)
    c = count_params(config_from_hf(d))
    total, active = hf_counts(d)
    print(f"{name}: {c['total']:,} params, {c['active']:,} active")
    assert (c["total"], c["active"]) == (total, active) and c["total"] == c["hf_total"]
    (card, digits), card_active = CARDS[name]
    if name in NEAR:
        assert abs(c["total"] / 1e9 - card) <= NEAR[name] * card
    else:
        assert round(c["total"] / 1e9, digits) == card
    if card_active:
        embed = d["vocab_size"] * d["hidden_size"]
        left_out = {None: 0, "input": embed, "embeddings": embed * (1 if d.get("tie_word_embeddings") else 2)}
        value, digits, what = (*card_active, None)[:3]
        assert round((c["active"] - left_out[what]) / 1e9, digits) == value


@pytest.mark.parametrize("name", ["glm-4.5", "glm-4.5-air", "glm-4.7"])
def test_glm_mtp_layer_counts_as_one_more_decoder_layer(name):
    """The MTP layer transformers skips (model.layers.{L}) counts as one of transformers' MoE decoder layers plus
    eh_proj (2H x H) and enorm / hnorm / shared_head.norm: the inspect figure of the checkpoint's own tensors."""
    d = load(name)
    c, H = count_params(config_from_hf(d)), d["hidden_size"]
    layer = sum(p.numel() for p in hf_meta_model(d).model.layers[-1].parameters())
    assert c["mtp"]["total"] == layer + 2 * H * H + 3 * H and c["mtp"]["pattern"] == "*E"
    assert c["mtp"]["with_trunk"] == c["total"] + c["mtp"]["total"]


@pytest.mark.parametrize("name, budget", [("granite-4.0-h-small", 20e9), ("falcon-h1-34b", 24e9), ("bamba-9b", 7e9),
                                                  ("glm-4.5-air", 70e9), ("deepseek-v3", 400e9),
                                                  ("glm-4.7-flash", 20e9)])
def test_plan_candidates_count_exactly_in_transformers(name, budget):
    """Plan's candidates sit within 2% under the budget, and the first ones, exported as the family's
    config.json, build transformers models of exactly plan's total and active counts."""
    d = plan(name, params=budget, top=3, verbose=False)
    cands, src = d["candidates"], config_from_hf(load(name))
    assert d["family"] == load(name)["model_type"] and len(cands) == 3
    assert all(0.98 * budget <= c["params"] <= budget for c in cands)
    assert any(c["prune_targets"].get("drop_layers") for c in cands)  # depth by the family's decoder layer
    for c in cands:
        hf = config_to_hf(candidate_config(src, c, d["family"]), d["family"])
        assert hf_counts(hf) == (c["params"], c["active_params"]), c["widths"]
        assert hf.get("n_routed_experts", 0) % (hf.get("n_group") or 1) == 0  # DeepSeek's 8 groups stay equal


def test_search_over_a_released_config_miniature(tmp_path):
    """`search` at full depth over Granite 4.0-H-Tiny's structure with widths / 32 (bench/dry_run_family.py's
    miniature, random weights): the pick meets the job's budget (4.5B of 6.94B, scaled alike) within plan's
    2%, is written as a granitemoehybrid checkpoint and transformers builds it with exactly the pick's count."""
    import gzip
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from dry_run_family import build, scaled

    from remodel.pipelines.commands.search import search_job
    from remodel.pipelines.data.data import embedded_corpus

    src, cfg, family = scaled("granite-4.0-h-tiny", 32)
    assert family == "granitemoehybrid" and cfg.pattern == src.pattern and cfg.moe.n_routed_experts == 64
    budget = count_params(cfg)["total"] * 4.5e9 / count_params(src)["total"]
    build(cfg, family, tmp_path / "mini")
    text = tmp_path / "train.txt"  # a slice of the embedded corpus: tokenized in seconds
    text.write_text(gzip.open(embedded_corpus()[0], "rt").read()[:400_000])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 80 tiny layers: with OMP_WAIT_POLICY=PASSIVE (conftest) 2 threads take 10x longer
    try:
        rep = search_job(tmp_path / "mini", tmp_path / "out", text, params=budget, top=2, candidates=1,
                         plan_options={"divisors": {"hidden_size": 8, "expert_ffn_size": 16, "shared_expert_size": 16}},
                         seq_len=64, batch=2, score_samples=4, eval_tokens=256, progress=False)
    finally:
        torch.set_num_threads(threads)
    pick = rep["pick"]
    assert 0.98 * budget <= pick["params"] <= budget
    d = json.loads((tmp_path / "out" / "config.json").read_text())
    assert d["model_type"] == "granitemoehybrid" and hf_counts(d)[0] == pick["params"]
