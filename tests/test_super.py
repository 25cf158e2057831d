"""Nemotron 3 Super 120B-A12B (issue 20 item 6): the shipped public config, its counts against the
published 120B / 12B and against transformers, the LatentMoE latent as a plan/search axis, and the
Super-pattern dry run (bench/dry_run_super.py) end to end at tiny size."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from remodel.compress.scores import save_scores
from remodel.compress.search_space import build_space
from remodel.models.hf import config_from_hf
from remodel.models.load import load_config, load_model
from remodel.models.params import count_params
from remodel.pipelines.commands.inspection import inspect
from remodel.pipelines.commands.plan import plan
from remodel.pipelines.commands.search import search_job

REPO = Path(__file__).resolve().parents[1]
NAME = "nemotron-3-super-120b-a12b"
CONFIG = REPO / "models" / "configs" / f"{NAME}.json"
AXES = ("experts", "expert_ffn_size", "latent_size", "hidden_size", "depth")


def _dry():
    spec = importlib.util.spec_from_file_location("dry_run_super", REPO / "bench" / "dry_run_super.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_super_counts_match_published_figures():
    """inspect on the shipped name: 88 layers (40 M, 40 E, 8 *), LatentMoE 1024, 512 experts top-22;
    total within 1% of 120B, active without the input embeddings within 3% of 12B; the MTP head counted apart, not in total."""
    d = inspect(NAME)
    p, w = d["params"], d["widths"]
    assert d["layers"] == {"mamba": 40, "attention": 8, "moe": 40}
    assert (w["hidden_size"], w["moe_latent_size"], w["n_routed_experts"], w["num_experts_per_tok"]) == (4096, 1024, 512, 22)
    assert p["total"] == 120_668_687_360 and abs(p["total"] / 120e9 - 1) < 0.01
    assert p["active"] == 12_770_216_960
    no_embed = p["active"] - p["by_type"]["embeddings"]
    assert no_embed == 12_233_346_048 and abs(no_embed / 12e9 - 1) < 0.03
    assert p["by_axis"]["latent_size"]["size"] == 1024
    cfg = config_from_hf(json.loads(CONFIG.read_text()))  # the MTP block is read, counted apart
    assert (cfg.mtp_layers, cfg.mtp_pattern) == (1, "*E") and p["mtp"]["total"] == 2_942_324_736


def test_super_config_loads_in_transformers_with_the_same_count():
    """transformers' NemotronHConfig reads the file as is (MTP block '*E' declared) and its model, built
    on the meta device, has exactly our parameter count and routed-expert count."""
    d = json.loads(CONFIG.read_text())
    h = AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k not in ("model_type", "architectures")})
    assert h.num_nextn_predict_layers == 1 and h.mtp_layers_block_type == ["full_attention", "moe"]
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(h)
    c = count_params(config_from_hf(d))
    assert sum(x.numel() for x in m.parameters()) == c["total"]
    assert sum(x.numel() for n, x in m.named_parameters() if ".mixer.experts." in n) == c["routed"] == 112_742_891_520


def test_latent_is_a_search_axis():
    """The latent is searched for a LatentMoE (1024 -> 896, 768, 640 at full scale) and not for a model
    without one; a latent-only budget lands on the latent whose exact count it names."""
    cfg = config_from_hf(json.loads(CONFIG.read_text()))
    assert build_space(cfg).values["latent_size"] == [1024, 896, 768, 640]
    nano = config_from_hf(json.loads((CONFIG.parent / "nemotron-3-nano-30b-a3b.json").read_text()))
    assert build_space(nano).values["latent_size"] == [None]
    target = count_params(cfg.replace(moe_latent_size=768))["total"]
    assert count_params(cfg)["total"] - target == 256 * count_params(cfg, by_axis=True)["by_axis"]["latent_size"]["per_unit"]
    c = plan(cfg, params=target + 1, axes=("latent_size",), top=3, verbose=False)["candidates"]
    assert c[0]["changed"] == {"latent_size": [1024, 768]} and c[0]["params"] == target
    assert c[0]["prune_targets"] == {"latent_size": 768}


def test_super_75b_plan_prunes_every_axis():
    """Full-scale plan to 75B total / 10B active over experts, expert FFN, latent, hidden and depth:
    every candidate meets both budgets (plan re-counts each), and the top 20 use every axis."""
    d = plan(NAME, params=75e9, active_params=10e9, axes=AXES, top=20, verbose=False)
    c = d["candidates"]
    assert len(c) == 20 and d["maximal"] > 1000
    assert all(x["params"] <= 75e9 and x["active_params"] <= 10e9 for x in c)
    assert all(x["params"] >= 0.98 * 75e9 or x["active_params"] >= 0.98 * 10e9 for x in c)  # the window
    used = {a for x in c for a in x["changed"]} | ({"depth"} if any(x["drop_layers"] for x in c) else set())
    assert used == set(AXES)


def random_scores(d, cfg, seed=0):
    """A SCORES directory with every name the MoE/latent pruner reads (random values)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.rand(*shape, generator=g)  # noqa: E731
    t = {"hidden": r(cfg.hidden_size), "block_importance": r(cfg.num_layers), "loss_increase": r(cfg.num_layers)}
    for i, c in enumerate(cfg.pattern):
        p = f"layers.{i}."
        if c == "*":
            t[p + "attn"] = r(cfg.attention.num_attention_heads, cfg.attention.head_dim)
        elif c == "M":
            t[p + "mamba_x"] = r(cfg.mamba.mamba_num_heads, cfg.mamba.mamba_head_dim)
        elif c == "E":
            t.update({p + "experts": r(cfg.moe.n_routed_experts), p + "latent": r(cfg.moe.moe_latent_size),
                      p + "expert_ffn": r(cfg.moe.n_routed_experts, cfg.moe.moe_intermediate_size),
                      p + "shared_ffn": r(cfg.moe.moe_shared_expert_intermediate_size)})
    return save_scores(d, t, {"config": cfg.to_dict(), "samples": 1, "seq_len": 8, "tokens": 8})


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import gzip

    from remodel.pipelines.data.data import embedded_corpus
    p = tmp_path_factory.mktemp("data") / "data.txt"
    with gzip.open(embedded_corpus()[0], "rt") as f:
        p.write_text("".join(next(f) for _ in range(300)))
    return p


