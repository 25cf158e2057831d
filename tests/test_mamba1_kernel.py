"""The Mamba-1 scan on CUDA (models/mamba1.py): mamba-ssm's `selective_scan_fn` where it imports and the tensors are on
CUDA, the PyTorch scan elsewhere. On CPU a stand-in module with the kernel's documented signature and semantics
(state-spaces/mamba, mamba_ssm/ops/selective_scan_interface.py: u, delta [b, d, l]; A [d, n]; B, C [b, n, l];
D [d]; delta dtype = u's, variable B / C in u's dtype, A and D fp32) checks the dispatch and the argument layout:
a Jamba model through it gives the PyTorch scan's logits and gradients. On a GPU with mamba-ssm the real kernel is
held to the PyTorch scan (skipped elsewhere)."""
import sys
import types

import pytest
import torch

from remodel.models import mamba1
from remodel.models.families import FAMILIES
from tests.conftest import hf_pair

TINY = FAMILIES["jamba"].tiny["plain"]


def reference_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False):
    """mamba-ssm's selective_scan_ref for real A and one B / C group, asserting the layout its CUDA kernel
    requires (written from the documented signature; differentiable, so gradients flow through it)."""
    b, d, l = u.shape
    n = A.shape[1]
    assert delta.shape == (b, d, l) and A.shape == (d, n) and B.shape == C.shape == (b, n, l), \
        (u.shape, delta.shape, A.shape, B.shape, C.shape)
    assert delta.dtype == u.dtype and B.dtype == C.dtype == u.dtype, (u.dtype, delta.dtype, B.dtype)
    assert A.dtype == torch.float32 and D is not None and D.shape == (d,) and D.dtype == torch.float32
    assert z is None and delta_bias is None and not delta_softplus and not return_last_state
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    s, ys = u.new_zeros(b, d, n), []
    for t in range(l):
        s = dA[:, :, t] * s + dBu[:, :, t]
        ys.append(torch.einsum("bdn,bn->bd", s, C[:, :, t]))
    return torch.stack(ys, dim=2) + u * D[:, None]


@pytest.fixture
def fake_kernel(monkeypatch):
    """mamba-ssm's module replaced by one holding `reference_scan` (counting its calls), the tensors taken for
    CUDA ones: the import and the dispatch are the product's own."""
    calls = []

    def selective_scan_fn(*args, **kwargs):
        calls.append(args[0].shape)
        return reference_scan(*args, **kwargs)
    mod = types.ModuleType(mamba1.SCAN_KERNEL[0])
    mod.selective_scan_fn = selective_scan_fn
    for name in ("mamba_ssm", "mamba_ssm.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mamba1.SCAN_KERNEL[0], mod)
    mamba1.scan_kernel.cache_clear()
    yield calls
    mamba1.scan_kernel.cache_clear()


def _logits_and_grad(model, x):
    model.zero_grad()
    out = model(x)
    out.square().mean().backward()
    return out.detach(), model.layers[0].mixer.A_log.grad.clone(), model.layers[0].mixer.x_proj.weight.grad.clone()


def test_the_kernel_is_called_in_its_layout_and_gives_the_pytorch_scan(fake_kernel, monkeypatch, tmp_path):
    _, ours, _ = hf_pair("jamba", tmp_path, "jamba-kernel", 3, **TINY)
    x = torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(0))
    want = _logits_and_grad(ours, x)
    assert not fake_kernel  # on CPU tensors the PyTorch scan runs
    monkeypatch.setattr(mamba1, "on_gpu", lambda t: t.dtype != torch.float64)
    got = _logits_and_grad(ours, x)
    n_mamba = ours.cfg.pattern.count("S")
    assert fake_kernel == [(2, 2 * TINY["hidden_size"], 11)] * n_mamba  # u [b, d, l], once per Mamba-1 layer
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())
    monkeypatch.setattr(mamba1, "USE_KERNEL", False)  # the switch turns it off
    ours(x)
    assert len(fake_kernel) == n_mamba


def test_float64_and_a_missing_kernel_take_the_pytorch_scan(monkeypatch):
    monkeypatch.setitem(sys.modules, mamba1.SCAN_KERNEL[0], None)  # import fails: None
    mamba1.scan_kernel.cache_clear()
    try:
        assert mamba1.scan_kernel() is None
    finally:
        mamba1.scan_kernel.cache_clear()
    cuda = lambda dtype: types.SimpleNamespace(is_cuda=True, dtype=dtype)  # noqa: E731
    assert mamba1.on_gpu(cuda(torch.float32)) and mamba1.on_gpu(cuda(torch.bfloat16))
    assert not mamba1.on_gpu(cuda(torch.float64)) and not mamba1.on_gpu(torch.zeros(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mamba_ssm_kernel_equals_the_pytorch_scan_on_gpu(tmp_path, monkeypatch):
    if mamba1.scan_kernel() is None:
        pytest.skip("mamba-ssm's selective_scan_fn does not import here")
    _, ours, _ = hf_pair("jamba", tmp_path, "jamba-gpu", 3, **TINY)
    model = ours.cuda()
    x = torch.randint(0, TINY["vocab_size"], (2, 37), generator=torch.Generator().manual_seed(0)).cuda()
    got = _logits_and_grad(model, x)
    monkeypatch.setattr(mamba1, "USE_KERNEL", False)
    want = _logits_and_grad(model, x)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item())
