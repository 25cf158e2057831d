"""Our model definition against transformers (the oracle), for every supported family.

Each case builds a tiny random model in transformers, moves its weights well away from their
initial values, saves it, loads it with `models.load.load_model`, and checks logits and the
gradient of every parameter. Round trips write the model back with `save_model` and compare
every tensor bit for bit, then load the export in transformers (no trust_remote_code).
"""
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from remodel.models.config import ModelConfig
from remodel.models.hf import weight_table
from remodel.models.load import save_model
from remodel.models.model import HybridLM, init_weights
from tests.conftest import assert_left_padding, assert_same_tensors, hf_pair, randomise

V, B, L = 96, 2, 37
ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)
LLAMA = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=40, **ATTN)
NEMO = dict(hidden_size=32, head_dim=8, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
            mamba_num_heads=8, mamba_head_dim=4, n_groups=2, ssm_state_size=8, chunk_size=16,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1, routed_scaling_factor=2.5)

CASES = {
    "nemotron_h": ("nemotron_h", dict(hybrid_override_pattern="M*M-EM", **NEMO)),
    "nemotron_h_latent": ("nemotron_h", dict(hybrid_override_pattern="ME*E", **{**NEMO, "moe_latent_size": 20,
                                                                              "n_group": 1, "topk_group": 1})),
    "llama_tied": ("llama", dict(tie_word_embeddings=True, **LLAMA)),
    "llama3_rope": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 16}, **LLAMA)),
    "mistral": ("mistral", dict(sliding_window=None, **LLAMA)),
    "qwen2": ("qwen2", dict(**LLAMA)),
    "qwen3": ("qwen3", dict(**LLAMA)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None, **LLAMA)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                                    shared_expert_intermediate_size=20, norm_topk_prob=False, **LLAMA)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                                    norm_topk_prob=True, **LLAMA)),
}


def build(case, root):
    """-> (hf model, our model, checkpoint dir, family), built once per case (tests/conftest.hf_pair)."""
    family, kw = CASES[case]
    return (*hf_pair(family, root, case, len(case), vocab_size=V, **kw), family)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("parity")


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, L), generator=g), torch.randint(0, V, (B, L), generator=g)


def hf_grad(hf_params, name):
    """Gradient of a checkpoint tensor name inside transformers' in-memory model (fused experts sliced)."""
    name = re.sub(r"^backbone\.", "model.", name).replace(".block_sparse_moe.", ".mlp.")
    if name in hf_params:
        return hf_params[name].grad
    prefix, e, leaf = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name).groups()
    e, leaf = int(e), {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(leaf, leaf)
    if f"{prefix}.{leaf}" in hf_params:  # nemotron_h: experts.up_proj [E, F, L], experts.down_proj [E, L, F]
        return hf_params[f"{prefix}.{leaf}"].grad[e]
    fused = hf_params[f"{prefix}.gate_up_proj"].grad[e]  # [2F, H] = cat(gate, up)
    f = fused.shape[0] // 2
    return fused[:f] if leaf == "gate_proj" else fused[f:]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_gradients(case, root):
    hf, ours, _, family = build(case, root)
    ids, labels = inputs()
    for m in (hf, ours):
        m.zero_grad(set_to_none=True)
    ref = hf(ids).logits
    out = ours(ids)
    assert out.shape == ref.shape == (B, L, V)
    assert (out - ref).abs().max().item() <= 1e-4
    assert ref.std().item() > 0.3  # the comparison is not between near-constant outputs
    F.cross_entropy(ref.reshape(-1, V), labels.reshape(-1)).backward()
    F.cross_entropy(out.reshape(-1, V), labels.reshape(-1)).backward()

    hf_params = dict(hf.named_parameters())
    ours_params = dict(ours.named_parameters())
    checked = set()
    for our_name, hf_name, e in weight_table(ours.cfg, family):
        if our_name not in ours_params:  # buffers (e_score_correction_bias) carry no gradient
            assert our_name.endswith("e_score_correction_bias")
            continue
        g_ours = ours_params[our_name].grad
        g_ours = g_ours if e is None else g_ours[e]
        g_ref = hf_grad(hf_params, hf_name)
        assert g_ref is not None and g_ours.shape == g_ref.shape, our_name
        scale = g_ref.abs().max().item()
        err = (g_ours - g_ref).abs().max().item()
        assert err <= 1e-5 + 1e-4 * scale, f"{our_name}[{e}]: grad diff {err:.2e} (scale {scale:.2e})"
        checked.add(our_name)
    assert checked == set(ours_params)  # every parameter, experts included
    nonzero = sum(1 for n in checked if ours_params[n].grad.abs().max() > 0)
    assert nonzero >= len(checked) - (ours.cfg.n_routed_experts or 0)  # gradients actually flow


@pytest.mark.parametrize("case", ["nemotron_h", "llama_tied"])
def test_left_padding(case, root):
    hf, ours, _, _ = build(case, root)
    ids, _ = inputs(1)
    out = assert_left_padding(hf, ours, ids)  # row 1 left-padded by 7 tokens
    if case == "nemotron_h":  # NoPE + masked Mamba: padded row equals the unpadded sequence
        with torch.no_grad():
            unpadded = ours(ids[1:, 7:])
        assert (out[1, 7:] - unpadded[0]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_identical(case, root):
    hf, ours, d, family = build(case, root)
    out = save_model(ours, root / f"{case}_out", family=family)
    assert_same_tensors(d, out)
    back = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(back) is type(hf)
    ids, _ = inputs(2)
    with torch.no_grad():
        got, want = back(ids).logits, hf(ids).logits
        # weights equal bit for bit (above), logits to fp32 rounding: BLAS sums of a loaded copy may differ
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()  # (bit-unequal with ATEN_CPU_CAPABILITY=default)


def test_export_without_shared_expert(tmp_path):
    cfg = ModelConfig(vocab_size=V, hidden_size=32, pattern="M*E-E", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=4, n_groups=2,
                      ssm_state_size=8, chunk_size=16, n_routed_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=16, moe_shared_expert_intermediate_size=0, routed_scaling_factor=1.5)
    ours = randomise(init_weights(HybridLM(cfg), seed=0), seed=3).eval()
    out = save_model(ours, tmp_path / "ck", family="nemotron_h")
    hf = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert hf.model.layers[2].mixer.shared_experts.up_proj.weight.shape == (1, 32)
    ids, _ = inputs(3)
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
    assert (got - ref).abs().max().item() <= 1e-4 and ref.std().item() > 0.3


@pytest.mark.parametrize("case", ["nemotron_h", "qwen2_moe"])
def test_empty_batch(case, root):
    """A batch of zero sequences (e.g. the last shard of a split batch) or of zero-length sequences
    gives logits of shape [B, L, V] and a backward that runs (transformers' own models raise here:
    their attention views an empty tensor with -1); a one-sequence batch gives that row of the full
    batch's logits."""
    _, ours, _, _ = build(case, root)
    ids = inputs()[0]
    for x in (ids[:0], ids[:, :0]):
        ours.zero_grad(set_to_none=True)
        out = ours(x)
        assert out.shape == (*x.shape, V)
        out.sum().backward()
        assert all(p.grad is None or p.grad.abs().max().item() == 0 for p in ours.parameters())
    with torch.no_grad():
        assert (ours(ids[:1]) - ours(ids)[:1]).abs().max().item() < 1e-5
