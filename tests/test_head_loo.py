"""Leave-one-out head scores (compress/head_loo.py, `score --method loo`): each head's cost equals the measured
loss increase of the model with that head pruned, prune keeps the heads the costs rank highest, bad input is
refused in one line."""
import pytest
import torch

from remodel.compress.head_criteria import rank_correlation, unit_values
from remodel.compress.head_loo import head_costs, loo_scores, loo_units
from remodel.compress.importance import model_loss, score_model
from remodel.compress.prune import plan_keep, prune_model
from remodel.compress.scores import load_scores
from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.families import FAMILIES
from remodel.models.hf import config_from_hf
from remodel.models.load import save_model
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path
from remodel.pipelines.commands.score import score
from tests.conftest import random_model

BASE = dict(vocab_size=96, hidden_size=24, norm_eps=1e-5, intermediate_size=40)
MAMBA = dict(mamba_num_heads=4, mamba_head_dim=4, ssm_state_size=5, conv_kernel=4, chunk_size=8)
GDN = dict(linear_key_head_dim=8, linear_value_head_dim=6)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def batches(vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 16), generator=g) for _ in range(2)]


def without(n, drop):
    return torch.tensor([x for x in range(n) if x not in drop])


@pytest.mark.parametrize("before", [False, True])
def test_mamba_head_cost_is_the_pruned_models_loss_increase(before):
    """One group, so a single head can be pruned for real: its cost is that model's loss minus the full one's
    (the gated norm then runs over the kept heads only, in either order of norm and gate)."""
    cfg = ModelConfig(pattern="-M-", n_groups=1, mamba_norm_before_gate=before, **BASE, **MAMBA)
    model, data = random_model(cfg, 0), batches(96)
    costs, base = head_costs(model, data)
    assert base == pytest.approx(model_loss(model, data), abs=1e-6)
    c = costs["layers.1.mamba_heads_loo"]
    assert c.abs().max() > 1e-4  # the heads matter: the comparison below is not between zeros
    for h in range(4):
        pruned = prune_model(model, {"layers.1.mamba_heads": without(4, [h])})
        assert abs(float(c[h]) - (model_loss(pruned, data) - base)) < 2e-6, h


@pytest.mark.parametrize("unit", ["value", "key"])
def test_gdn_head_and_group_costs_are_the_pruned_models_loss_increase(unit):
    hk = 1 if unit == "value" else 2
    cfg = ModelConfig(pattern="D-", linear_num_key_heads=hk, linear_num_value_heads=2 * hk, **BASE, **GDN)
    model, data = random_model(cfg, 0), batches(96)
    costs, base = head_costs(model, data)
    c = costs[f"layers.0.lin_{unit[0]}_heads_loo"]
    assert c.shape == (2,) and c.abs().max() > 1e-4
    for j in range(2):
        keep = ({"layers.0.lin_v_heads": without(2, [j])} if unit == "value" else
                {"layers.0.lin_k_heads": without(2, [j]), "layers.0.lin_v_heads": without(4, [2 * j, 2 * j + 1])})
        assert abs(float(c[j]) - (model_loss(prune_model(model, keep), data) - base)) < 1e-5, j


def test_prune_keeps_the_heads_the_costs_rank_highest():
    cfg = ModelConfig(pattern="MD", n_groups=2, linear_num_key_heads=2, linear_num_value_heads=4,
                      **{**MAMBA, "mamba_num_heads": 6}, **BASE, **GDN)
    model, data = random_model(cfg, 3), batches(96)
    scores, _ = score_model(model, data, loss_increase=False)
    costs = {"layers.0.mamba_heads_loo": torch.tensor([0.3, -0.2, 0.1, 0.0, 0.5, -0.1]),
             "layers.1.lin_v_heads_loo": torch.tensor([-0.4, 0.2, 0.1, 0.3]),
             "layers.1.lin_k_heads_loo": torch.tensor([0.1, 0.6])}
    s = loo_scores(cfg, scores, costs)
    keep = plan_keep(cfg, s, {"mamba_heads": 4, "linear_value_heads": 2})
    assert keep["layers.0.mamba_heads"].tolist() == [0, 2, 3, 4]  # per group of 3: the two costliest
    assert keep["layers.1.lin_v_heads"].tolist() == [1, 3]  # per key group: the costlier value head
    keep = plan_keep(cfg, s, {"linear_key_heads": 1, "linear_value_heads": 1})
    assert keep["layers.1.lin_k_heads"].tolist() == [1] and keep["layers.1.lin_v_heads"].tolist() == [3]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = ModelConfig(pattern="M-", n_groups=2, **{**BASE, "vocab_size": 2048}, **MAMBA)
    d = tmp_path_factory.mktemp("hf") / "model"
    save_model(random_model(cfg, 4), d, aux_from=embedded_tokenizer_path())
    return d


