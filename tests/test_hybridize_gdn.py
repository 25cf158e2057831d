"""`remodel hybridize --mixer gdn` (issue 57): transformers-saved Llama / Qwen3 / Qwen3-MoE checkpoints into
Gated DeltaNet / gated-attention hybrids (qwen3_5_text, qwen3_next). transformers is the oracle: the written
checkpoint is loaded by its own class and compared with the source's."""
from __future__ import annotations

import pytest
import torch

from remodel.cli import main
from remodel.models.families import FAMILIES
from tests.conftest import attention_skipped, hf_pair, loaded_as

IDS = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(3))  # HYBRID_SOURCE's vocabulary


def _run(*argv) -> int:
    return main(["hybridize", *map(str, argv)])


@pytest.mark.parametrize("src", ["llama", "qwen3"])
@pytest.mark.parametrize("flags,attn", [(("--keep-layers", "0,3"), [0, 3]), (("--keep-attention", "1"), [2]),
                                        (("--keep-attention", "0", "--init", "random"), [])])
def test_gdn_hybrid_loads_as_qwen3_5_with_the_asked_attention_layers(hybrid_sources, tmp_path, src, flags, attn):
    """The registry's family for a dense source (no --to) is qwen3_5_text: transformers loads it with exactly the
    asked attention layers, the rest Gated DeltaNet, the MLPs the source's (zero-centred norms: weight - 1)."""
    hf, d = hybrid_sources[src]
    assert _run(d, tmp_path / "out", "--mixer", "gdn", *flags) == 0
    m = loaded_as(tmp_path / "out", "Qwen3_5ForCausalLM")
    assert [j for j, t in enumerate(m.config.layer_types) if t == "full_attention"] == attn
    assert m.config.linear_num_key_heads == m.config.linear_num_value_heads == 4
    for j, layer in enumerate(m.model.layers):
        assert hasattr(layer, "self_attn") == (j in attn) and hasattr(layer, "linear_attn") == (j not in attn)
        assert torch.equal(layer.mlp.down_proj.weight, hf.model.layers[j].mlp.down_proj.weight)
        want = hf.model.layers[j].post_attention_layernorm.weight
        assert (layer.post_attention_layernorm.weight + 1 - want).abs().max().item() < 1e-6
    with torch.no_grad():  # no cache: transformers' all-linear cache asks for attention mask sizes
        assert torch.isfinite(m(IDS, use_cache=False).logits).all()


def test_gdn_layers_from_attention_start_silent(hybrid_sources, tmp_path):
    """--init attention read back from the written Qwen3.5: in_proj_qkv = [Q (times the q-norm scale) | K | V
    repeated per query head], identity convs, zero gate rows, out_proj = O; the silent layers make the hybrid's
    logits the Qwen3 source's with those attention layers skipped (the kept layer is exact: gate 1/2, o_proj x 2)."""
    hf, d = hybrid_sources["qwen3"]
    assert _run(d, tmp_path / "out", "--mixer", "gdn", "--keep-layers", "1") == 0
    m = loaded_as(tmp_path / "out", "Qwen3_5ForCausalLM")
    for j in (0, 2, 3):
        g, a = m.model.layers[j].linear_attn, hf.model.layers[j].self_attn
        q = (a.q_proj.weight.unflatten(0, (4, 8)) * a.q_norm.weight[:, None]).flatten(0, 1)
        k = (a.k_proj.weight.unflatten(0, (2, 8)) * a.k_norm.weight[:, None]).repeat_interleave(2, 0).flatten(0, 1)
        v = a.v_proj.weight.unflatten(0, (2, 8)).repeat_interleave(2, 0).flatten(0, 1)
        assert (g.in_proj_qkv.weight - torch.cat([q, k, v])).abs().max().item() < 1e-6
        assert torch.equal(g.conv1d.weight[..., -1], torch.ones(96, 1)) and not g.conv1d.weight[..., :-1].any()
        assert not g.in_proj_z.weight.any() and torch.equal(g.out_proj.weight, a.o_proj.weight)
    with torch.no_grad():
        got = m(IDS).logits
    assert (got - attention_skipped(hf, [0, 2, 3], IDS)).abs().max().item() < 1e-4


