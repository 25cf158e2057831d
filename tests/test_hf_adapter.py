"""The HF key maps (models.hf_adapter), for every family: export is the exact inverse of import, and
the names are exactly the tensors transformers saves for the exported config (its oracle)."""
import pytest
from transformers.core_model_loading import revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.hf import FAMILIES, KEY_MAPS, check_exportable, config_to_hf, default_family, from_hf_name, to_hf_name, \
    weight_table
from remodel.models.hf_adapter import to_hf_part
from remodel.models.layout import shapes
from remodel.models.load import extra_hf_tensors
from tests.conftest import FAMILY_CONFIGS, hf_meta_model

BASE = dict(vocab_size=96, hidden_size=24, norm_eps=1e-5, num_attention_heads=4, num_key_value_heads=2, head_dim=6)
MAMBA = dict(mamba_num_heads=6, mamba_head_dim=4, n_groups=2, ssm_state_size=5, conv_kernel=4, chunk_size=8)
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=10)
LLAMA = dict(mlp_gated=True, mlp_act="silu", rope_theta=1e4, **BASE)
CASES = {  # (family, tiny config of that family)
    "nemotron_h": ("nemotron_h", ModelConfig(pattern="M*-EM-", intermediate_size=40, moe_shared_expert_intermediate_size=12,
                                             **BASE, **MAMBA, **MOE)),
    "nemotron_h_mtp_latent": ("nemotron_h", ModelConfig(pattern="ME*E", moe_latent_size=8, mamba_proj_bias=True,
                                                        use_conv_bias=False, mtp_layers=1, mtp_pattern="*E",
                                                        **BASE, **MAMBA, **MOE)),
    "llama": ("llama", ModelConfig(pattern="*-" * 3, intermediate_size=40, attention_bias=True, attention_out_bias=True,
                                   tie_word_embeddings=True, **LLAMA)),
    "mistral": ("mistral", ModelConfig(pattern="*-" * 2, intermediate_size=40, sliding_window=16, **LLAMA)),
    "qwen2": ("qwen2", ModelConfig(pattern="*-" * 2, intermediate_size=40, attention_bias=True, **LLAMA)),
    "qwen3": ("qwen3", ModelConfig(pattern="*-" * 2, intermediate_size=40, qk_norm=True, **LLAMA)),
    "mixtral": ("mixtral", ModelConfig(pattern="*E" * 2, router="softmax", **LLAMA, **MOE)),
    "qwen2_moe": ("qwen2_moe", ModelConfig(pattern="*E" * 2, attention_bias=True, router="softmax",
                                           shared_expert_gate=True, moe_shared_expert_intermediate_size=12,
                                           **LLAMA, **MOE)),
    "qwen2_moe_noshared": ("qwen2_moe", ModelConfig(pattern="*E" * 2, router="softmax", **LLAMA, **MOE)),
    "qwen3_moe": ("qwen3_moe", ModelConfig(pattern="*E" * 2, qk_norm=True, router="softmax", **LLAMA, **MOE)),
    "bamba": ("bamba", ModelConfig(pattern="M-*-M-", intermediate_size=40, partial_rotary_factor=0.5,
                                   attention_bias=True, attention_out_bias=True, mlp_bias=True, mamba_proj_bias=True,
                                   tie_word_embeddings=True, **{**LLAMA, "head_dim": 8}, **MAMBA)),
    # fused gate/up HF tensors (key-map Parts), whole [E, ...] expert tensors, one HF shared_mlp for two of our kinds
    "granitemoehybrid": ("granitemoehybrid", ModelConfig(pattern="ME*EME", router="softmax", mlp_gated=True,
                                                         mlp_act="silu", moe_shared_expert_intermediate_size=12,
                                                         attention_scale=0.25, **BASE, **MAMBA, **MOE)),
    "granitemoehybrid_dense": ("granitemoehybrid", ModelConfig(pattern="M-*-", intermediate_size=40,
                                                               attention_bias=True, attention_out_bias=True,
                                                               mamba_proj_bias=True, tie_word_embeddings=True,
                                                               attention_scale=0.25, **LLAMA, **MAMBA)),
    # the parallel mixer (attention and Mamba under one layer), with and without the Mamba norm
    "falcon_h1": ("falcon_h1", ModelConfig(pattern="P-" * 3, intermediate_size=40, attention_bias=True,
                                           attention_out_bias=True, mlp_bias=True, mamba_proj_bias=True,
                                           tie_word_embeddings=True, key_multiplier=0.5, **LLAMA, **MAMBA)),
    "falcon_h1_no_mamba_norm": ("falcon_h1", ModelConfig(pattern="P-" * 2, intermediate_size=40, mamba_rms_norm=False,
                                                         **LLAMA, **MAMBA)),
}
# a family without a hand-written case has its first tiny model (Family.tiny, through tests/conftest.py)
CASES.update({name: (name, FAMILY_CONFIGS[name]) for name in FAMILIES if name not in {f for f, _ in CASES.values()}})


