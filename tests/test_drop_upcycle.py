"""Drop-Upcycling (`remodel upcycle --drop-ratio R`, issue 29) and the MoE figures of a training run:
exactly round(R * Fm) neurons re-initialised per expert, a different subset per expert, everything else
bit-identical to the plain upcycle; the draws follow the dense matrices' statistics; the experts'
same-shard similarity is 1.0 for naive copies and below with R > 0; --exact and R out of [0, 1] refused
in one line; a short MoE training run reports load balance, router entropy and expert similarity."""
import gzip
import json
import math
import shutil

import pytest
import torch

from remodel.models.config import ModelConfig
from remodel.models.load import load_model, save_model
from remodel.models.model import HybridLM, init_weights
from remodel.pipelines.commands.upcycle import upcycle
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path
from remodel.pipelines.training import metrics
from remodel.upcycle.drop import mean_std
from remodel.upcycle.virtual_groups import drop_upcycle, make_plan, upcycle_mlp, upcycle_model
from tests.cli_contract import fails, listing
from tests.conftest import FAMILY_CONFIGS, random_model

N, G, T, R = 8, 2, 4, 0.3  # llama's F = 40: expert size 20, round(0.3 * 20) = 6 neurons per expert
PROJ = ("up_proj", "gate_proj", "down_proj")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(dense model, its dir, report R=0, report R>0, state dict R=0, state dict R>0), same seed."""
    d = tmp_path_factory.mktemp("drop")
    dense = random_model(FAMILY_CONFIGS["llama"])
    save_model(dense, d / "dense", family="llama")
    reps, sds = [], []
    for r in (0.0, R):
        reps.append(upcycle(d / "dense", d / f"o{r}", experts=N, granularity=G, top_k=T, seed=7, drop_ratio=r))
        sds.append(load_model(d / f"o{r}").state_dict())
    return dense, d, *reps, *sds


def _changed(a: torch.Tensor, b: torch.Tensor, leaf: str) -> set:
    """The neurons (rows of up/gate, columns of down) of one expert where a and b differ."""
    diff = (a != b).any(0) if leaf == "down_proj" else (a != b).any(1)
    return set(diff.nonzero().squeeze(1).tolist())


def test_drop_reinitialises_round_r_f_neurons_per_expert(pair):
    dense, d, rep0, rep, naive, drop = pair
    assert set(naive) == set(drop)
    k = round(R * rep["expert_size"])
    assert rep["drop_upcycling"]["neurons_per_expert"] == k == 6 and not rep["exact_expected"]
    moe_layers = 0
    for name in naive:
        leaf = name.rsplit(".", 1)[-1]
        if ".experts." not in name + ".":
            assert torch.equal(naive[name], drop[name]), name  # routers, attention, norms: bit-identical
            continue
        if leaf != "up_proj":
            continue
        moe_layers += 1
        prefix = name[: -len("up_proj")]
        subsets = []
        for e in range(N):
            sets = [_changed(naive[prefix + p][e], drop[prefix + p][e], p) for p in PROJ]
            assert sets[0] == sets[1] == sets[2] and len(sets[0]) == k, (name, e, sets)
            subsets.append(frozenset(sets[0]))
        assert len(set(subsets)) == N  # a different subset per expert
    assert moe_layers == 2
    # the streamed checkpoint is the in-memory drop-upcycle, bit for bit (the same seeded draws)
    plan = make_plan(dense.cfg, N, G, T, router=rep["router"]["mode"])
    mem = upcycle_model(dense, plan, family=rep["to"], seed=7, drop_ratio=R)[0]
    assert all(torch.equal(v, drop[k]) for k, v in mem.state_dict().items())


def test_drawn_values_follow_the_dense_statistics():
    cfg = ModelConfig(vocab_size=8, hidden_size=64, pattern="-", intermediate_size=512, mlp_act="silu", mlp_gated=True)
    p = make_plan(cfg, experts=4, granularity=1, top_k=1)  # G = 1: s = 1, the copies are the dense matrices
    g = torch.Generator().manual_seed(0)
    up, gate = torch.randn(512, 64, generator=g) * 0.05 + 0.3, torch.randn(512, 64, generator=g) * 0.1 - 0.2
    down = torch.randn(64, 512, generator=g) * 0.02 + 0.1
    moe = upcycle_mlp(p, up, down, gate, torch.zeros(4, 64))
    out = drop_upcycle(moe, up, down, gate, 0.5, seed=1, layer=0)
    for leaf, src in (("up_proj", up), ("gate_proj", gate), ("down_proj", down)):
        new, old = out[f"experts.{leaf}"].fused(), moe[f"experts.{leaf}"].fused()
        drawn = new[new != old]
        assert drawn.numel() == 4 * 256 * 64  # half of each expert's neurons
        m, s = mean_std(src)
        assert math.isclose(m, src.mean().item(), abs_tol=1e-6) and math.isclose(s, src.std().item(), rel_tol=1e-5)
        assert abs(drawn.mean().item() - m) < 0.05 * s and abs(drawn.std().item() / s - 1) < 0.05, leaf


def test_same_shard_similarity_one_for_copies_below_with_drop(pair):
    dense, d, rep0, rep, naive, drop = pair
    for layer in rep0["expert_similarity"]["layers"]:
        assert abs(layer["same_shard"] - 1.0) < 1e-6
    for layer in rep["expert_similarity"]["layers"]:
        assert layer["same_shard"] < 0.99
    assert [x["layer"] for x in rep["expert_similarity"]["layers"]] == [1, 3]
    cfg = json.loads((d / f"o{R}" / "config.json").read_text())["remodel_upcycle"]
    assert cfg["granularity"] == G and cfg["drop_ratio"] == R
    # what a training run logs before its first step (metrics.MoEStats), on the loaded checkpoints
    for r, want_one in ((0.0, True), (R, False)):
        model = load_model(d / f"o{r}")
        stats = metrics.MoEStats(model, G, measure_weights=True)
        sims = stats.similarity(model)
        stats.close()
        assert sorted(sims) == ["layers.1", "layers.3"]
        for s in sims.values():
            same = s["expert_cosine_same_shard"]
            assert (abs(same - 1.0) < 1e-6) if want_one else same < 0.99, (r, s)
    assert rep["deviation"]["rel_diff"] > 1e-3  # drop-upcycling is not function-preserving at init: measured


@pytest.mark.parametrize("extra,match", [(["--exact", "--drop-ratio", "0.5"], "--exact"),
                                         (["--drop-ratio", "1.5"], "(--drop-ratio)"),
                                         (["--drop-ratio", "-0.1"], "(--drop-ratio)"),
                                         (["--drop-ratio", "nan"], "(--drop-ratio)")])
def test_bad_drop_ratio_refused_in_one_line(pair, capsys, extra, match):
    d = pair[1]
    before = listing(d)
    line = fails(capsys, "upcycle", d / "dense", d / "bad", "--experts", N, "--granularity", G, "--top-k", T, *extra,
                 match=match)
    assert "--drop-ratio" in line
    assert listing(d) == before


def _tiny_dense(path):
    """A dense hybrid with the shipped tokenizer (vocabulary 2048), small enough to train in seconds."""
    cfg = ModelConfig(vocab_size=2048, hidden_size=16, pattern="M*-", tie_word_embeddings=True, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, intermediate_size=32, mamba_num_heads=4, mamba_head_dim=8,
                      ssm_state_size=8, chunk_size=16, mlp_act="relu2")
    save_model(init_weights(HybridLM(cfg), seed=0), path)
    for f in embedded_tokenizer_path().iterdir():
        shutil.copy(f, path / f.name)
    return path


def test_training_reports_router_and_expert_figures(tmp_path):
    from remodel.pipelines.training.train import train
    _tiny_dense(tmp_path / "dense")
    upcycle(tmp_path / "dense", tmp_path / "moe", experts=4, granularity=2, top_k=2, seed=1)
    with gzip.open(embedded_corpus()[0], "rt", encoding="utf-8") as f:
        (tmp_path / "train.txt").write_text("\n".join(f.read().splitlines()[:300]) + "\n")
    rep = train(tmp_path / "moe", tmp_path / "out", tmp_path / "train.txt", steps=3, seq_len=32, batch=2, lr=3e-3,
                warmup=1, log_every=0, checkpoint_every=3, grad_accum=2)
    moe = rep["moe"]
    assert moe["granularity"] == 2 and sorted(moe["layers"]) == ["layers.2"]
    assert abs(moe["initial"]["layers.2"]["expert_cosine_same_shard"] - 1.0) < 1e-6
    fig = moe["layers"]["layers.2"]
    assert fig["step"] == [1, 2, 3]
    assert all(x >= 1.0 for x in fig["load_balance"])
    assert all(0.0 <= x <= math.log(4) + 1e-6 for x in fig["router_entropy"])
    assert all(0.0 < x <= 1.0 + 1e-6 for x in fig["expert_cosine_same_shard"])
    assert all(-1.0 <= x <= 1.0 for x in fig["expert_cosine_all_pairs"])
    assert fig["expert_cosine_same_shard"][-1] < 1.0  # training moved the copies apart
    saved = json.loads((tmp_path / "out" / "remodel_report.json").read_text())
    assert saved["moe"]["layers"] == moe["layers"] and "moe" in saved["history"][-1]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["remodel_upcycle"]["granularity"] == 2
    assert (tmp_path / "out" / "loss.png").stat().st_size > 0
    # full recomputation replays each forward in the backward (the hooks fire again): the same figures
    again = train(tmp_path / "moe", tmp_path / "out2", tmp_path / "train.txt", steps=3, seq_len=32, batch=2, lr=3e-3,
                  warmup=1, log_every=0, checkpoint_every=3, grad_accum=2, recompute="full")["moe"]["layers"]["layers.2"]
    assert again["load_balance"] == fig["load_balance"] and again["router_entropy"] == fig["router_entropy"]
