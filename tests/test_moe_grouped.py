"""The grouped expert path (issue 28): one F.grouped_mm per projection over the rows sorted by expert
equals the per-expert loop (outputs and gradients), for every router and expert variant, empty experts
included, and runs no Python loop over the experts."""
import pytest
import torch

from remodel.models import moe as M
from remodel.models.config import ModelConfig
from remodel.models.model import HybridLM, init_weights

BASE = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
VARIANTS = {
    "sigmoid_relu2_shared": dict(pattern="E*E", router="sigmoid", moe_shared_expert_intermediate_size=16),
    "sigmoid_grouped_latent": dict(pattern="EE", router="sigmoid", n_group=2, topk_group=1, moe_latent_size=16),
    "softmax_swiglu": dict(pattern="*E", router="softmax", mlp_act="silu", mlp_gated=True, rope_theta=1e4),
    "softmax_top1_sparse": dict(pattern="E", router="softmax", num_experts_per_tok=1, mlp_act="silu",
                                mlp_gated=True),  # few tokens, top-1: some experts get no row
}


def run(model, ids, grouped, monkeypatch):
    monkeypatch.setattr(M, "GROUPED", grouped)
    model.zero_grad(set_to_none=True)
    out = model(ids)
    (out.float().square().mean() + sum(m.router_logits.square().mean() for m in model.moe_layers())).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_grouped_equals_the_loop(name, monkeypatch):
    cfg = ModelConfig(**{**BASE, **VARIANTS[name]})
    model = init_weights(HybridLM(cfg), std=0.2, seed=0)
    ids = torch.randint(0, 64, (1, 5) if "sparse" in name else (2, 23), generator=torch.Generator().manual_seed(1))
    if "sparse" in name:  # the comparison covers experts with no rows
        logits, w, idx = model.layers[0].mixer.gate(model.embeddings(ids).reshape(-1, 32))
        assert len(idx.unique()) < cfg.n_routed_experts
    loop, g_loop = run(model, ids, False, monkeypatch)
    grouped, g_grouped = run(model, ids, True, monkeypatch)
    assert (grouped - loop).abs().max().item() <= 1e-6 * max(1.0, loop.abs().max().item())
    assert set(g_grouped) == set(g_loop)
    for n in g_loop:
        assert (g_grouped[n] - g_loop[n]).abs().max().item() <= 1e-6 * max(1.0, g_loop[n].abs().max().item()), n


def test_no_python_loop_over_the_experts(monkeypatch):
    """With the grouped path on, forward and backward never run an expert on its own."""
    cfg = ModelConfig(**{**BASE, **VARIANTS["softmax_swiglu"]})
    model = init_weights(HybridLM(cfg), std=0.2, seed=0)

    def refuse(*a, **k):
        raise AssertionError("per-expert loop ran")
    monkeypatch.setattr(M.Experts, "expert", refuse)
    run(model, torch.randint(0, 64, (2, 23)), True, monkeypatch)
    with pytest.raises(AssertionError, match="per-expert loop"):
        run(model, torch.randint(0, 64, (2, 23)), False, monkeypatch)


def test_shapes_the_kernel_refuses_take_the_loop():
    """Rows or expert widths that are not 16-byte multiples (fp32: 4 elements) go to the loop, and CUDA takes bf16 only."""
    assert M.grouped_ok(torch.zeros(3, 32), 16) and not M.grouped_ok(torch.zeros(3, 30), 16)
    assert not M.grouped_ok(torch.zeros(3, 32), 10) and not M.grouped_ok(torch.zeros(3, 32, dtype=torch.float64), 16)
