"""The default head criterion (`score --method activation_measured`, compress/head_loo.measured_scores): activation,
with Gated DeltaNet key-head groups ranked by their measured leave-one-out cost over the loss batches. The costs
equal the LOO scorer's on those batches, prune drops the cheapest groups and keeps activation's value heads within
the kept ones, the layer-streaming scorer gives the same numbers, and a model without such units scores as
activation does."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from remodel.compress.head_loo import head_costs, measured_scores
from remodel.compress.importance import score_model
from remodel.compress.prune import plan_keep
from remodel.compress.scores import load_scores
from remodel.compress.streaming import Streaming, score_streaming
from remodel.models.config import ModelConfig
from remodel.models.families import FAMILIES
from remodel.models.hf import config_from_hf
from remodel.models.load import load_model, save_model
from remodel.pipelines.commands.prune import prune
from remodel.pipelines.commands.score import score
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path
from tests.conftest import random_model
from tests.rss import PEAK_RSS

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
KEY = "lin_k_heads_loo"


def gdn_config(vocab=96):
    """Two GDN layers of 4 key x 8 value heads around an attention layer and MLPs."""
    return ModelConfig(pattern="D-*-D", vocab_size=vocab, hidden_size=24, norm_eps=1e-5, intermediate_size=40,
                       linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                       linear_value_head_dim=6, num_attention_heads=2, num_key_value_heads=1, head_dim=8)


def qwen_config(vocab=2048):
    """transformers' Qwen3.5 text model, tiny (families/qwen3_5_text.py)."""
    return config_from_hf(dict(FAMILIES["qwen3_5_text"].tiny["plain"], model_type="qwen3_5_text", vocab_size=vocab))


def batches(vocab, n=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 16), generator=g) for _ in range(n)]


