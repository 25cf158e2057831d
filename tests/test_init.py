"""Each kind initialises its own parameters (LayerKind.init_param) as transformers' _init_weights does for it:
a fresh Gated DeltaNet layer's statistics equal transformers' qwen3_next within sampling noise (it once got
Mamba's A = -1..-h and Mamba's conv bound), Mamba's A, D and dt as nemotron_h's."""
import math

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from remodel.models.families import FAMILIES
from remodel.models.hf import config_from_hf
from remodel.models.model import HybridLM, init_weights


def _pair(family: str, **kw):
    tiny = FAMILIES[family].tiny
    hf_cfg = AutoConfig.for_model(family, **{**tiny[next(iter(tiny))], **kw})
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_cfg)  # transformers' own _init_weights
    ours = init_weights(HybridLM(config_from_hf(hf_cfg.to_dict())), std=hf_cfg.initializer_range, seed=0)
    return hf, ours


def _mixer(ours, name: str):
    return next(b.mixer for b in ours.layers if b.spec.name == name)


@torch.no_grad()
def test_gated_deltanet_layer_statistics_equal_transformers():
    hf, ours = _pair("qwen3_next", linear_num_value_heads=128, linear_num_key_heads=32, linear_key_head_dim=16,
                     linear_value_head_dim=16)
    theirs = next(layer.linear_attn for layer in hf.model.layers if hasattr(layer, "linear_attn"))
    mine = _mixer(ours, "gated_deltanet")
    a, b = theirs.A_log.exp(), mine.A_log.exp()  # U(0.01, 16): mean 8.0, sd 4.6; 128 heads: 4 standard errors
    assert a.min() >= 0.01 and b.min() >= 0.01 and a.max() <= 16 and b.max() <= 16
    assert abs(a.mean() - b.mean()) <= 4 * 4.6 * math.sqrt(2 / 128) and abs(b.mean() - 8.0) <= 4 * 4.6 / math.sqrt(128)
    assert torch.equal(theirs.dt_bias, torch.ones_like(theirs.dt_bias)) and torch.equal(mine.dt_bias, theirs.dt_bias)
    conv = torch.cat([getattr(mine, f"{x}_conv1d").weight.flatten() for x in "qkv"])
    assert abs(conv.std() / theirs.conv1d.weight.std() - 1) < 0.1 and abs(conv.mean()) < 0.002
    assert torch.equal(mine.norm.weight, torch.ones_like(mine.norm.weight)) and torch.equal(theirs.norm.weight, mine.norm.weight)


@torch.no_grad()
def test_mamba_a_d_dt_as_nemotron_h():
    hf, ours = _pair("nemotron_h")
    theirs = next(layer.mixer for layer in hf.model.layers if hasattr(layer.mixer, "A_log"))
    mine = _mixer(ours, "mamba")
    assert torch.equal(mine.A_log, theirs.A_log) and torch.equal(mine.D, theirs.D)
    for dt in (F.softplus(theirs.dt_bias), F.softplus(mine.dt_bias)):  # dt log-uniform in [0.001, 0.1]
        assert dt.min() >= 0.001 - 1e-6 and dt.max() <= 0.1 + 1e-6


@torch.no_grad()
def test_mamba1_as_jamba():
    """A = -1..-d_state on every channel, D one, dt_proj's bias zero, the conv and the dt / B / C norms as
    transformers' Jamba initialises them."""
    hf, ours = _pair("jamba", hidden_size=64, mamba_expand=4)
    theirs = next(layer.mamba for layer in hf.model.layers if hasattr(layer, "mamba"))
    mine = _mixer(ours, "mamba1")
    assert torch.equal(mine.A_log, theirs.A_log) and torch.equal(mine.D, theirs.D)
    assert torch.equal(mine.dt_proj.bias, theirs.dt_proj.bias) and not mine.dt_proj.bias.any()
    for n in ("dt_layernorm", "b_layernorm", "c_layernorm"):
        assert torch.equal(getattr(mine, n).weight, getattr(theirs, n).weight)
    a, b = mine.conv1d.weight, theirs.conv1d.weight  # normal(0.02): 1024 draws each
    assert abs(a.std() / b.std() - 1) < 0.1 and abs(a.mean()) < 0.003
