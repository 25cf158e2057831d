"""CUDA parity (issue 42): runs only where a CUDA GPU is present (the device machine), skipped elsewhere.

- every family against transformers on the GPU in fp32 (TF32 off): logits within 1e-4 and the gradient of
  every parameter whose name maps one to one, both sides on their plain PyTorch paths (ours with the kernels
  off; transformers with the reference functions its modeling module replaced by fla's kernels at import:
  Triton's fp32 dots run in TF32, in another layout than ours), and the loss under bf16 autocast within
  bf16 rounding of transformers' own; nemotron_h and one Gated DeltaNet family also with the GPU kernels that
  import there (mamba-ssm's Triton scan and norm, fla-core's conv and gated delta rule), within TF32 rounding;
- fla-core's Triton causal conv (the conv where causal-conv1d is absent) against F.conv1d, forward and
  gradients, on a strided slice as the mixer passes it;
- the fused AdamW the trainer takes on CUDA against the foreach one, three steps;
- the CE the fused loss takes on CUDA (liger-kernel's fused linear CE) against ours, under bf16 autocast
  over fp32 weights as the trainer runs it.
"""
import copy
import inspect
import sys

import pytest
import torch
import torch.nn.functional as F

import remodel.models.gdn_kernels as gdn_kernels
import remodel.models.mamba as mamba
import remodel.pipelines.training.trainer as trainer
from remodel.models.families import FAMILIES as REGISTERED
from remodel.models.hf import weight_table
from tests.conftest import hf_pair

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = torch.device("cuda")
PICKS = {"nemotron_h_latent": ("nemotron_h", "latent"), "bamba": ("bamba", "biased_tied"),
         "falcon_h1": ("falcon_h1", "rms_norm")}  # beyond each family's first tiny model (Family.tiny)
FAMILIES = {  # name: (model_type, one tiny model's transformers kwargs), every registered family
    **{f: (f, next(iter(fam.tiny.values()))) for f, fam in REGISTERED.items()},
    **{name: (f, REGISTERED[f].tiny[case]) for name, (f, case) in PICKS.items()}}


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def pair(name, tmp_path_factory):
    model_type, kw = FAMILIES[name]
    hf, ours, _ = hf_pair(model_type, tmp_path_factory.getbasetemp() / "cuda", name, len(name), **kw)
    vocab = kw["vocab_size"] if "vocab_size" in kw else kw["text_config"]["vocab_size"]  # a tower family's text
    return copy.deepcopy(hf).to(DEV), copy.deepcopy(ours).to(DEV), vocab


def plain_pytorch(hf, monkeypatch, ours_too=True):
    """transformers' own PyTorch functions back in its modeling module (where it bound a package's kernel at
    import: a wrapper whose __wrapped__ is the module's reference function), and, with ours_too, our
    kernels off."""
    module = sys.modules[type(hf).__module__]
    for name, fn in list(vars(module).items()):
        ref = inspect.unwrap(fn) if inspect.isfunction(fn) else fn
        if ref is not fn and getattr(ref, "__module__", None) == module.__name__:
            monkeypatch.setattr(module, name, ref)
    if ours_too:
        monkeypatch.setattr(mamba, "USE_KERNEL", False)
        monkeypatch.setattr(gdn_kernels, "USE_KERNEL", False)


def logits_and_grads(hf, ours, vocab, autocast=False, backward=True):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 37), generator=g).to(DEV)
    labels = torch.randint(0, vocab, (2, 37), generator=g).to(DEV)
    out, losses = [], []
    for m, fn in ((hf, lambda x: hf(x).logits), (ours, ours)):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = fn(ids)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), labels.reshape(-1))
        if backward:
            loss.backward()
        out.append(logits.detach().float())
        losses.append(loss.item())
    return out, losses


def grad_errors(hf, ours, family):
    """Largest gradient difference over the parameters whose transformers name maps one to one, in units of
    test_model_parity's tolerance (1e-5 + 1e-4 x the reference's largest), and how many were compared (the
    embedding's pad row too: ours freezes it where transformers does, ModelConfig.padding_idx)."""
    hf_p, ours_p = dict(hf.named_parameters()), dict(ours.named_parameters())
    worst, n = 0.0, 0
    for our_name, hf_name, e in weight_table(ours.cfg, family):
        hf_name = hf_name.replace("backbone.", "model.", 1) if hf_name not in hf_p else hf_name
        if e is not None or our_name not in ours_p or hf_name not in hf_p or hf_p[hf_name].grad is None:
            continue
        ref, got = hf_p[hf_name].grad, ours_p[our_name].grad
        if got is None or got.shape != ref.shape:  # a fused transformers tensor (Granite's input_linear)
            continue
        worst = max(worst, (got - ref).abs().max().item() / (1e-5 + 1e-4 * ref.abs().max().item()))
        n += 1
    return worst, n


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers_on_cuda(name, tmp_path_factory, monkeypatch):
    hf, ours, vocab = pair(name, tmp_path_factory)
    family = FAMILIES[name][0]
    plain_pytorch(hf, monkeypatch)
    (ref, got), _ = logits_and_grads(hf, ours, vocab)
    assert (got - ref).abs().max().item() <= 1e-4 and ref.std().item() > 0.3
    worst, n = grad_errors(hf, ours, family)
    assert n >= 4 and worst <= 1.0, (worst, n)
    _, (l_hf, l_ours) = logits_and_grads(hf, ours, vocab, autocast=True)
    assert abs(l_ours - l_hf) <= 2e-2 * abs(l_hf), (l_ours, l_hf)