def test_measured_costs_are_loo_on_the_loss_batches_and_prune_follows_them():
    model, data = random_model(gdn_config(), 0), batches(96)
    act, _ = score_model(model, data, loss_increase=False)
    got = measured_scores(model, act, data, loss_batches=3)
    want, _ = head_costs(model, data[:3])
    for i in (0, 4):
        c = got[f"layers.{i}.{KEY}"]
        assert torch.equal(c, want[f"layers.{i}.{KEY}"]) and c.abs().max() > 1e-4
        assert f"layers.{i}.lin_v_heads_loo" not in got  # value heads are not measured: activation ranks them
    other, _ = head_costs(model, data[3:])  # the costs depend on the batches: the first 3 were used, not all 5
    assert not torch.equal(other[f"layers.0.{KEY}"], got[f"layers.0.{KEY}"])
    t = {"linear_key_heads": 2, "linear_value_heads": 2}
    keep, plain = plan_keep(model.cfg, got, t), plan_keep(model.cfg, act, t)
    for i in (0, 4):
        c = got[f"layers.{i}.{KEY}"]
        assert sorted(keep[f"layers.{i}.lin_k_heads"].tolist()) == sorted(c.argsort()[2:].tolist())
        for g in keep[f"layers.{i}.lin_k_heads"].tolist():  # within a kept group: activation's value head
            v = act[f"layers.{i}.lin_v"].float().norm(dim=1)[2 * g:2 * g + 2]
            assert [h for h in keep[f"layers.{i}.lin_v_heads"].tolist() if h // 2 == g] == [2 * g + int(v.argmax())]
    assert any(not torch.equal(keep[k], plain[k]) for k in keep)  # the measured ranking changed a layer's groups
    for i in (0, 4):  # the group norms are activation's, reordered: a cut removes the share of importance it did
        a, m = (s[f"layers.{i}.lin_v"].float().reshape(4, -1).norm(dim=1) for s in (act, got))
        assert torch.allclose(m.sort().values, a.sort().values, rtol=1e-5)
        assert torch.equal(m.argsort(), got[f"layers.{i}.{KEY}"].argsort())
    for k, v in act.items():  # everything else is activation's, unchanged
        if not k.endswith(("lin_v", KEY)):
            assert torch.equal(got[k], v), k


def test_streaming_measures_the_same_costs(tmp_path):
    d, cfg = tmp_path / "m", qwen_config(96)
    save_model(random_model(cfg, 3), d, family="qwen3_5_text")
    layers = [i for i, c in enumerate(cfg.pattern) if c == "D"]
    data = batches(96, n=3, seed=2)
    model = load_model(d).float().eval()
    act, _ = score_model(model, data, loss_batches=2)
    whole = measured_scores(model, act, data, loss_batches=2)
    got, _ = score_streaming(d, data, loss_batches=2, measured=True, run=Streaming(max_memory_bytes=0,
                                                                                      spill_dir=tmp_path))
    assert len(layers) > 1
    for i in layers:
        assert whole[f"layers.{i}.{KEY}"].abs().max() > 1e-4
        for k in (f"layers.{i}.{KEY}", f"layers.{i}.lin_v"):
            assert torch.allclose(got[k], whole[k], rtol=1e-4, atol=1e-6), k
    assert not list(tmp_path.glob("*.safetensors"))  # the spilled branches are gone


def test_score_default_is_measured_and_equals_activation_without_key_groups(tmp_path):
    gdn = tmp_path / "gdn"
    save_model(random_model(qwen_config(), 5), gdn, family="qwen3_5_text", aux_from=embedded_tokenizer_path())
    data, how = embedded_corpus()[1], dict(samples=6, seq_len=32, batch=2, progress=False)
    rep = score(gdn, data, tmp_path / "default", **how)
    score(gdn, data, tmp_path / "streamed", mode="streaming", **how)
    score(gdn, data, tmp_path / "act", method="activation", **how)
    got, meta = load_scores(tmp_path / "default")
    streamed, _ = load_scores(tmp_path / "streamed")
    act, _ = load_scores(tmp_path / "act")
    keys = [k for k in got if k.endswith(KEY)]
    assert rep["method"] == meta["method"] == "activation_measured" and keys
    for k in keys:
        assert torch.allclose(streamed[k], got[k], rtol=1e-4, atol=1e-6)
        assert k not in act
    hk = qwen_config().gated_deltanet.linear_num_key_heads
    pruned = prune(gdn, tmp_path / "pruned", data=data, linear_key_heads=hk - 1, **how)  # prune --data scores so
    used, meta = load_scores(tmp_path / "pruned" / "scores")
    assert meta["method"] == "activation_measured"
    for k in keys:  # each GDN layer kept all but its cheapest key-head group
        kept = pruned["kept"][k.replace(KEY, "lin_k_heads")]["indices"]
        assert torch.equal(used[k], got[k]) and sorted(kept) == sorted(got[k].argsort()[1:].tolist())
    nemo = ModelConfig(pattern="M*-", n_groups=2, vocab_size=2048, hidden_size=24, norm_eps=1e-5,
                       intermediate_size=40, mamba_num_heads=4, mamba_head_dim=4, ssm_state_size=5, conv_kernel=4,
                       chunk_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    m = tmp_path / "mamba"
    save_model(random_model(nemo, 1), m, aux_from=embedded_tokenizer_path())
    score(m, data, tmp_path / "m_default", **how)
    score(m, data, tmp_path / "m_act", method="activation", **how)
    a, _ = load_scores(tmp_path / "m_default")
    b, _ = load_scores(tmp_path / "m_act")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


MEMORY_SCRIPT = PEAK_RSS + '''
import sys, torch
torch.set_num_threads(1)
from remodel.compress.streaming import Streaming, score_streaming
path, spill, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
g = torch.Generator().manual_seed(0)
data = [torch.randint(0, 2048, (4, 64), generator=g) for _ in range(4)]
score_streaming(path, data, loss_increase=False)  # warm-up: imports, the allocator, the kernels
base = reset_peak()
scores, info = score_streaming(path, data, loss_increase=False, measured=True,
                               run=Streaming(max_memory_bytes=budget, spill_dir=spill))
assert all(scores[f"layers.{i}.lin_k_heads_loo"].isfinite().all() for i in (0, 2, 4))
print(base, status("VmHWM"), info["spilled_bytes"])
'''


def test_streamed_measured_branches_spill_past_the_budget(tmp_path):
    """Layer streaming carries 3 GDN layers x 16 key groups x 4 loss batches = 192 branch states of 0.5 MiB
    (96 MiB): with a 4 MiB budget they go to disk and the peak RSS grows by less than half of them."""
    mb = 1024**2
    cfg = config_from_hf(dict(FAMILIES["qwen3_5_text"].tiny["plain"], model_type="qwen3_5_text", vocab_size=2048,
                              hidden_size=512, intermediate_size=512, num_hidden_layers=4, linear_num_key_heads=16,
                              linear_num_value_heads=16, linear_key_head_dim=8, linear_value_head_dim=8,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                              layer_types=["linear_attention"] * 3 + ["full_attention"]))
    assert cfg.pattern == "D-D-D-*-"
    d, spill = tmp_path / "m", tmp_path / "spill"
    spill.mkdir()
    save_model(random_model(cfg, 0), d, family="qwen3_5_text")
    res = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(d), str(spill), str(4 * mb)], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr[-3000:]
    base, peak, spilled = map(int, res.stdout.split()[-3:])
    branches = 3 * 16 * 4 * 4 * 64 * 512 * 4
    print(f"growth {(peak - base) / mb:.1f} MiB, branch states {branches / mb:.0f} MiB, spilled {spilled / mb:.0f} MiB")
    assert spilled >= 0.9 * branches and peak - base < branches / 2
