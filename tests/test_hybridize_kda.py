"""`remodel hybridize --mixer kda` (issue 57): transformers-saved Llama / Qwen3 checkpoints into Kimi Linear
(every attention layer KDA, the MLPs dense). transformers is the oracle: the written checkpoint is loaded by its
own KimiLinearForCausalLM and compared with the source's."""
from __future__ import annotations

import math

import pytest
import torch

from remodel.cli import main
from remodel.models.load import load_model
from tests.conftest import HYBRID_SOURCE, attention_skipped, hf_pair, loaded_as

IDS = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(3))  # HYBRID_SOURCE's vocabulary


def _run(*argv) -> int:
    return main(["hybridize", *map(str, argv)])


@torch.no_grad()
def silenced_logits(m):
    """A written hybrid's logits on IDS with every layer's new mixer silenced (its output projection zeroed)."""
    for layer in m.model.layers:
        mixer = next(getattr(layer, a) for a in ("self_attn", "linear_attn", "mamba") if hasattr(layer, a))
        (mixer.o_proj if hasattr(mixer, "o_proj") else mixer.out_proj).weight.zero_()
    return m(IDS, use_cache=False).logits


@pytest.mark.parametrize("src", ["llama", "qwen3"])
@pytest.mark.parametrize("init", ["attention", "random"])
def test_kda_hybrid_loads_as_kimi_linear_every_layer_kda(hybrid_sources, tmp_path, src, init):
    """--keep-attention 0: transformers loads KimiLinearForCausalLM, every layer KDA (one head per query head,
    the attention's head width), every MLP dense and the source's bit for bit, norms and embeddings too."""
    hf, d = hybrid_sources[src]
    assert _run(d, tmp_path / "out", "--mixer", "kda", "--keep-attention", 0, "--init", init) == 0
    m = loaded_as(tmp_path / "out", "KimiLinearForCausalLM")
    c = m.config
    assert c.layer_types == ["linear_attention"] * 4 and c.mlp_layer_types == ["dense"] * 4
    assert (c.linear_num_heads, c.linear_head_dim) == (4, 8)
    for layer, s in zip(m.model.layers, hf.model.layers):
        assert type(layer.self_attn).__name__ == "KimiLinearDeltaAttention"
        for p in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(getattr(layer.mlp, p).weight, getattr(s.mlp, p).weight)
        assert torch.equal(layer.input_layernorm.weight, s.input_layernorm.weight)
        assert torch.equal(layer.post_attention_layernorm.weight, s.post_attention_layernorm.weight)
    assert torch.equal(m.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert torch.equal(m.lm_head.weight, hf.lm_head.weight)
    with torch.no_grad():  # remodel reads the dense Kimi Linear back (no MLA, no experts) and computes its logits
        want = m(IDS, use_cache=False).logits
        assert (load_model(tmp_path / "out")(IDS) - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("src", ["llama", "qwen3"])
def test_kda_layers_read_their_attentions_q_k_v_o(hybrid_sources, tmp_path, src):
    """--init attention read back from the written Kimi Linear: q = Q (times Qwen3's q-norm scale), k / v = K / V
    repeated per query head, o_proj = O, identity convs, the gated norm's weight transformers' (ones: no silent
    start, upcycle.hybrid_kda), A and dt as transformers draws them; with o_proj zeroed (the layers silenced) its
    logits are the source's with attention skipped."""
    hf, d = hybrid_sources[src]
    assert _run(d, tmp_path / "out", "--mixer", "kda", "--keep-attention", 0) == 0
    m = loaded_as(tmp_path / "out", "KimiLinearForCausalLM")
    for layer, s in zip(m.model.layers, hf.model.layers):
        k, a = layer.self_attn, s.self_attn
        qs = a.q_norm.weight[:, None] if src == "qwen3" else 1
        ks = a.k_norm.weight[:, None] if src == "qwen3" else 1
        q = (a.q_proj.weight.unflatten(0, (4, 8)) * qs).flatten(0, 1)
        kk = (a.k_proj.weight.unflatten(0, (2, 8)) * ks).repeat_interleave(2, 0).flatten(0, 1)
        v = a.v_proj.weight.unflatten(0, (2, 8)).repeat_interleave(2, 0).flatten(0, 1)
        assert (k.q_proj.weight - q).abs().max().item() < 1e-6
        assert (k.k_proj.weight - kk).abs().max().item() < 1e-6 and torch.equal(k.v_proj.weight, v)
        assert torch.equal(k.o_proj.weight, a.o_proj.weight)
        assert torch.equal(k.conv1d.weight[..., -1], torch.ones(96, 1)) and not k.conv1d.weight[..., :-1].any()
        assert torch.equal(k.o_norm.weight, torch.ones(8)) and k.g_b_proj.weight.abs().sum() > 0
        A = k.forget_gate.A_log.exp() if hasattr(k, "forget_gate") else k.A_log.exp()
        assert 1 <= A.min().item() and A.max().item() <= 16 and A.std().item() > 0
        dt = torch.nn.functional.softplus(k.forget_gate.dt_bias if hasattr(k, "forget_gate") else k.dt_bias)
        assert math.exp(-7) < dt.min().item() and dt.max().item() < 0.101
    assert (silenced_logits(m) - attention_skipped(hf, range(len(hf.model.layers)), IDS)).abs().max().item() < 1e-4


@pytest.mark.parametrize("flags", [("--keep-attention", 1), ("--keep-layers", "0,2"),
                                   ("--keep-attention", 1, "--to", "kimi_linear")])
def test_kda_refused_with_kept_attention(hybrid_sources, tmp_path, capsys, flags):
    """Kimi Linear holds KDA and latent attention only: a kept grouped-query attention layer is refused in one
    line naming kimi_linear and why, nothing written."""
    _, d = hybrid_sources["llama"]
    capsys.readouterr()
    assert _run(d, tmp_path / "out", "--mixer", "kda", *flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "kimi_linear" in err and "no place for the attention layers" in err and "latent attention" in err, err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def tied_sources(tmp_path_factory):
    """hybrid_sources' Llama and Qwen3 with lm_head tied to the embedding."""
    root = tmp_path_factory.mktemp("tied_src")
    return {t: hf_pair(t, root, t, 7, **HYBRID_SOURCE, tie_word_embeddings=True)[::2] for t in ("llama", "qwen3")}


@pytest.mark.parametrize("src", ["llama", "qwen3"])
@pytest.mark.parametrize("mixer,arch,shared", [("kda", "KimiLinearForCausalLM", False),
                                              ("gdn", "Qwen3_5ForCausalLM", True), ("mamba2", "BambaForCausalLM", True)])
def test_tied_source_stays_tied_the_head_a_copy_where_the_family_never_ties(tied_sources, tmp_path, src, mixer, arch,
                                                                             shared):
    """The hybrid of a tied source is tied (config.json and remodel's reading). transformers' Kimi Linear never
    ties lm_head (its _tied_weights_keys is empty): the writers store lm_head as the embedding's copy
    (Family.ties_head, models.load.head_copy); qwen3_5 and bamba share one tensor. With every new mixer's output
    projection zeroed, the logits are the source's with attention skipped."""
    hf, d = tied_sources[src]
    assert hf.config.tie_word_embeddings and hf.lm_head.weight is hf.model.embed_tokens.weight
    assert _run(d, tmp_path / "out", "--mixer", mixer, "--keep-attention", 0) == 0
    assert load_model(tmp_path / "out").cfg.tie_word_embeddings
    m = loaded_as(tmp_path / "out", arch)
    assert m.config.tie_word_embeddings and (m.lm_head.weight is m.model.embed_tokens.weight) is shared
    assert torch.equal(m.lm_head.weight, hf.model.embed_tokens.weight)
    assert torch.equal(m.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert (silenced_logits(m) - attention_skipped(hf, range(len(hf.model.layers)), IDS)).abs().max().item() < 1e-4