def part(cfg, family, ours, e=None) -> int:
    """Which part of its HF tensor our tensor is (0 unless that tensor concatenates several of ours)."""
    return to_hf_part(cfg, family, ours, e).index


def test_every_family_is_covered():
    assert set(KEY_MAPS) == set(FAMILIES) == {f for f, _ in CASES.values()}
    for family, cfg in CASES.values():
        check_exportable(cfg, family)
    for family, cfg in CASES.values():  # one HF tensor (or part of one) per our name and back: a function
        rows = [(h, part(cfg, family, o, e), e) for o, h, e in weight_table(cfg, family)]  # of the config
        assert len(set(rows)) == len(rows), family
    assert {default_family(cfg) for _, cfg in CASES.values()} >= {"nemotron_h", "llama", "qwen3", "mixtral",
                                                                   "qwen2_moe", "qwen3_moe"}


def saved_names(cfg: ModelConfig, family: str) -> set[str]:
    """The tensor names transformers' save_pretrained writes for `config_to_hf(cfg, family)`: the meta
    model's state dict (persistent buffers included) less tied weights, in the checkpoint's original
    format (per-expert tensors, backbone. prefix), as save_pretrained reverts its load-time conversions."""
    m = hf_meta_model(config_to_hf(cfg, family))
    sd = {k: v for k, v in m.state_dict().items() if k not in (m._keys_to_ignore_on_save or ())}
    names = set(revert_weight_conversion(m, remove_tied_weights_from_state_dict(sd, m)))
    return {k for k in names if not k.startswith(FAMILIES[family].passthrough)}  # a tower: carried through


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_every_name(case):
    family, cfg = CASES[case]
    rows = weight_table(cfg, family)
    for ours, shape in shapes(cfg).items():
        per_expert = ".experts." in ours and not ours.endswith(".weight") and "{e}" in str(KEY_MAPS[family])
        experts = range(shape[0]) if per_expert else [None]  # a fused HF tensor [E, ...] (no {e}) is one
        for e in experts:
            hf, k = to_hf_name(cfg, family, ours, e), part(cfg, family, ours, e)
            assert from_hf_name(cfg, family, hf, k) == (ours, e)
            assert to_hf_name(cfg, family, *from_hf_name(cfg, family, hf, k)) == hf
    assert [(o, e) for o, _, e in rows] == [from_hf_name(cfg, family, h, part(cfg, family, o, e)) for o, h, e in rows]
    for hf in extra_hf_tensors(cfg, family):  # placeholders of an absent shared expert: same map
        assert to_hf_name(cfg, family, *from_hf_name(cfg, family, hf)) == hf


@pytest.mark.parametrize("case", list(CASES))
def test_names_are_what_transformers_saves(case):
    family, cfg = CASES[case]
    names = [h for o, h, e in weight_table(cfg, family) if part(cfg, family, o, e) == 0] + list(extra_hf_tensors(cfg, family))
    assert len(names) == len(set(names))  # unique (a tensor concatenating several of ours: named once)
    mtp_hf = {h for o, h, e in weight_table(cfg, family) if o.startswith("mtp.")}  # nemotron's mtp.*, GLM's layers.{L}
    trunk = set(names) - mtp_hf  # transformers builds no MTP head (vLLM reads it)
    assert trunk == saved_names(cfg, family)
    mtp = [(o, h, e) for o, h, e in weight_table(cfg, family) if o.startswith("mtp.")]
    assert len(mtp) == sum(s[0] if ".experts." in n and not n.endswith(".weight") else 1
                           for n, s in shapes(cfg).items() if n.startswith("mtp."))
    for ours, hf, e in (r for r in mtp if r[1].startswith("mtp.")):  # nemotron_h: our names, unprefixed, experts split
        assert hf == (ours if e is None else f"{ours.rsplit('.', 1)[0]}.{e}.{ours.rsplit('.', 1)[1]}.weight")


