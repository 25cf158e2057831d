"""A tied model exported to a family whose transformers class never ties lm_head (Family.ties_head False:
nemotron_h's and kimi_linear's `_tied_weights_keys` are {}): every writer stores lm_head as a copy of the embedding
(models.load.head_copy), so transformers loads our head, not a random one; remodel, and inspect from the config
alone, read the model back tied. Checked through save_model, convert and the streamed `remodel prune`, against
transformers in fp32."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from remodel import cli
from remodel.compress.prune import plan_keep, prune_model
from remodel.models.config import ModelConfig
from remodel.models.families import FAMILIES
from remodel.models.load import head_copy, load_model, save_model
from remodel.models.params import count_params
from remodel.pipelines.commands.inspection import inspect
from tests.conftest import (FAMILY_CONFIGS, cli_flags, cli_inspect_and_score, loaded_as, prune_axes, random_model,
                            reloaded_equals_in_memory, write_checkpoint)

X = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(3))


def tied(vocab=96):
    """The suite's default shape: tied, Mamba / attention / squared-ReLU MLP, the default export nemotron_h."""
    return ModelConfig(vocab_size=vocab, hidden_size=32, pattern="M*-", tie_word_embeddings=True, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=48, mlp_act="relu2", mamba_num_heads=8,
                       mamba_head_dim=4, n_groups=2, ssm_state_size=8, chunk_size=8)


def _tensors(d) -> dict:
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_families_that_never_tie_declare_it():
    """Family.ties_head is False exactly where transformers' class has no tied keys (the oracle's own table)."""
    import transformers
    for name, fam in FAMILIES.items():
        assert fam.ties_head == bool(getattr(transformers, fam.arch)._tied_weights_keys), name


def cases() -> dict:
    """{family: (a tied config it exports, transformers' class)}: every family that never ties."""
    return {"nemotron_h": (tied(), "NemotronHForCausalLM"),
            "kimi_linear": (FAMILY_CONFIGS["kimi_linear"].replace(tie_word_embeddings=True), "KimiLinearForCausalLM")}


@pytest.mark.parametrize("family", ["nemotron_h", "kimi_linear"])
def test_save_model_writes_the_head_transformers_loads(tmp_path, family):
    cfg, arch = cases()[family]
    model = random_model(cfg)
    assert head_copy(model.cfg, family) is not None
    save_model(model, tmp_path / "a", family=family)
    hf = loaded_as(tmp_path / "a", arch)
    with torch.no_grad():
        want = model(X)
        assert (hf(X).logits - want).abs().max().item() <= 1e-4
    assert count_params(model.cfg)["hf_total"] == sum(p.numel() for p in hf.parameters())
    assert json.loads((tmp_path / "a" / "config.json").read_text())["tie_word_embeddings"] is True
    back = load_model(tmp_path / "a")  # read back tied: the same logits and parameters; read -> write -> read exact
    assert back.cfg.tie_word_embeddings and torch.equal(back(X), want)
    assert count_params(back.cfg)["total"] == sum(p.numel() for p in model.parameters())
    seen = inspect(tmp_path / "a")  # config-only: the loader's reading, the stored copy counted in hf_total only
    assert seen["family"] == family and seen["widths"]["tie_word_embeddings"] is True
    assert seen["params"]["total"] == count_params(back.cfg)["total"] and not seen["checkpoint"]["config_mismatches"]
    assert seen["params"]["hf_total"] == sum(p.numel() for p in hf.parameters())
    save_model(back, tmp_path / "b")
    one, two = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert load_model(tmp_path / "b").cfg == back.cfg


@pytest.mark.parametrize("family", ["nemotron_h", "kimi_linear"])
def test_convert_writes_the_copy(tmp_path, family):
    cfg, arch = cases()[family]
    model = random_model(cfg)
    save_model(model, tmp_path / "a", family=family)
    assert cli.main(["convert", str(tmp_path / "a"), str(tmp_path / "c"), "--to", family]) == 0
    with torch.no_grad():
        got = loaded_as(tmp_path / "c", arch)(X).logits
        assert (got - model(X)).abs().max().item() <= 1e-4


def test_streamed_prune_writes_the_copy(tmp_path, capsys):
    """`remodel prune` (streamed, one tensor at a time) of a tied checkpoint: transformers and remodel both
    reload the pruned model of the same scores computed in memory."""
    model = random_model(tied(vocab=2048))
    d = write_checkpoint(model, tmp_path / "m")
    scores = cli_inspect_and_score(d, model, tmp_path / "s", capsys)
    targets = prune_axes(model.cfg)
    out = tmp_path / "p"
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s"), *cli_flags(targets)]) == 0
    reloaded_equals_in_memory(out, prune_model(model, plan_keep(model.cfg, scores, targets)))
