import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from remodel.compress.axes import tensor_axes
from remodel.compress.prune import new_config, plan_keep, prune_model
from remodel.compress.scores import save_scores
from remodel.models.checkpoint import CheckpointReader, CheckpointWriter
from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.hf import config_to_hf, our_shapes
from remodel.models.load import iter_hf_tensors, load_model, save_model
from remodel.pipelines.commands.prune import prune
from tests.conftest import FAMILY_CONFIGS, random_model
from tests.masking import masked_reference
from tests.rss import PEAK_RSS

REPO = Path(__file__).resolve().parents[1]

NEMO = ModelConfig(vocab_size=96, hidden_size=32, pattern="M*-EM-*E", num_attention_heads=6, num_key_value_heads=2,
                   head_dim=8, intermediate_size=48, mlp_act="relu2", mamba_num_heads=8, mamba_head_dim=6, n_groups=2,
                   ssm_state_size=8, conv_kernel=4, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, router="sigmoid",
                   routed_scaling_factor=2.0, n_group=2, topk_group=2)
LLAMA = ModelConfig(vocab_size=96, hidden_size=32, pattern="*-" * 3, num_attention_heads=8, num_key_value_heads=2,
                    head_dim=8, rope_theta=10000.0, intermediate_size=40, mlp_act="silu", mlp_gated=True,
                    norm_eps=1e-6)
QMOE = ModelConfig(vocab_size=96, hidden_size=32, pattern="*E" * 2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, rope_theta=10000.0, attention_bias=True, mlp_act="silu", mlp_gated=True,
                   n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                   moe_shared_expert_intermediate_size=24, shared_expert_gate=True, router="softmax",
                   norm_topk_prob=False)
CFGS = {"nemotron_h": NEMO, "llama": LLAMA, "qwen2_moe": QMOE}
IDS = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(1))
# width targets on every axis (smaller than the source, valid); pruned == masked per axis and family is
# tests/test_families.py's
ALL = {"nemotron_h": dict(hidden_size=24, ffn_size=29, attn_heads=4, mamba_heads=6, mamba_head_dim=4, experts=6,
                          expert_ffn_size=8, shared_expert_size=13),
       "llama": dict(hidden_size=24, ffn_size=29, attn_heads=4),
       "qwen2_moe": dict(hidden_size=24, attn_heads=2, experts=5, expert_ffn_size=8, shared_expert_size=13)}


@torch.no_grad()
def make_model(cfg, seed=0):
    """Random weights large enough that every unit matters (norm gains, D, router bias not trivial)."""
    return random_model(cfg, seed, bias=0.05, final_norm=True, d_std=1.0)