def test_llama_pairing_and_experts():
    _, cfg = CASES["mixtral"]
    assert to_hf_name(cfg, "mixtral", "layers.2.norm.weight") == "model.layers.1.input_layernorm.weight"
    assert to_hf_name(cfg, "mixtral", "layers.3.norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert to_hf_name(cfg, "mixtral", "layers.3.mixer.experts.gate_proj", 2) == \
        "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    assert from_hf_name(cfg, "mixtral", "model.layers.1.self_attn.o_proj.weight") == ("layers.2.mixer.o_proj.weight", None)
    _, nem = CASES["nemotron_h"]
    assert to_hf_name(nem, "nemotron_h", "layers.3.mixer.experts.up_proj", 1) == \
        "backbone.layers.3.mixer.experts.1.up_proj.weight"


@pytest.mark.parametrize("family, name, expert", [
    ("llama", "layers.1.mixer.q_proj.weight", None),  # an attention tensor on an MLP layer
    ("qwen2", "layers.0.mixer.o_proj.bias", None),  # qwen2 has no o_proj bias
    ("mixtral", "layers.1.mixer.experts.up_proj", None),  # a fused expert tensor needs its expert
    ("mixtral", "layers.1.mixer.experts.up_proj", 4),  # out of range
    ("mixtral", "layers.1.mixer.gate.weight", 0),  # not per expert
])
def test_unknown_names_are_refused(family, name, expert):
    cfg = CASES[family][1]
    with pytest.raises(RemodelError):
        to_hf_name(cfg, family, name, expert)


def test_unknown_hf_names_are_refused():
    cfg = CASES["llama"][1]
    for hf in ("model.layers.0.mlp.experts.0.up_proj.weight", "backbone.embeddings.weight", "model.rotary_emb.inv_freq"):
        with pytest.raises(RemodelError):
            from_hf_name(cfg, "llama", hf)
    with pytest.raises(RemodelError):
        to_hf_name(cfg, "gpt2", "embeddings.weight")


def test_part_of_unequal_and_interleaved_parts_round_trips():
    """A Part of unequal sizes (Qwen3.5's in_proj_qkv: q, k, v) and of per-group blocks (Qwen3-Next's
    in_proj_qkvz: per key head q, k, v, z): narrowing every part and joining them gives the HF tensor back,
    and hf_index maps our indices to the rows narrow reads."""
    import torch

    from remodel.models.families.family import Part
    sizes = (4, 4, 12, 12)  # 2 groups: per group q 2, k 2, v 6, z 6
    hf = torch.arange(32 * 3).view(32, 3)
    for blocks in (1, 2):
        parts = [Part("x", 0, i, 4, sized=True, blocks=blocks, sizes=sizes) for i in range(4)]
        got = [p.narrow(hf) for p in parts]
        assert [t.shape[0] for t in got] == list(sizes)
        assert torch.equal(parts[0].join(got, 0), hf)
        for p, t in zip(parts, got):
            assert torch.equal(hf[p.hf_index(torch.arange(t.shape[0]), t.shape[0])], t)
            assert p.hf_shape(tuple(t.shape)) == (32, 3)
    per_group = Part("x", 0, 2, 4, sized=True, blocks=2, sizes=sizes).narrow(hf)
    assert torch.equal(per_group, torch.cat([hf[4:10], hf[20:26]]))  # group 0's v rows, then group 1's
    assert torch.equal(Part("x", 0, 1, 2).narrow(hf), hf[16:])  # equal halves (granite's gate/up) unchanged