def test_dry_run_smoke(tmp_path, data):
    """The dry run's miniature (88-layer Super pattern, widths / 32; 16 experts top-4 here for speed):
    search to its scaled 75B-class budget on the latent axis prunes the latent 32 -> 24 in every MoE
    layer, and transformers loads the result with our logits."""
    dry = _dry()
    cfg = dry.scaled_config(32).replace(vocab_size=2048, n_routed_experts=16, num_experts_per_tok=4)
    assert cfg.pattern == dry.reference(NAME).pattern and (cfg.hidden_size, cfg.moe.moe_latent_size) == (128, 32)
    dry.build_checkpoint(cfg, tmp_path / "src")
    b = dry.scaled_budget(cfg, 32)
    target = count_params(cfg.replace(moe_latent_size=24))["total"]
    opts = {**b["plan_options"], "axes": ("latent_size",)}
    rep = search_job(tmp_path / "src", tmp_path / "out", data, params=target, plan_options=opts, top=1, candidates=1,
                 scores=random_scores(tmp_path / "scores", cfg), seq_len=32, batch=2, eval_tokens=128, progress=False)
    got = load_config(tmp_path / "out")
    assert got.moe.moe_latent_size == 24 and got.pattern == cfg.pattern
    assert count_params(got)["total"] == rep["pick"]["params"] == target
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert hf.model.layers[1].mixer.fc1_latent_proj.weight.shape == (24, 128)
    ids = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, load_model(tmp_path / "out")(ids), atol=2e-4, rtol=1e-4)