def test_score_loo_writes_scores_prune_reads(hf_dir, tmp_path):
    out = tmp_path / "scores"
    rep = score(hf_dir, embedded_corpus()[1], out, method="loo", samples=4, seq_len=32, batch=2, progress=False)
    tensors, meta = load_scores(out)
    c = tensors["layers.0.mamba_heads_loo"]
    assert meta["method"] == "loo" and rep["method"] == "loo" and c.shape == (4,) and c.abs().max() > 1e-5
    keep = plan_keep(ModelConfig.from_dict(meta["config"]), tensors, {"mamba_heads": 2})
    assert keep["layers.0.mamba_heads"].tolist() == [int(c[:2].argmax()), 2 + int(c[2:].argmax())]


def test_score_loo_refuses_bad_input_in_one_line(hf_dir, tmp_path):
    plain = tmp_path / "plain"
    cfg = ModelConfig(pattern="-*", num_attention_heads=4, num_key_value_heads=2, head_dim=6,
                      **{**BASE, "vocab_size": 2048})
    save_model(random_model(cfg, 0), plain, aux_from=embedded_tokenizer_path())
    data = embedded_corpus()[1]
    for model, kw, msg in [(plain, {}, "has none"), (hf_dir, {"mode": "streaming"}, "whole model"),
                           (hf_dir, {"samples": 0}, "samples must be a positive")]:
        with pytest.raises(RemodelError, match=msg) as e:
            score(model, data, tmp_path / "out", method="loo", progress=False, **{"samples": 2, "seq_len": 16, **kw})
        assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def gdn_dir(tmp_path_factory):
    """A tiny Qwen3.5 (2 key x 4 value heads in each GDN layer), random weights, with the embedded tokenizer."""
    cfg = config_from_hf(dict(FAMILIES["qwen3_5_text"].tiny["plain"], model_type="qwen3_5_text", vocab_size=2048))
    d = tmp_path_factory.mktemp("gdn") / "model"
    save_model(random_model(cfg, 5), d, family="qwen3_5_text", aux_from=embedded_tokenizer_path())
    return d


@pytest.mark.parametrize("which", ["mamba", "gdn"])
def test_score_loo_reports_the_defaults_rank_correlation_per_layer(which, hf_dir, gdn_dir, tmp_path):
    """`score --method loo` reports, per layer and unit kind, the Spearman correlation of the default
    (activation_measured) head ranking with the measured costs: equal to one computed here from a default run on
    the same data and the costs the loo run wrote (not the loo-ranked tensors, which would correlate 1)."""
    d = hf_dir if which == "mamba" else gdn_dir
    data, how = embedded_corpus()[1], dict(samples=4, seq_len=32, batch=2, progress=False)
    rep = score(d, data, tmp_path / "loo", method="loo", **how)
    score(d, data, tmp_path / "act", loss_increase=False, **how)
    loo, meta = load_scores(tmp_path / "loo")
    act, _ = load_scores(tmp_path / "act")
    cfg = ModelConfig.from_dict(meta["config"])
    got = rep["head_rank_correlation"]
    assert set(got) == {f"layers.{i}.{n}" for i, n, _ in loo_units(cfg)} and len(got) == (1 if which == "mamba" else 6)
    want = rank_correlation(unit_values(cfg, act), {k: loo[k] for k in got})
    assert got == pytest.approx(want, abs=1e-9)
    assert any(abs(v) < 0.99 for v in got.values())  # the comparison is not between perfect rankings
