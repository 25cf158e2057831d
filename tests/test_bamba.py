"""IBM Bamba (models/families/bamba.py) against transformers' `bamba` (the oracle): a tiny random
BambaForCausalLM mixing Mamba-2 and attention decoder layers is saved, loaded by remodel, compared
logit for logit and gradient for gradient (with and without left padding), exported back bit for bit,
loaded again by transformers, and inspected through the CLI."""
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from remodel import cli
from remodel.models.errors import RemodelError
from remodel.models.families import FAMILIES
from remodel.models.hf import check_exportable, weight_table
from remodel.models.load import save_model
from tests.conftest import assert_left_padding, assert_same_tensors, hf_pair

V, B, L = 128, 2, 37
BASE = dict(vocab_size=V, hidden_size=64, num_hidden_layers=4, attn_layer_indices=[1], num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=96, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
            mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16)
CASES = {
    "plain": dict(BASE),
    # every bias, tied embeddings, an explicit head_dim, attention last and a dt clamp that bites (randomise
    # sets dt_bias[0] = -9)
    "biased_tied": dict(BASE, attn_layer_indices=[0, 3], attention_bias=True, mlp_bias=True, mamba_proj_bias=True,
                        mamba_conv_bias=False, tie_word_embeddings=True, head_dim=24, time_step_limit=(0.01, 5.0),
                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("bamba")


def build(case, root):
    """-> (transformers model, our model, checkpoint dir), built once per case (tests/conftest.hf_pair)."""
    return hf_pair("bamba", root, case, len(case), **CASES[case])


def ids(seed=0):
    return torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_config_maps_to_pairs(case, root):
    _, ours, _ = build(case, root)
    attn = CASES[case]["attn_layer_indices"]
    assert ours.cfg.pattern == "".join("*-" if j in attn else "M-" for j in range(4))
    assert ours.cfg.partial_rotary_factor == 0.5 and ours.cfg.mlp_gated and ours.cfg.mlp_act == "silu"
    assert FAMILIES["bamba"].depth_units(ours.cfg) == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_gradients(case, root):
    hf, ours, _ = build(case, root)
    x, labels = ids(0), ids(1)
    for m in (hf, ours):
        m.zero_grad(set_to_none=True)
    ref, out = hf(x).logits, ours(x)
    assert out.shape == ref.shape == (B, L, V)
    assert (out - ref).abs().max().item() <= 1e-4
    assert ref.std().item() > 0.3  # not a comparison of near-constant outputs
    F.cross_entropy(ref.reshape(-1, V), labels.reshape(-1)).backward()
    F.cross_entropy(out.reshape(-1, V), labels.reshape(-1)).backward()
    hf_params, ours_params = dict(hf.named_parameters()), dict(ours.named_parameters())
    for our_name, hf_name, _ in weight_table(ours.cfg, "bamba"):
        g_ours, g_ref = ours_params[our_name].grad, hf_params[hf_name].grad
        if our_name == "embeddings.weight":  # transformers' nn.Embedding(padding_idx=pad_token_id) gives
            pad = hf.config.pad_token_id  # that row no gradient from the input side; ours has no padding_idx
            g_ours, g_ref = (torch.cat([g[:pad], g[pad + 1:]]) for g in (g_ours, g_ref))
        scale = g_ref.abs().max().item()
        assert (g_ours - g_ref).abs().max().item() <= 1e-5 + 1e-4 * scale, our_name
    assert {o for o, _, _ in weight_table(ours.cfg, "bamba")} == set(ours_params)


@pytest.mark.parametrize("case", list(CASES))
def test_left_padding(case, root):
    hf, ours, _ = build(case, root)
    assert_left_padding(hf, ours, ids(2))


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_identical(case, root):
    hf, ours, d = build(case, root)
    out = save_model(ours, root / f"{case}_out", family="bamba")
    assert_same_tensors(d, out)
    src, dst = (json.loads((p / "config.json").read_text()) for p in (d, out))
    for k in ("attn_layer_indices", "num_hidden_layers", "mamba_n_heads", "mamba_d_head", "mamba_expand",
              "mamba_n_groups", "mamba_d_state", "mamba_conv_bias", "mamba_proj_bias", "time_step_limit",
              "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings", "rms_norm_eps"):
        assert dst[k] == src[k], k
    back = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        got, want = back(ids(3)).logits, hf(ids(3)).logits
        # weights equal bit for bit (above), logits to fp32 rounding: BLAS sums of a loaded copy may differ
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()  # (bit-unequal with ATEN_CPU_CAPABILITY=default)


def test_inspect(root, capsys):
    _, _, d = build("plain", root)
    assert cli.main(["inspect", str(d)]) == 0
    shown = capsys.readouterr().out
    assert "M-*-M-M-" in shown and "partial_rotary_factor" in shown


def test_refusals(root):
    _, ours, _ = build("plain", root)
    cfg = ours.cfg
    with pytest.raises(RemodelError, match="whole heads"):  # llama would drop the partial rotary
        check_exportable(cfg.replace(pattern="*-*-"), "llama")
    with pytest.raises(RemodelError, match="partial_rotary_factor"):
        check_exportable(cfg.replace(partial_rotary_factor=1.0), "bamba")
    with pytest.raises(RemodelError, match="pattern"):
        check_exportable(cfg.replace(pattern="MM-*"), "bamba")
    with pytest.raises(RemodelError, match="mamba_expand"):
        check_exportable(cfg.replace(mamba_num_heads=6), "bamba")
    with pytest.raises(RemodelError, match="SwiGLU"):
        check_exportable(cfg.replace(mlp_gated=False, mlp_act="relu2"), "bamba")
    with pytest.raises(RemodelError, match="no upcycling target"):
        FAMILIES["bamba"].upcycle_into(cfg, "sigmoid", 0)


@pytest.mark.parametrize("key,value,words", [("mamba_n_heads", 10**9, "'mamba_n_heads' must be in 1..65,536"),
                                             ("mamba_d_conv", "4", "'mamba_d_conv' expected int"),
                                             ("mamba_d_head", "auto", None)])
def test_raw_config_bounds(key, value, words):
    """Bamba's own size fields are bounded on the raw config.json, before transformers allocates from them
    ('auto' head size is transformers' own derivation and passes)."""
    from remodel.models.hf import config_from_hf

    d = {"model_type": "bamba", **BASE, key: value}
    if words is None:
        assert config_from_hf(d).mamba_head_dim == 2 * BASE["hidden_size"] // BASE["mamba_n_heads"]
        return
    with pytest.raises(RemodelError, match=words):
        config_from_hf(d)


def test_prune_every_axis_then_transformers_reloads(root):
    """Through the generic planner (the kinds' keep rules, bamba's depth unit of mixer + MLP and its
    constraints): hidden, FFN, query heads, Mamba heads and head size and one decoder layer pruned; the
    result exports as bamba, transformers loads it with our logits and our parameter count."""
    from remodel.compress.baselines import random_scores
    from remodel.compress.prune import plan_keep, prune_model
    from remodel.models.params import count_params

    _, ours, _ = build("plain", root)
    cfg = ours.cfg
    targets = dict(hidden_size=32, ffn_size=48, attn_heads=2, mamba_heads=4, mamba_head_dim=8, num_layers=3)
    keep = plan_keep(cfg, random_scores(cfg, seed=1), targets, family="bamba")
    assert len(keep["layers"]) == 6 and all(keep["layers"][1::2] == keep["layers"][0::2] + 1)  # whole pairs
    small = prune_model(ours, keep)
    assert len(small.cfg.pattern) == 6 and small.cfg.pattern[1::2] == "---"  # 3 decoder layers of mixer + MLP
    out = save_model(small, root / "pruned", family="bamba")
    hf = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert sum(p.numel() for p in hf.parameters()) == count_params(small.cfg, family="bamba")["hf_total"]
    with torch.no_grad():
        a, b = hf(ids(5)).logits, small(ids(5))
    assert (a - b).abs().max().item() < 1e-4