def test_gpu_kernels_match_transformers(tmp_path_factory, monkeypatch):
    """nemotron_h with the GPU kernels that import here (Triton: each tiny width compiles its own, so one
    family): logits within TF32-class rounding of transformers'."""
    hf, ours, vocab = pair("nemotron_h", tmp_path_factory)
    monkeypatch.setattr(mamba, "USE_KERNEL", True)
    (ref, got), _ = logits_and_grads(hf, ours, vocab)
    assert any(mamba.gpu_kernels()) and (got - ref).abs().max().item() <= 2e-3, mamba.gpu_kernels()


def test_gdn_kernels_match_transformers(tmp_path_factory, monkeypatch):
    """A Gated DeltaNet family with fla-core's kernels on both sides (ours: q, k per key head, fla's GVA;
    transformers: repeated per value head): logits within TF32-class rounding of transformers', and of our
    plain path."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    hf, ours, vocab = pair("qwen3_5_text", tmp_path_factory)
    kernel, calls = gdn_kernels.fla_kernel(), []
    monkeypatch.setattr(gdn_kernels, "fla_kernel", lambda: lambda *a, **k: calls.append(1) or kernel(*a, **k))
    monkeypatch.setattr(mamba, "USE_KERNEL", True)
    monkeypatch.setattr(gdn_kernels, "USE_KERNEL", True)
    backward = not gdn_kernels.fla_backward_refused()  # else fla raises in both sides' backward: logits only
    with torch.set_grad_enabled(backward):
        (ref, got), _ = logits_and_grads(hf, ours, vocab, backward=backward)
        monkeypatch.setattr(gdn_kernels, "USE_KERNEL", False)
        (_, plain), _ = logits_and_grads(hf, ours, vocab, backward=backward)
    assert calls and kernel is not None and ref.std().item() > 0.3
    assert (got - ref).abs().max().item() <= 2e-3 and (got - plain).abs().max().item() <= 2e-3


def test_fla_conv_matches_conv1d():
    fla = pytest.importorskip("fla.modules.causal_conv1d").causal_conv1d
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(96, 96, 4, groups=96, padding=3).to(DEV)
    big = torch.randn(2, 300, 200, device=DEV)
    outs = []
    for kernel in (None, fla):
        x = big.clone().requires_grad_(True)
        conv.zero_grad()
        y = mamba.causal_conv_silu(x[..., 40:136], conv, None, kernel)  # a strided slice, as in the mixer
        (y * torch.linspace(-1, 1, y.numel(), device=DEV).view(y.shape)).sum().backward()
        outs.append([y.detach(), x.grad, conv.weight.grad.clone(), conv.bias.grad.clone()])
    for a, b in zip(*outs):
        assert (a - b).abs().max().item() <= 1e-4 * max(1.0, a.abs().max().item())


def test_fused_adamw_matches_foreach(monkeypatch):
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 8)).to(DEV)
    x = torch.randn(32, 64, device=DEV)
    result = []
    for fused in (True, False):
        monkeypatch.setattr(trainer, "FUSED_ADAMW", fused)
        m = copy.deepcopy(base)
        opt = trainer.build_optimizer(dict(m.named_parameters()), 1e-2, 0.1)
        assert all(bool(g["fused"]) == fused for g in opt.param_groups)
        for _ in range(3):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        result.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert (result[0] - result[1]).abs().max().item() <= 1e-6
    assert (result[0] - torch.cat([p.detach().flatten() for p in base.parameters()])).abs().max().item() > 1e-3


def test_liger_ce_matches_ours_on_cuda(monkeypatch):
    from remodel.pipelines.training import fused_loss
    real = fused_loss.liger_ce()
    if real is None:
        pytest.skip("liger-kernel not installed")
    calls = []
    monkeypatch.setattr(fused_loss, "liger_ce", lambda: lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    h = torch.randn(1000, 256, device=DEV, requires_grad=True)
    w = (0.05 * torch.randn(5000, 256, device=DEV)).requires_grad_()
    labels = torch.randint(0, 5000, (1000,), device=DEV)
    labels[::9] = -100
    out = []
    for liger in (True, False):
        monkeypatch.setattr(fused_loss, "LIGER", liger)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fused_loss.fused_lm_loss(h, w, labels)
        out.append([loss.detach().float()] + list(torch.autograd.grad(loss, (h, w))))
        assert len(calls) == 1  # liger ran for the first, ours for the second
    for a, b in zip(*out):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item()
