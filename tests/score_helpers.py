"""Shared by tests/test_score.py and tests/test_score_sites.py (a test module never imports another): a tiny
Nemotron-H config, a model with norm gains far from 1, direct computations of the activation scores, and a saved
checkpoint of it (the `hf_dir` fixture)."""
from __future__ import annotations

import pytest
import torch

from remodel.models.config import ModelConfig
from remodel.models.load import save_model
from remodel.pipelines.data.data import embedded_tokenizer_path
from tests.conftest import random_model

NEMO = ModelConfig(vocab_size=64, hidden_size=32, pattern="M*-EM-", num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=4, n_groups=2,
                   ssm_state_size=8, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, routed_scaling_factor=2.5)


def make_model(cfg, seed=0):
    """Norm gains far from 1 (gamma must show in the hidden scores), a correction bias."""
    return random_model(cfg, seed, std=0.2, gain=0.5)


def rand_ids(cfg, b, l, seed):
    return torch.randint(0, cfg.vocab_size, (b, l), generator=torch.Generator().manual_seed(seed))


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def agg(x):  # contribution of one batch [b, l, D] -> [D]
    return x.double().abs().mean(1).square().sum(0)


def out_proj_input(mix, n):
    """What a Mamba mixer feeds its out_proj (the gated norm's output): the mixer run with out_proj an identity."""
    w = mix.out_proj
    mix.out_proj = torch.nn.Identity()
    try:
        return mix(n)
    finally:
        mix.out_proj = w


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = NEMO.replace(vocab_size=2048, pattern="M*-E")
    d = tmp_path_factory.mktemp("hf") / "model"
    save_model(make_model(cfg, seed=4), d, aux_from=embedded_tokenizer_path())
    return d
