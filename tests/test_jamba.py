"""The Mamba-1 kind ('S', models/mamba1.py) and the jamba family beyond the family suite: the Mamba-1 and Mamba-2
sections each declare their own SSM state size, read through their own section; Jamba with projection biases
(left padding reaches real tokens in transformers too: compared with transformers, not with the unpadded run);
attention and expert placements transformers' periods cannot express are refused."""
import pytest
import torch

from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.families import FAMILIES
from remodel.models.families.jamba import period_of
from remodel.models.hf import check_exportable
from remodel.models.mamba import MambaConfig
from remodel.models.mamba1 import Mamba1Config
from tests.conftest import assert_left_padding, hf_pair

TINY = FAMILIES["jamba"].tiny["plain"]


def test_mamba1_and_mamba2_each_declare_their_state_size():
    """Both kinds name their state size d_state; a bare d_state names no section and is refused; Mamba-2's
    former name (ssm_state_size) still reads, flat, as a path and inside a section dict."""
    assert "d_state" in Mamba1Config.names() and "d_state" in MambaConfig.names()
    assert "ssm_state_size" not in MambaConfig.names()
    cfg = ModelConfig(vocab_size=64, hidden_size=16, pattern="SM", mamba_num_heads=2, mamba_head_dim=8, dt_rank=2,
                      **{"mamba1.d_state": 3, "mamba.d_state": 5})
    assert cfg.mamba1.d_state == 3 and cfg.mamba.d_state == 5
    assert cfg.replace(**{"mamba1.d_state": 7}).mamba.d_state == 5
    with pytest.raises(RemodelError, match="declared by mamba, mamba1"):
        cfg.replace(d_state=4)
    old = {k: v for k, v in cfg.to_dict().items()}
    old["mamba"] = {("ssm_state_size" if k == "d_state" else k): v for k, v in old["mamba"].items()}
    flat = {k: v for k, v in cfg.flat().items() if k != "mamba.d_state"}
    for written in (old, {**flat, "ssm_state_size": 5}, {**flat, "mamba.ssm_state_size": 5}):
        assert ModelConfig.from_dict(written) == cfg
    model_s = cfg.replace(pattern="S")
    from remodel.models.model import HybridLM
    assert HybridLM(model_s).layers[0].mixer.A_log.shape == (32, 3)


def test_proj_bias_matches_transformers_with_left_padding(tmp_path):
    hf, ours, _ = hf_pair("jamba", tmp_path, "jamba-bias", 3, **dict(TINY, mamba_proj_bias=True))
    assert ours.cfg.mamba1.proj_bias
    x = torch.randint(0, TINY["vocab_size"], (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(x).logits - ours(x)).abs().max().item() <= 1e-4
    assert_left_padding(hf, ours, x)


def test_periods_round_trip_and_irregular_placements_are_refused():
    assert period_of([False, True, False, True]) == (2, 1) and period_of([False] * 3) == (4, 3)
    assert period_of([True, False, False, True]) == (3, 0) and period_of([True, True, False, False]) is None
    cfg = ModelConfig(vocab_size=64, hidden_size=16, pattern="*-*-S-S-", num_attention_heads=2, num_key_value_heads=2,
                      head_dim=8, intermediate_size=24, mlp_gated=True, mlp_act="silu", dt_rank=2)
    with pytest.raises(RemodelError, match="every period layers from an offset"):
        check_exportable(cfg, "jamba")


def test_period_of_equals_the_exhaustive_search():
    """period_of is linear in the layers (plan asks it for every candidate of a 4096-layer model: the exhaustive
    search over (period, offset) was quadratic and ran away in test_options' huge-widths plan) and gives the
    exhaustive search's answer on every pattern of up to 10 layers."""
    import itertools

    from remodel.models.families.jamba import period_of

    def exhaustive(flags):
        n = len(flags)
        return next(((p, o) for p in range(1, n + 2) for o in range(p)
                     if all((j % p == o) == f for j, f in enumerate(flags))), None)

    for n in range(11):
        for flags in itertools.product([False, True], repeat=n):
            assert period_of(list(flags)) == exhaustive(list(flags)), flags
