"""Pruning the Mamba-1 SSM state (`--mamba1-d-state`, models/mamba1.py): x_proj's B and C rows, A_log's columns and
Jamba's B / C RMSNorms sliced together give the logits of the unpruned model with those state channels zeroed at
runtime (tests/kinds/mamba1.py: B and C zero on the dropped channels, the B / C norms' RMS over the kept ones);
transformers reloads the pruned Jamba with the same logits; the scores rank state channels by what the scan reads;
and `remodel prune` does it on a checkpoint transformers saved."""
import copy
import json

import pytest
import torch

from remodel import cli
from remodel.compress.baselines import magnitude_scores, random_scores
from remodel.compress.importance import score_model
from remodel.compress.prune import plan_keep, prune_model
from remodel.compress.scores import load_scores
from remodel.models.config import ModelConfig
from remodel.models.families import FAMILIES
from remodel.models.load import save_model
from remodel.models.mamba1 import MAMBA1
from remodel.models.model import HybridLM
from remodel.models.spec import widths
from remodel.pipelines.data.data import embedded_corpus
from tests.conftest import cli_pair, hf_pair, reloaded_equals_in_memory
from tests.kinds.mamba1 import mask_state_channels

TINY = FAMILIES["jamba"].tiny["plain"]  # mamba_d_state 8


@torch.no_grad()
def masked_state(model, keep):
    """A copy of `model` with the state channels `keep` drops zero-masked (tests/kinds/mamba1.py)."""
    ref = copy.deepcopy(model)
    for i, layer in enumerate(ref.layers):
        if f"layers.{i}.m1_state" in keep:
            mask_state_channels(ref.cfg, layer.mixer, keep[f"layers.{i}.m1_state"])
    return ref


def _no_norm_model():
    cfg = ModelConfig(vocab_size=64, hidden_size=16, pattern="S-S-", **{"mamba1.d_state": 8}, dt_rank=2, intermediate_size=24,
                      mlp_gated=True, mlp_act="silu", dt_bc_norm=False)
    torch.manual_seed(0)
    model = HybridLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def _assert_pruned_equals_masked(model, keep):
    x = torch.randint(0, model.cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    pruned = prune_model(model, keep)
    with torch.no_grad():
        a, b, full = pruned(x), masked_state(model, keep)(x), model(x)
    assert (a - b).abs().max().item() <= 1e-5
    assert (a - full).abs().max().item() > 1e-2  # the pruning changed the model: the comparison is not vacuous
    return pruned


def test_jamba_d_state_pruned_equals_masked_and_transformers_reloads_it(tmp_path):
    _, ours, _ = hf_pair("jamba", tmp_path, "jamba-state", 3, **TINY)
    keep = plan_keep(ours.cfg, random_scores(ours.cfg, seed=4), {"mamba1_d_state": 5})
    assert {k: len(v) for k, v in keep.items()} == {f"layers.{i}.m1_state": 5 for i in (0, 4)}
    pruned = _assert_pruned_equals_masked(ours, keep)
    m = pruned.layers[0].mixer
    assert (pruned.cfg.mamba1.d_state, m.A_log.shape, m.x_proj.weight.shape, m.c_layernorm.weight.shape) == \
        (5, (64, 5), (4 + 10, 64), (5,))
    w = widths(ours.cfg, mamba1_d_state=5)  # what plan / inspect count at the target: the pruned model's own state
    assert MAMBA1.cache_bytes(ours.cfg, w, 2, 9) == MAMBA1.cache_bytes(pruned.cfg, widths(pruned.cfg), 2, 9)
    out = save_model(pruned, tmp_path / "pruned", family="jamba")
    assert json.loads((out / "config.json").read_text())["mamba_d_state"] == 5
    reloaded_equals_in_memory(out, pruned)


def test_d_state_without_bc_norms_pruned_equals_masked():
    model = _no_norm_model()
    _assert_pruned_equals_masked(model, plan_keep(model.cfg, random_scores(model.cfg, seed=2), {"mamba1_d_state": 3}))


@pytest.mark.parametrize("norms", [True, False])
def test_scores_drop_the_state_channels_the_scan_does_not_read(norms, tmp_path):
    """Channels 1, 4 and 6 of every layer's B are zeroed (the B norm's weight, or x_proj's B rows): activation
    and magnitude scores alike rank them last, so keeping 5 of 8 drops exactly them."""
    model = hf_pair("jamba", tmp_path, "jamba-score", 3, **TINY)[1] if norms else _no_norm_model()
    cfg, dead = model.cfg, torch.tensor([1, 4, 6])
    with torch.no_grad():
        for layer in model.layers:
            if layer.kind == "S":
                if norms:
                    layer.mixer.b_layernorm.weight[dead] = 0
                else:
                    layer.mixer.x_proj.weight[cfg.mamba1.dt_rank + dead] = 0
    ids = torch.randint(0, cfg.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    act, _ = score_model(model, [ids], loss_increase=False)
    mag = magnitude_scores(cfg, model.state_dict().items())
    want = [j for j in range(8) if j not in dead.tolist()]
    for scores in (act, mag):
        keep = plan_keep(cfg, scores, {"mamba1_d_state": 5})
        assert {k: v.tolist() for k, v in keep.items()} == {f"layers.{i}.m1_state": want
                                                              for i, c in enumerate(cfg.pattern) if c == "S"}
    assert all(act[f"layers.{i}.m1_C"].min() > 0 for i, c in enumerate(cfg.pattern) if c == "S")


def test_cli_prunes_the_state_of_a_transformers_jamba(tmp_path):
    _, ours, d = cli_pair("jamba", "plain", tmp_path)
    assert cli.main(["score", str(d), "--data", str(embedded_corpus()[1]), "--out", str(tmp_path / "s"),
                     "--samples", "8", "--seq-len", "32"]) == 0
    scores, _ = load_scores(tmp_path / "s")
    out = tmp_path / "pruned"
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s"), "--mamba1-d-state", "6",
                     "--hidden-size", "24"]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert (hf["mamba_d_state"], hf["hidden_size"]) == (6, 24)
    keep = plan_keep(ours.cfg, scores, {"mamba1_d_state": 6, "hidden_size": 24})
    kept = json.loads((out / "remodel_report.json").read_text())["kept"]  # each kept axis of its full size
    assert {k: (v["size"], v["of"], v["indices"]) for k, v in kept.items()} == \
        {k: (len(v), {"hidden": 32, "m1_inner": 64, "m1_state": 8}[k.rsplit(".", 1)[-1]], v.tolist())
         for k, v in keep.items()}
    reloaded_equals_in_memory(out, prune_model(ours, keep))
    assert cli.main(["prune", str(d), str(tmp_path / "bad"), "--scores", str(tmp_path / "s"),
                     "--mamba1-d-state", "9"]) != 0
    assert not (tmp_path / "bad").exists()