def test_qwen3_every_layer_kept_in_qwen3_5_is_the_identity(hybrid_sources, tmp_path):
    """Conversion without replacement: Qwen3's attention in Qwen3.5's gated, zero-centred form gives its logits."""
    hf, d = hybrid_sources["qwen3"]
    assert _run(d, tmp_path / "out", "--mixer", "gdn", "--keep-attention", 4, "--to", "qwen3_5_text") == 0
    m = loaded_as(tmp_path / "out", "Qwen3_5ForCausalLM")
    with torch.no_grad():
        assert (m(IDS).logits - hf(IDS).logits).abs().max().item() < 1e-4


def test_llama_kept_attention_q_k_norm_deviation(hybrid_sources, tmp_path):
    """A Llama's attention gains Qwen3.5's q/k RMS norms, which are not an identity. Their weight (the heads'
    RMS estimated from the weights) keeps the kept layers closer to the source than unit norms do. Measured
    (tiny randomised Llama, every layer kept): max |logit difference| 1.08 (estimate) vs 1.29 (unit weights),
    logits up to 3.29; stage one (attention transfer) is to fit the rest."""
    hf, d = hybrid_sources["llama"]
    assert _run(d, tmp_path / "out", "--mixer", "gdn", "--keep-attention", 4) == 0
    m = loaded_as(tmp_path / "out", "Qwen3_5ForCausalLM")
    with torch.no_grad():
        want = hf(IDS).logits
        est = (m(IDS).logits - want).abs().max().item()
        for layer in m.model.layers:
            layer.self_attn.q_norm.weight.zero_()
            layer.self_attn.k_norm.weight.zero_()
        unit = (m(IDS).logits - want).abs().max().item()
    print(f"kept layers' logit deviation: estimated norm {est:.3f}, unit norm {unit:.3f}, logits {want.abs().max():.2f}")
    assert est < 0.9 * unit


@pytest.mark.parametrize("to,arch", [("qwen3_next", "Qwen3NextForCausalLM"),
                                     ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")])
def test_moe_source_keeps_its_moe_layers(tmp_path, to, arch):
    """A Qwen3-MoE into qwen3_next / qwen3_5_moe_text: the experts and router copied exactly; every layer kept
    writes the source's logits."""
    tiny = FAMILIES["qwen3_moe"].tiny["plain"]
    hf, _, d = hf_pair("qwen3_moe", tmp_path, "moe", 5, **tiny)
    assert _run(d, tmp_path / "out", "--mixer", "gdn", "--keep-layers", "1", "--to", to) == 0
    m = loaded_as(tmp_path / "out", arch)
    assert m.config.layer_types == ["linear_attention", "full_attention"]
    for j in range(2):
        ours, src = m.model.layers[j].mlp, hf.model.layers[j].mlp
        assert torch.equal(ours.gate.weight, src.gate.weight)
        assert torch.equal(ours.experts.down_proj, src.experts.down_proj)
    assert _run(d, tmp_path / "all", "--mixer", "gdn", "--keep-attention", 2, "--to", to) == 0
    with torch.no_grad():
        assert (loaded_as(tmp_path / "all", arch)(IDS).logits - hf(IDS).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("flags,words", [(("--to", "bamba"), ("--to bamba",)),
                                         (("--to", "qwen3_next"), ("--to qwen3_next", "MoE")),
                                         (("--to", "llama"), ("--to llama",)),
                                         (("--to", "qwen3_5"), ("--to qwen3_5", "vision tower"))])
def test_gdn_refused_where_the_family_cannot_hold_it(hybrid_sources, tmp_path, capsys, flags, words):
    """--to a family without Gated DeltaNet (bamba, llama), needing MoE layers (qwen3_next from a dense Llama) or a
    vision tower (qwen3_5, the released multimodal form: the reason left once norms and gate are adapted): one line
    naming --to and why, nothing written."""
    _, d = hybrid_sources["llama"]
    capsys.readouterr()
    assert _run(d, tmp_path / "out", "--mixer", "gdn", "--keep-attention", 1, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err
    assert not (tmp_path / "out").exists()