def random_scores(cfg, seed=0):
    """Random scores with the contract's names and shapes: which units go is random, so the tests
    are about the slicing, not about importance."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.rand(*s, generator=g)  # noqa: E731
    s = {"hidden": r(cfg.hidden_size), "block_importance": r(cfg.num_layers), "loss_increase": r(cfg.num_layers)}
    for i, c in enumerate(cfg.pattern):
        p = f"layers.{i}."
        if c == "-":
            s[p + "ffn"] = r(cfg.mlp.intermediate_size)
        elif c == "*":
            s[p + "attn"] = r(cfg.attention.num_attention_heads, cfg.attention.head_dim)
        elif c == "M":
            s[p + "mamba_x"] = r(cfg.mamba.mamba_num_heads, cfg.mamba.mamba_head_dim)
        else:
            s[p + "experts"] = r(cfg.moe.n_routed_experts)
            s[p + "expert_ffn"] = r(cfg.moe.n_routed_experts, cfg.moe.moe_intermediate_size)
            if cfg.moe.moe_shared_expert_intermediate_size:
                s[p + "shared_ffn"] = r(cfg.moe.moe_shared_expert_intermediate_size)
    return s


def write_scores(d, cfg, scores):
    return save_scores(d, scores, {"config": cfg.to_dict(), "source": "test", "samples": 0, "seq_len": 0,
                                   "tokens": 0, "baseline_loss": 0.0, "mode": "whole"})


@torch.no_grad()
def logits(model, ids=IDS):
    return model(ids).float()


def keep_from_report(report):
    return {k: torch.tensor(v["indices"]) for k, v in report["kept"].items()}


# ---- the tests -----------------------------------------------------------------------------

def test_axes_table_covers_every_tensor():
    for cfg in (NEMO, LLAMA, NEMO.replace(mamba_proj_bias=True, moe_latent_size=12),
                LLAMA.replace(attention_bias=True, attention_out_bias=True, qk_norm=True, mlp_bias=True)):
        table, shapes = tensor_axes(cfg), our_shapes(cfg)
        assert list(table) == list(shapes)
        assert all(len(table[n]) == len(s) for n, s in shapes.items())
        keep = plan_keep(cfg, random_scores(cfg), {k: v for k, v in ALL["nemotron_h" if "M" in cfg.pattern else "llama"].items()})
        new = new_config(cfg, keep)
        model = make_model(cfg)
        pruned = prune_model(model, keep)  # strict load: every pruned tensor has the new config's shape
        assert pruned.cfg == new and sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in model.parameters())


def test_group_aware_mamba_and_attention():
    cfg = NEMO
    s = random_scores(cfg, seed=3)
    r, q = cfg.mamba.mamba_num_heads // cfg.mamba.n_groups, cfg.attention.num_attention_heads // cfg.attention.num_key_value_heads
    for i, c in enumerate(cfg.pattern):  # group 0 outscores group 1 everywhere: group-unaware would fail
        if c == "M":
            s[f"layers.{i}.mamba_x"][:r] += 10
        if c == "*":
            s[f"layers.{i}.attn"][:q] += 10
    keep = plan_keep(cfg, s, dict(mamba_heads=4, attn_heads=4))
    model = make_model(cfg)
    pruned = prune_model(model, keep)
    for i, c in enumerate(cfg.pattern):
        if c == "M":
            heads = keep[f"layers.{i}.mamba_heads"]
            assert torch.bincount(heads // r, minlength=cfg.mamba.n_groups).tolist() == [2, 2]
            # new head j sits in new group j // (4/G); its original head must come from the same group
            assert torch.equal(heads // r, torch.arange(4) // (4 // cfg.mamba.n_groups))
            # B and C (per group) are untouched; x rows are the kept heads' rows
            Im, Im2, GN = cfg.mamba_inner, 4 * cfg.mamba.mamba_head_dim, cfg.mamba.n_groups * cfg.mamba.d_state
            W, W2 = model.layers[i].mixer.in_proj.weight, pruned.layers[i].mixer.in_proj.weight
            assert torch.equal(W2[2 * Im2:2 * Im2 + 2 * GN], W[2 * Im:2 * Im + 2 * GN])
            rows = (heads[:, None] * cfg.mamba.mamba_head_dim + torch.arange(cfg.mamba.mamba_head_dim)).reshape(-1)
            assert torch.equal(W2[Im2:2 * Im2], W[Im + rows])
            assert torch.equal(pruned.layers[i].mixer.A_log, model.layers[i].mixer.A_log[heads])
        if c == "*":
            heads = keep[f"layers.{i}.attn_heads"]
            assert torch.bincount(heads // q, minlength=cfg.attention.num_key_value_heads).tolist() == [2, 2]
            assert torch.equal(pruned.layers[i].mixer.k_proj.weight, model.layers[i].mixer.k_proj.weight)
    assert logits(pruned).isfinite().all()
    diff = (logits(pruned) - logits(masked_reference(model, keep))).abs().max().item()
    assert diff <= 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("prune")
    out = {}
    for family, cfg in CFGS.items():
        model = make_model(cfg)
        src = save_model(model, root / f"{family}_src")
        (src / "tokenizer_config.json").write_text("{}")
        scores = random_scores(cfg, seed=7)
        out[family] = (model, src, write_scores(root / f"{family}_scores", cfg, scores), scores)
    return root, out


@pytest.mark.parametrize("family", ["nemotron_h", "llama"])
def test_identity_pipeline(checkpoints, family):
    root, ck = checkpoints
    model, src, scores_dir, _ = ck[family]
    cfg = model.cfg
    full = dict(hidden_size=cfg.hidden_size, ffn_size=cfg.mlp.intermediate_size, attn_heads=cfg.attention.num_attention_heads)
    if family == "nemotron_h":
        full.update(mamba_heads=cfg.mamba.mamba_num_heads, mamba_head_dim=cfg.mamba.mamba_head_dim, experts=cfg.moe.n_routed_experts,
                    expert_ffn_size=cfg.moe.moe_intermediate_size, shared_expert_size=cfg.moe.moe_shared_expert_intermediate_size)
    out = root / f"{family}_identity"
    report = prune(src, out, scores_dir, **full)
    back = load_model(out)
    assert back.cfg == cfg.replace(extra=back.cfg.extra)
    assert torch.equal(logits(back), logits(model))
    assert report["params_before"] == report["params_after"]
    assert (out / "tokenizer_config.json").exists() and (out / "importance.png").stat().st_size > 1000


@pytest.mark.parametrize("family, drop, skipped", [("nemotron_h", [2, 5], [2, 5]),
                                                    ("llama", [1], [2, 3]),  # decoder layer 1 = our layers 2, 3
                                                    ("qwen2_moe", [0], [0, 1])])
def test_pruned_checkpoint_loads_in_transformers(checkpoints, family, drop, skipped):
    from transformers import AutoModelForCausalLM

    root, ck = checkpoints
    model, src, scores_dir, _ = ck[family]
    out = root / f"{family}_pruned"
    report = prune(src, out, scores_dir, drop_layers=",".join(map(str, drop)), **ALL[family])
    json.loads((out / "remodel_report.json").read_text())
    ours = load_model(out)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = hf(IDS).logits.float()
    mine = logits(ours)
    diff = (mine - theirs).abs().max().item()
    print(f"{family}: transformers vs ours on the pruned checkpoint {diff:.2e}; params "
          f"{report['params_before']['total']} -> {report['params_after']['total']}")
    assert diff <= 1e-4
    assert report["params_after"]["total"] == sum(p.numel() for p in ours.parameters()) < report["params_before"]["total"]
    # end to end: the written checkpoint is the masked model with the dropped layers skipped
    keep = keep_from_report(report)
    ref = masked_reference(model, keep)
    assert skipped == [i for i in range(model.cfg.num_layers) if i not in keep["layers"].tolist()]
    assert skipped == report["dropped_layers"]
    for i in skipped:
        ref.layers[i].forward = lambda x, *a: x
    assert (mine - logits(ref)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["nemotron_h", "llama"])
def test_depth_pruning(checkpoints, family):
    root, ck = checkpoints
    model, src, scores_dir, scores = ck[family]
    cfg = model.cfg
    drop, ours = ("1,4", [1, 4]) if family == "nemotron_h" else ("0", [0, 1])
    out = root / f"{family}_depth"
    report = prune(src, out, scores_dir, drop_layers=drop)
    pruned = load_model(out)
    want = "".join(c for i, c in enumerate(cfg.pattern) if i not in ours)
    assert pruned.cfg.pattern == want == report["pattern_after"]
    hf = json.loads((out / "config.json").read_text())
    if family == "nemotron_h":
        assert len(hf["layers_block_type"]) == len(want)
    else:
        assert hf["num_hidden_layers"] == 2
    ref = copy.deepcopy(model)
    for i in ours:
        ref.layers[i].forward = lambda x, *a: x  # the layer skipped: identity on the residual stream
    assert torch.equal(logits(pruned), logits(ref))

    # --num-layers K drops the lowest loss_increase (block_importance when there is none), per family layer
    s = dict(scores, loss_increase=-scores["block_importance"])  # the two metrics disagree completely
    units = [[i] for i in range(cfg.num_layers)] if family == "nemotron_h" else [[0, 1], [2, 3], [4, 5]]
    K = len(units) - 1 if family == "llama" else 5
    chosen = []
    for metric in ("loss_increase", "block_importance"):
        per_unit = torch.stack([s[metric][u].sum() for u in units])
        lowest = sorted(per_unit.argsort()[:len(units) - K].tolist())
        keep = plan_keep(cfg, s, dict(num_layers=K), family)
        assert keep["layers"].tolist() == [i for j, u in enumerate(units) if j not in lowest for i in u]
        assert new_config(cfg, keep).num_layers == K * len(units[0])
        chosen.append(lowest)
        s.pop("loss_increase", None)  # second round: only block_importance left
    assert chosen[0] != chosen[1]


@pytest.mark.parametrize("family, targets, words", [
    ("nemotron_h", dict(mamba_heads=5), "--mamba-heads 5 is not a multiple of n_groups=2; nearest valid: 4 or 6"),
    ("nemotron_h", dict(attn_heads=5), "--attn-heads 5 is not a multiple of num_key_value_heads=2"),
    ("nemotron_h", dict(attn_heads=5), "nearest valid: 4 or 6"),
    ("nemotron_h", dict(hidden_size=64), "larger than the source's hidden_size=32"),
    ("nemotron_h", dict(expert_ffn_size=11), "--expert-ffn-size 11 is not a multiple of 8"),
    ("nemotron_h", dict(hidden_size=20), "nearest valid: 16 or 24"),
    ("nemotron_h", dict(ffn_size=0), "--ffn-size must be positive"),
    ("nemotron_h", dict(mamba_head_dim=-2), "--mamba-head-dim must be positive"),
    ("nemotron_h", dict(experts=1), "fewer than num_experts_per_tok=2; nearest valid: 4"),
    ("nemotron_h", dict(experts=5), "--experts 5 does not fit n_group=2 expert groups"),
    ("nemotron_h", dict(experts=5), "nearest valid: 4 or 6"),
    ("nemotron_h", dict(drop_layers="0,1,2,3,4,5,6,7"), "every one of the 8 layers"),
    ("nemotron_h", dict(drop_layers="8"), "index 8 is out of range"),
    ("nemotron_h", dict(num_layers=8), "--num-layers 8 does not remove any of the source's 8 layers; nearest valid: 7"),
    ("nemotron_h", dict(num_layers=6, drop_layers="1"), "exclusive"),
    ("llama", dict(attn_heads=3), "nearest valid: 2 or 4"),
    ("llama", dict(hidden_size=20, attn_heads=6), "not a multiple of the 6 attention heads"),
    ("llama", dict(mamba_heads=4), "no mamba layers"),
    ("llama", dict(experts=4), "no moe layers"),
    ("llama", dict(drop_layers="3"), "out of range (the model has decoder layers 0..2)"),
    ("llama", dict(), "nothing to prune"),
])
def test_impossible_targets_are_refused_before_any_work(checkpoints, family, targets, words):
    root, ck = checkpoints
    _, src, _, _ = ck[family]
    out = root / "refused"
    with pytest.raises(RemodelError) as e:
        prune(src, out, scores_dir=None, data=None, **targets)  # no scores, no data: validation comes first
    msg = str(e.value)
    assert words in msg and "\n" not in msg, msg
    assert not out.exists()


def test_scores_of_another_model_are_refused(checkpoints):
    root, ck = checkpoints
    _, src, _, _ = ck["nemotron_h"]
    _, _, llama_scores, _ = ck["llama"]
    with pytest.raises(RemodelError, match="different model") as e:
        prune(src, root / "wrong", llama_scores, ffn_size=32)
    named = re.search(r"differs in ([^)]*)\)", str(e.value)).group(1).split(", ")
    paths = FAMILY_CONFIGS["nemotron_h"].flat()  # every field by its path ("moe.n_routed_experts")
    assert "pattern" in named and set(named) <= set(paths), named
    assert not (root / "wrong").exists()


# ---- memory: a checkpoint much larger than the cap streams through ---------------------------

MEMORY_SCRIPT = PEAK_RSS + """
import re, sys
import matplotlib.pyplot
from remodel.models.hf import config_to_hf
from remodel.models.load import load_config
from remodel.pipelines.commands.prune import prune
config_to_hf(load_config(sys.argv[1]), "nemotron_h")  # code and transformers' config classes loaded up front
base = reset_peak()
prune(sys.argv[1], sys.argv[2], sys.argv[3], hidden_size=768, ffn_size=2048, max_shard_bytes=int(sys.argv[4]))
print(base, status("VmHWM"))
"""


def test_pruning_memory_is_bounded(tmp_path):
    mb = 1024**2
    cfg = ModelConfig(vocab_size=2048, hidden_size=1024, pattern="M-*-" * 3, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=128, intermediate_size=4096, mamba_num_heads=32,
                      mamba_head_dim=64, n_groups=4, ssm_state_size=64, chunk_size=64)
    src, out = tmp_path / "big", tmp_path / "big_pruned"
    try:
        w = CheckpointWriter(src, max_shard_bytes=40 * mb)
        shapes = our_shapes(cfg)
        value = {n: float(k) for k, n in enumerate(shapes)}  # constant per tensor: fast to write, easy to check
        for name, t in iter_hf_tensors(lambda n: torch.full(shapes[n], value[n]), cfg, "nemotron_h"):
            w.add(name, t)
        w.close(config_to_hf(cfg, "nemotron_h"))
        ckpt_bytes = CheckpointReader(src).total_bytes()
        assert ckpt_bytes >= 300 * mb
        write_scores(tmp_path / "scores", cfg, random_scores(cfg))

        res = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(src), str(out), str(tmp_path / "scores"),
                              str(16 * mb)], cwd=REPO, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        assert res.returncode == 0, res.stderr[-3000:]
        base, peak = map(int, res.stdout.split()[-2:])
        growth, cap = peak - base, ckpt_bytes // 3
        print(f"checkpoint {ckpt_bytes / mb:.0f} MiB, baseline RSS {base / mb:.0f} MiB, peak RSS {peak / mb:.0f} MiB, "
              f"growth {growth / mb:.1f} MiB, cap {cap / mb:.0f} MiB")
        assert growth < cap
        r = CheckpointReader(out)
        assert r.config["hidden_size"] == 768 and r.config["intermediate_size"] == 2048
        up = r.get("backbone.layers.1.mixer.up_proj.weight")
        assert up.shape == (2048, 768) and torch.equal(up, torch.full_like(up, value["layers.1.mixer.up_proj.weight"]))
        assert r.total_bytes() < ckpt_bytes * 0.7
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def test_prune_from_data_scores_then_reuses_them(tmp_path):
    from remodel.compress.scores import load_scores
    from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path

    cfg = NEMO.replace(vocab_size=2048)  # the embedded tokenizer's vocabulary
    src = save_model(make_model(cfg), tmp_path / "src", aux_from=embedded_tokenizer_path())
    _, valid = embedded_corpus()
    opts = dict(samples=4, seq_len=32, batch=2, loss_batches=1, progress=False)
    with pytest.raises(RemodelError, match="unknown scoring options"):
        prune(src, tmp_path / "bad", data=valid, ffn_size=24, sampels=4)
    report = prune(src, tmp_path / "a", data=valid, ffn_size=24, num_layers=6, **opts)
    scores, meta = load_scores(tmp_path / "a" / "scores")  # calibration kept for re-pruning
    assert meta["samples"] == 4 and report["scores"] == str(tmp_path / "a" / "scores")
    for i in (i for i, c in enumerate(cfg.pattern) if c == "-" and i in report["kept"]["layers"]["indices"]):
        want = scores[f"layers.{i}.ffn"].argsort(descending=True)[:24].sort().values.tolist()
        assert report["kept"][f"layers.{i}.ffn"]["indices"] == want  # the most important neurons stay
    lowest = sorted(scores["loss_increase"].argsort()[:2].tolist())
    assert report["dropped_layers"] == lowest and report["depth_metric"] == "loss_increase"
    again = prune(src, tmp_path / "b", tmp_path / "a" / "scores", ffn_size=24, num_layers=6)
    assert again["kept"] == report["kept"]
    ra, rb = CheckpointReader(tmp_path / "a"), CheckpointReader(tmp_path / "b")
    assert ra.keys() == rb.keys() and all(torch.equal(ra.get(k), rb.get(k)) for k in ra.keys())
