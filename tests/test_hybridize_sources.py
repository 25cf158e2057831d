"""`remodel hybridize --mixer mamba2` from every attention family remodel reads (issue 57, Deliver 1): a
transformers-saved tiny checkpoint of each goes through the CLI. Either transformers loads OUT as the hybrid
family the registry picks, with exactly the asked attention layers and the source's MLP / MoE tensors (and with
every layer kept, the source's logits), or the run is refused in one line naming why, family by family.

  source                         -> family (--keep-attention 1)   why
  mistral (no sliding window)    -> bamba              heads widened (bamba rotates half of each head)
  qwen2 (q/k/v bias)             -> bamba              o_proj bias written as zeros (bamba ties the biases)
  granite (multipliers)          -> granitemoehybrid   the only Mamba-2 family with scalar multipliers
  mixtral (softmax top-k MoE)    -> granitemoehybrid   MoE kept, a zero shared MLP of width 1 (it always has one)
  mistral with a sliding window  refused: no Mamba-2 family has sliding-window attention
  qwen3 (q/k norm)               refused: no Mamba-2 family has q/k-normed attention (--keep-attention 0 converts)
  qwen2_moe (gated shared expert, top-k not renormalised)   refused: granitemoehybrid renormalises, no gate
  qwen3_moe (q/k norm)           refused with kept attention; --keep-attention 0 -> granitemoehybrid, MoE kept
"""
from __future__ import annotations

import pytest
import torch

from remodel.cli import main
from tests.conftest import hf_pair

