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
        assert len(idx.unique()) < cfg.moe.n_routed_experts
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


@pytest.mark.parametrize("autocast", [False, True])
def test_expert_weight_gradients_come_in_the_weight_layout(autocast, monkeypatch):
    """Each expert weight's gradient is one grouped matmul computing [E, out, in], the parameter's own layout
    (dy^T x per expert), in fp32 for fp32 weights under bf16 autocast too; autograd's grouped_mm backward
    gave it transposed, which CUDA accumulated into .grad by a strided copy (values: the test above)."""
    cfg = ModelConfig(**{**BASE, **VARIANTS["softmax_swiglu"]})
    model = init_weights(HybridLM(cfg), std=0.2, seed=0)
    made, kernel = [], M.GROUPED_MM

    def recording(a, b, **k):
        out = kernel(a, b, **k)
        made.append(out)
        return out
    monkeypatch.setattr(M, "GROUPED_MM", recording)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        run(model, torch.randint(0, 64, (2, 23), generator=torch.Generator().manual_seed(1)), True, monkeypatch)
    weights = sorted(tuple(p.shape) for n, p in model.named_parameters() if n.endswith("experts.up_proj")
                     or n.endswith("experts.gate_proj") or n.endswith("experts.down_proj"))
    assert len(weights) == 3 and sorted(tuple(t.shape) for t in made if t.dim() == 3) == weights
    assert all(t.is_contiguous() for t in made if t.dim() == 3)
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)


def test_shapes_the_kernel_refuses_take_the_loop():
    """Rows or expert widths that are not 16-byte multiples (fp32: 4 elements) go to the loop, and CUDA takes bf16 only."""
    assert M.grouped_ok(torch.zeros(3, 32), 16) and not M.grouped_ok(torch.zeros(3, 30), 16)
    assert not M.grouped_ok(torch.zeros(3, 32), 10) and not M.grouped_ok(torch.zeros(3, 32, dtype=torch.float64), 16)


def test_autocast_takes_the_grouped_path(monkeypatch):
    """A bf16 autocast step over fp32 weights (the trainer's mixed precision) runs the grouped kernel, not the
    loop, and matches the loop under the same autocast within bf16 rounding."""
    cfg = ModelConfig(**{**BASE, **VARIANTS["softmax_swiglu"]})
    model = init_weights(HybridLM(cfg), std=0.2, seed=0)
    ids = torch.randint(0, 64, (2, 23), generator=torch.Generator().manual_seed(1))
    seen, kernel = [], M.GROUPED_MM
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loop, g_loop = run(model, ids, False, monkeypatch)
        monkeypatch.setattr(M.Experts, "expert", lambda *a, **k: pytest.fail("per-expert loop ran"))
        monkeypatch.setattr(M, "GROUPED_MM", lambda a, b, **k: seen.append((a.dtype, b.dtype)) or kernel(a, b, **k))
        grouped, g_grouped = run(model, ids, True, monkeypatch)
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}  # CUDA's kernel takes bf16 only
    assert (grouped.float() - loop.float()).abs().max().item() <= 2e-2 * loop.float().abs().max().item()
    for n in g_loop:
        ref = g_loop[n].float()
        assert (g_grouped[n].float() - ref).abs().max().item() <= 5e-2 * max(ref.abs().max().item(), 1e-6), n


def test_expert_counts_equal_bincount():
    flat = torch.randint(0, 8, (57,), generator=torch.Generator().manual_seed(2))
    assert torch.equal(M.expert_counts(flat, 12), torch.bincount(flat, minlength=12))


CUDA_GROUPED = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not CUDA_GROUPED, reason="needs a Hopper-class CUDA GPU (bf16 grouped GEMM)")
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cuda_grouped_has_no_host_sync_and_equals_the_loop(name, monkeypatch):
    """On CUDA the MoE forward and backward run under sync debug mode 'error' (a .tolist(), .item() or
    CUDA bincount raises), and the bf16 grouped path equals the bf16 loop within bf16 rounding."""
    latent = {"moe_latent_size": 32} if VARIANTS[name].get("moe_latent_size") else {}
    cfg = ModelConfig(**{**BASE, **VARIANTS[name], "hidden_size": 64, "moe_intermediate_size": 32, **latent})
    model = init_weights(HybridLM(cfg), std=0.2, seed=0).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1)).cuda()
    moe = next(iter(model.moe_layers()))
    x = torch.randn(80, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x[None])  # warm-up: lazy CUDA init syncs once
    monkeypatch.setattr(M, "GROUPED", True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe(x[None]).float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    loop, g_loop = run(model, ids, False, monkeypatch)
    grouped, g_grouped = run(model, ids, True, monkeypatch)
    scale = loop.float().abs().max().item()
    assert (grouped.float() - loop.float()).abs().max().item() <= 2e-2 * scale
    for n in g_loop:
        ref = g_loop[n].float()
        assert (g_grouped[n].float() - ref).abs().max().item() <= 3e-2 * max(ref.abs().max().item(), 1e-6), n
