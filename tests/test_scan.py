"""The chunked SSD scan against the naive sequential recurrence (float64), and the mixer's CPU kernels
against its whole-tensor path."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import remodel.models.mamba as mamba
import remodel.models.mamba_kernels as kernels
from remodel.models.config import ModelConfig
from remodel.models.mamba import Mamba2Mixer, ssd_reference
from remodel.models.mamba_kernels import ssd_scan, ssd_scan_state


def make(b=2, l=37, h=4, p=3, g=2, n=5, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    x, B, C = r(b, l, h, p), r(b, l, g, n), r(b, l, g, n)
    dt = F.softplus(r(b, l, h) - 1.0)  # positive step sizes, a few large
    A = -torch.exp(r(h) * 0.5)  # negative, varied decay
    D = r(h)
    return x, dt, A, B, C, D


def reference_with_state(x, dt, A, B, C, s0):
    """The recurrence from a given initial state: returns outputs and the final state."""
    b, l, h, p = x.shape
    r = h // B.shape[2]
    Bh, Ch = B.repeat_interleave(r, dim=2), C.repeat_interleave(r, dim=2)
    s, ys = s0.clone(), []
    for t in range(l):
        s = torch.exp(dt[:, t] * A)[..., None, None] * s + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None]
        ys.append((s * Ch[:, t, :, None]).sum(-1))
    return torch.stack(ys, 1), s


@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("chunk", [1, 3, 16, 64, 100])
@pytest.mark.parametrize("l", [1, 37, 64])
def test_scan_equals_recurrence(g, chunk, l):
    x, dt, A, B, C, D = make(l=l, g=g, seed=chunk + l)
    ref = ssd_reference(x, dt, A, B, C, D)
    y = ssd_scan(x, dt, A, B, C, chunk, D=D)
    assert y.dtype == torch.float64 and y.shape == x.shape
    assert (y - ref).abs().max().item() < 1e-10
    assert ref.abs().max().item() > 0.1
    y0 = ssd_scan(x, dt, A, B, C, chunk)  # without the D skip
    assert (y0 - ssd_reference(x, dt, A, B, C)).abs().max().item() < 1e-10


@pytest.mark.parametrize("chunk", [4, 16, 50])
def test_initial_and_final_state(chunk):
    x, dt, A, B, C, D = make(l=45, g=2, seed=7)
    s0 = torch.randn(2, 4, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref, s_ref = reference_with_state(x, dt, A, B, C, s0)
    y, s = ssd_scan_state(x, dt, A, B, C, chunk, initial_state=s0)
    assert (y - ref).abs().max().item() < 1e-10 and (s - s_ref).abs().max().item() < 1e-10
    # two halves chained through the state equal one pass
    y1, s1 = ssd_scan_state(x[:, :20], dt[:, :20], A, B[:, :20], C[:, :20], chunk, D=D)
    y2 = ssd_scan_state(x[:, 20:], dt[:, 20:], A, B[:, 20:], C[:, 20:], chunk, D=D, initial_state=s1)[0]
    full = ssd_reference(x, dt, A, B, C, D)
    assert (torch.cat([y1, y2], 1) - full).abs().max().item() < 1e-10


def test_gradcheck_tiny():
    x, dt, A, B, C, D = make(b=1, l=7, h=4, p=2, g=2, n=3, seed=3)
    s0 = torch.randn(1, 4, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    args = [t.clone().requires_grad_() for t in (x, dt, A, B, C, D, s0)]

    def fn(x, dt, A, B, C, D, s0):
        return ssd_scan_state(x, dt, A, B, C, 3, D=D, initial_state=s0)

    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("chunk", [5, 16, 64])
def test_gradients_match_reference(chunk):
    x, dt, A, B, C, D = make(l=41, g=2, seed=11)
    w = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = []
    for fn in (lambda *a: ssd_scan(*a[:5], chunk, D=a[5]), ssd_reference):
        args = [t.clone().requires_grad_() for t in (x, dt, A, B, C, D)]
        (fn(*args) * w).sum().backward()
        grads.append([a.grad for a in args])
    for name, g_scan, g_ref in zip("x dt A B C D".split(), *grads):
        assert torch.isfinite(g_scan).all(), name
        assert (g_scan - g_ref).abs().max().item() < 1e-9 * max(1.0, g_ref.abs().max().item()), name


def test_float32_close_to_float64():
    x, dt, A, B, C, D = make(l=300, g=2, seed=5)
    ref = ssd_scan(x, dt, A, B, C, 64, D=D)
    y = ssd_scan(*(t.float() for t in (x, dt, A, B, C)), 64, D=D.float())
    assert y.dtype == torch.float32
    assert (y.double() - ref).abs().max().item() < 1e-4 * ref.abs().max().item()


@pytest.mark.parametrize("block", [1, 700])  # one chunk per block; several chunks and a short last block
def test_blocked_scan_equals_recurrence(block, monkeypatch):
    monkeypatch.setattr(kernels, "BLOCK_ELEMS", block)
    for chunk, l in ((3, 37), (8, 64), (16, 50)):
        x, dt, A, B, C, D = make(l=l, g=2, seed=chunk)
        args = [t.clone().requires_grad_() for t in (x, dt, A, B, C, D)]
        ref_args = [t.clone().requires_grad_() for t in (x, dt, A, B, C, D)]
        w = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(l))
        y = ssd_scan(*args[:5], chunk, D=args[5])
        ref = ssd_reference(*ref_args)
        assert (y - ref).abs().max().item() < 1e-10
        (y * w).sum().backward()
        (ref * w).sum().backward()
        for a, r in zip(args, ref_args):
            assert (a.grad - r.grad).abs().max().item() < 1e-9 * max(1.0, r.grad.abs().max().item())
    x, dt, A, B, C, D = make(b=1, l=10, h=4, p=2, g=2, n=3, seed=9)
    s0 = torch.randn(1, 4, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    args = [t.clone().requires_grad_() for t in (x, dt, A, B, C, D, s0)]
    assert torch.autograd.gradcheck(
        lambda x, dt, A, B, C, D, s0: ssd_scan_state(x, dt, A, B, C, 3, D=D, initial_state=s0), args)


def perturbed_mixer(chunk, seed, **changes):
    """A float64 mixer with every parameter perturbed (so no gradient is trivially zero) and an input."""
    cfg = ModelConfig(vocab_size=16, hidden_size=24, pattern="M", mamba_num_heads=4, mamba_head_dim=8, n_groups=2,
                      ssm_state_size=8, chunk_size=chunk, **changes)
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(cfg).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return mixer, torch.randn(2, 150, 24, dtype=torch.float64)


def test_mixer_blocked_equals_unblocked(monkeypatch):
    mixer, u = perturbed_mixer(chunk=16, seed=0)
    results = []
    for block in (kernels.BLOCK_ELEMS, 1):
        monkeypatch.setattr(kernels, "BLOCK_ELEMS", block)
        mixer.zero_grad()
        y = mixer(u)
        (y * torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view(y.shape)).sum().backward()
        results.append([y.detach()] + [p.grad.clone() for p in mixer.parameters()])
    for a, b in zip(*results):
        assert (a - b).abs().max().item() < 1e-10 * max(1.0, a.abs().max().item())


def test_gpu_path_equals_fused_cpu_path(monkeypatch):
    """The whole-tensor path the mixer takes on CUDA (F.conv1d, one scan block per GPU_BLOCK_ELEMS, the
    config's chunk) run on CPU equals the fused cache-blocked CPU path, outputs and every gradient, with
    padding masked; mamba-ssm's kernel itself is checked on a GPU by bench/bench_gpu.py."""
    mixer, u = perturbed_mixer(chunk=32, seed=1)
    mask = torch.ones(2, 150)
    mask[1, :17] = 0
    results, cpu_block = [], kernels.BLOCK_ELEMS
    for gpu in (False, True):
        monkeypatch.setattr(mamba, "_on_gpu", lambda t, gpu=gpu: gpu)
        monkeypatch.setattr(kernels, "BLOCK_ELEMS", kernels.GPU_BLOCK_ELEMS if gpu else cpu_block)
        mixer.zero_grad()
        y = mixer(u, attention_mask=mask)
        (y * torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view(y.shape)).sum().backward()
        results.append([y.detach()] + [p.grad.clone() for p in mixer.parameters()])
    for a, b in zip(*results):
        assert (a - b).abs().max().item() < 1e-10 * max(1.0, a.abs().max().item())


@pytest.mark.parametrize("K,bias,block", [(1, True, 1), (2, False, 1), (4, True, 1), (3, False, None)])
def test_fused_conv_equals_conv1d(K, bias, block, monkeypatch):
    """The fused CPU core's causal conv (shifted multiply-adds over cache-sized sub-blocks, hand-written
    backward) equals the whole-tensor path's F.conv1d for several kernel widths, with and without the
    conv bias, in 8-step sub-blocks and in one; outputs and every gradient, with padding masked."""
    if block:
        monkeypatch.setattr(kernels, "BLOCK_ELEMS", block)
    mixer, u = perturbed_mixer(chunk=16, seed=K, conv_kernel=K, use_conv_bias=bias)
    mask = torch.ones(2, 150)
    mask[0, :5] = 0
    results = []
    for gpu in (False, True):
        monkeypatch.setattr(mamba, "_on_gpu", lambda t, gpu=gpu: gpu)
        mixer.zero_grad()
        y = mixer(u, attention_mask=mask)
        (y * torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view(y.shape)).sum().backward()
        results.append([y.detach()] + [p.grad.clone() for p in mixer.parameters()])
    assert (mixer.conv1d.bias is not None) == bias and mixer.conv1d.weight.shape[-1] == K
    for a, b in zip(*results):
        assert (a - b).abs().max().item() < 1e-10 * max(1.0, a.abs().max().item())


class _OutputSizes(TorchDispatchMode):
    """Records the element count of every tensor an op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.sizes.append(t.numel())
        return out


def test_memory_linear_in_length():
    """Doubling the length at a fixed chunk doubles the largest tensor and the total produced (no l x l
    tensor, no quadratic work); intermediates are blocked, so the largest ones are the length-sized
    inputs/outputs and the per-chunk states."""
    largest, total = [], []
    for l in (1024, 2048, 4096):
        x, dt, A, B, C, D = make(b=1, l=l, h=8, p=64, g=2, n=16, dtype=torch.float32)
        x.requires_grad_()
        mode = _OutputSizes()
        with mode:
            ssd_scan(x, dt, A, B, C, 64, D=D).sum().backward()
        largest.append(max(mode.sizes))
        total.append(sum(mode.sizes))
    for v in (largest, total):
        assert 1.8 < v[1] / v[0] < 2.2 and 1.8 < v[2] / v[1] < 2.2, v
    assert largest[2] <= 4096 * 8 * 64  # nothing bigger than x itself


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32, torch.float32),
                                    (torch.bfloat16, torch.bfloat16, torch.float32),
                                    (torch.float32, torch.bfloat16, torch.bfloat16)])
def test_gated_norm_equals_autograd_formula(groups, dtypes, monkeypatch):
    """The blocked gated norm (hand-written backward, rows in cache-sized blocks) equals transformers'
    formula under autograd -- weight * normalise(y * silu(z) in fp32).to(y.dtype) -- in output dtype,
    values and gradients, over several row blocks (BLOCK_ELEMS shrunk to 3 rows) and one."""
    yd, zd, wd = dtypes
    g = torch.Generator().manual_seed(groups)
    y = torch.randn(2, 23, 64, generator=g).to(yd).requires_grad_()
    z = torch.randn(2, 23, 64, generator=g).to(zd).requires_grad_()
    w = (1 + 0.3 * torch.randn(64, generator=g)).to(wd).requires_grad_()
    dout = torch.randn(2, 23, 64, generator=g)

    yz = (y.float() * F.silu(z.float())).view(2, 23, groups, -1)
    ref = w * (yz * torch.rsqrt(yz.pow(2).mean(-1, keepdim=True) + 1e-5)).view(2, 23, 64).to(yd)
    ref_grads = torch.autograd.grad(ref, (y, z, w), dout.to(ref.dtype))
    for block in (3 * 64, kernels.BLOCK_ELEMS):
        monkeypatch.setattr(kernels, "BLOCK_ELEMS", block)
        out = mamba.GatedRMSNorm(64, groups, 1e-5)
        out.weight = torch.nn.Parameter(w.detach().clone())
        o = out(y, z)
        assert o.dtype == ref.dtype and o.shape == ref.shape
        assert (o.float() - ref.float()).abs().max().item() <= 1e-6 * ref.float().abs().max().item()
        grads = torch.autograd.grad(o, (y, z, out.weight), dout.to(o.dtype))
        tol = 1e-5 if yd == torch.float32 else 2e-2  # bf16 gradients: one rounding of a few-term sum
        for a, r in zip(grads, ref_grads):
            assert a.dtype == r.dtype
            assert (a.float() - r.float()).abs().max().item() <= tol * r.float().abs().max().item()


@pytest.mark.parametrize("norm", ["GatedRMSNorm", "RMSNormThenGate"])
def test_gated_norms_keep_float64(norm, monkeypatch):
    """Float64 inputs are normalised in float64, not fp32 (issue 39): the norm, in several row blocks and
    in one, equals the float64 formula to float64 rounding, values and gradients -- an fp32 detour would
    be off by ~1e-7 and make blocked != unblocked depend on the CPU's fp32 summation order."""
    g = torch.Generator().manual_seed(3)
    y, z = (torch.randn(2, 23, 64, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    w = (1 + 0.3 * torch.randn(64, generator=g, dtype=torch.float64)).requires_grad_()
    dout = torch.randn(2, 23, 64, generator=g, dtype=torch.float64)
    gate = F.silu(z).view(2, 23, 4, -1)
    h = y.view(2, 23, 4, -1) * (gate if norm == "GatedRMSNorm" else 1)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w.view(4, -1)
    ref = (h if norm == "GatedRMSNorm" else h * gate).reshape(2, 23, 64)
    ref_grads = torch.autograd.grad(ref, (y, z, w), dout)
    for block in (3 * 64, kernels.BLOCK_ELEMS):
        monkeypatch.setattr(kernels, "BLOCK_ELEMS", block)
        mod = getattr(mamba, norm)(64, 4, 1e-5)
        mod.weight = torch.nn.Parameter(w.detach().clone())
        o = mod(y, z)
        assert o.dtype == torch.float64
        assert (o - ref).abs().max().item() <= 1e-13 * ref.abs().max().item()
        for a, r in zip(torch.autograd.grad(o, (y, z, mod.weight), dout), ref_grads):
            assert (a - r).abs().max().item() <= 1e-12 * r.abs().max().item()