DENSE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, intermediate_size=40, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
QWEN_MOE = {**{k: v for k, v in DENSE.items() if k != "intermediate_size"}, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 12}
SOURCES = {  # name: (model_type, config.json fields)
    "mistral": ("mistral", dict(DENSE, sliding_window=None)),
    "mistral_window": ("mistral", dict(DENSE, sliding_window=5)),
    "qwen2": ("qwen2", DENSE),
    "qwen3": ("qwen3", DENSE),
    "granite": ("granite", dict(DENSE, embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2,
                                logits_scaling=2.5)),
    "mixtral": ("mixtral", dict(DENSE, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen2_moe": ("qwen2_moe", dict(QWEN_MOE, shared_expert_intermediate_size=20, norm_topk_prob=False)),
    "qwen3_moe": ("qwen3_moe", dict(QWEN_MOE, norm_topk_prob=True)),
}
CONVERTS = {"mistral": "BambaForCausalLM", "qwen2": "BambaForCausalLM", "granite": "GraniteMoeHybridForCausalLM",
            "mixtral": "GraniteMoeHybridForCausalLM"}
TO = {"BambaForCausalLM": "bamba", "GraniteMoeHybridForCausalLM": "granitemoehybrid"}
IDS = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(3))


def _source(name, tmp_path_factory):
    model_type, fields = SOURCES[name]
    hf, _, d = hf_pair(model_type, tmp_path_factory.getbasetemp() / "hybridize_sources", name, 11, **fields)
    return hf, d


def _run(*argv) -> int:
    return main(["hybridize", *map(str, argv)])


def _load(out, arch):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(m).__name__ == arch
    return m


def _holding(m, module: str) -> list:
    """The decoder layers of transformers' model `m` that hold `module` (granitemoehybrid sets the other None)."""
    return [i for i, layer in enumerate(m.model.layers) if getattr(layer, module, None) is not None]


def _ffn_pairs(src_layer, layer) -> list:
    """(source tensor, hybrid tensor) of one decoder layer's MLP or MoE in transformers' names; a zero shared MLP
    where the source has none."""
    s = src_layer.mlp
    if hasattr(layer, "feed_forward"):  # a SwiGLU MLP module of its own
        return [(getattr(s, p).weight, getattr(layer.feed_forward, p).weight) for p in ("gate_proj", "up_proj", "down_proj")]
    shared = layer.shared_mlp
    if not hasattr(s, "experts"):  # the dense MLP is the shared MLP, gate and up fused
        return [(torch.cat([s.gate_proj.weight, s.up_proj.weight]), shared.input_linear.weight),
                (s.down_proj.weight, shared.output_linear.weight)]
    moe = layer.block_sparse_moe
    return [(s.gate.weight, moe.router.weight), (s.experts.gate_up_proj, moe.experts.gate_up_proj),
            (s.experts.down_proj, moe.experts.down_proj),
            (torch.zeros_like(shared.output_linear.weight), shared.output_linear.weight)]


@pytest.mark.parametrize("name", sorted(CONVERTS))
def test_one_attention_layer_kept_in_the_family_found(name, tmp_path, tmp_path_factory):
    """No --to: transformers loads OUT as the family the registry picks, exactly one attention layer, every other
    layer Mamba-2, and every decoder layer's MLP / MoE tensors the source's, bit for bit."""
    hf, src = _source(name, tmp_path_factory)
    assert _run(src, tmp_path / "out", "--keep-attention", 1) == 0
    m = _load(tmp_path / "out", CONVERTS[name])
    assert _holding(m, "self_attn") == [2] and _holding(m, "mamba") == [0, 1, 3]
    for j in range(4):
        for want, got in _ffn_pairs(hf.model.layers[j], m.model.layers[j]):
            assert torch.equal(got, want), (j, got.shape, want.shape)
    with torch.no_grad():
        assert torch.isfinite(m(IDS).logits).all()


@pytest.mark.parametrize("name", sorted(CONVERTS))
def test_every_layer_kept_writes_the_sources_logits(name, tmp_path, tmp_path_factory):
    """Conversion without replacement is the identity in the family that holds the source: transformers' logits
    of OUT are the source's within 1e-4 (widened heads, a zero o_proj bias, a zero shared MLP, multipliers)."""
    hf, src = _source(name, tmp_path_factory)
    arch = CONVERTS[name]
    assert _run(src, tmp_path / "out", "--keep-attention", 4, "--to", TO[arch]) == 0
    m = _load(tmp_path / "out", arch)
    assert _holding(m, "self_attn") == [0, 1, 2, 3] and _holding(m, "mamba") == []
    with torch.no_grad():
        want, got = hf(IDS).logits, m(IDS).logits
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("name,why", [("mistral_window", "sliding-window"), ("qwen3", "q/k norm"),
                                      ("qwen2_moe", "renormalised softmax router"), ("qwen3_moe", "q/k norm")])
def test_refused_in_one_line_naming_why_per_family(name, why, tmp_path, tmp_path_factory, capsys):
    """Where no Mamba-2 family holds the kept attention or the MoE exactly: one line naming each family that holds
    Mamba-2 layers (as --to) and its reason (granitemoehybrid's that of its form closest to holding it: with a
    zero shared MLP where the source has none), nothing written."""
    _, src = _source(name, tmp_path_factory)
    capsys.readouterr()
    assert _run(src, tmp_path / "out", "--keep-attention", 1) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--to bamba:" in err, err
    assert why in err.split("--to granitemoehybrid: ")[1].split(";")[0], err  # the reason of the family closest
    assert not (tmp_path / "out").exists()


def test_qwen3_moe_without_attention_keeps_its_moe(tmp_path, tmp_path_factory):
    """Every layer replaced, the q/k norm goes with the attention: a Qwen3-MoE (renormalised top-k, no shared
    expert) becomes an all-Mamba granitemoehybrid whose MoE layers are the source's (a zero shared MLP)."""
    hf, src = _source("qwen3_moe", tmp_path_factory)
    assert _run(src, tmp_path / "out", "--keep-attention", 0) == 0
    m = _load(tmp_path / "out", "GraniteMoeHybridForCausalLM")
    assert m.config.layer_types == ["linear_attention"] * 4
    for j in range(4):
        for want, got in _ffn_pairs(hf.model.layers[j], m.model.layers[j]):
            assert torch.equal(got, want), j
    with torch.no_grad():
        assert torch.isfinite(m(IDS, use_cache=False).logits).all()
