"""Every GPU path has a CPU test of its arithmetic (CI has no GPU).

The Mamba mixer's CUDA path calls three optional kernels: mamba-ssm's `mamba_chunk_scan_combined` (dt +
dt_bias, softplus and the dt clamp folded in) and Triton `rmsnorm_fn` (gated group RMSNorm), and
causal-conv1d's `causal_conv1d_fn`. Here pure-PyTorch stand-ins with those functions' exact signatures and
semantics are installed as the modules they are imported from, the mixer's own dispatch (`_core`, `_on_gpu`
forced on) picks them up, and its output and every gradient must equal the CPU path's (the fused blocked
kernel, which shares no code with the stand-ins) within 1e-5: in float64 (the scans run in float64 there,
the gated norms in float32 as always) output and every gradient, in float32 output and input gradient
(the fp32 parameter gradients carry the CPU path's own rounding: A_log's is ~2e-5 off float64). Mutated
stand-ins (a dispatch that forgot dt_bias, the clamp, the gate order, ...) must break that equality, so
the comparison can fail. The benchmark's `--smoke` mode runs bench/bench_gpu.py end to end on CPU.
"""
import functools
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import remodel.models.mamba as mamba
from remodel.models.config import ModelConfig
from remodel.models.mamba import Mamba2Mixer, ssd_reference

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


def _cd(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    """mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined in torch: dt (+ dt_bias), softplus'ed
    (threshold 20) and clamped to dt_limit in fp32, then the recurrence; output in x's dtype."""
    b, l, h, p = x.shape
    assert dt.shape == (b, l, h) and A.shape == (h,) and B.shape == C.shape and B.shape[:2] == (b, l)
    assert D is None or D.shape in ((h,), (h, p))
    assert z is None and initial_states is None and seq_idx is None and cu_seqlens is None
    assert not return_final_states and not return_varlen_states
    cd = _cd(x)
    dt = dt.to(cd) + (dt_bias.to(cd) if dt_bias is not None else 0.0)
    dt = (F.softplus(dt) if dt_softplus else dt).clamp(*dt_limit)
    y = ssd_reference(x.to(cd), dt, A.to(cd), B.to(cd), C.to(cd), D.to(cd) if D is not None else None)
    return y.to(x.dtype)


def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn in torch (its rms_norm_ref): per group of
    `group_size` channels, x * silu(z) normalised (norm_before_gate=False) or normalised then gated; fp32
    arithmetic, output in x's dtype."""
    assert x.stride(-1) == 1 and weight.shape == (x.shape[-1],)
    assert z is None or (z.shape == x.shape and z.stride(-1) == 1)
    cd = _cd(x)
    xf = x.to(cd)
    if z is not None and not norm_before_gate:
        xf = xf * F.silu(z.to(cd))
    xg = xf.unflatten(-1, (-1, group_size or x.shape[-1]))
    out = (xg * torch.rsqrt(xg.square().mean(-1, keepdim=True) + eps)).flatten(-2) * weight.to(cd)
    if bias is not None:
        out = out + bias.to(cd)
    if z is not None and norm_before_gate:
        out = out * F.silu(z.to(cd))
    return out.to(x.dtype)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """causal_conv1d.causal_conv1d_fn in torch (its causal_conv1d_ref): x [b, dim, l], weight [dim, width];
    causal depthwise conv, optional silu; output in x's dtype."""
    assert activation in (None, "silu", "swish") and 2 <= weight.shape[-1] <= 4
    assert weight.dim() == 2 and x.shape[1] == weight.shape[0] and (bias is None or bias.shape == (x.shape[1],))
    assert x.stride(1) == 1 or x.stride(2) == 1
    if x.stride(1) == 1 and x.stride(2) > 1:  # channel-last
        assert x.shape[1] % 8 == 0 and x.stride(0) % 8 == 0 and x.stride(2) % 8 == 0
    assert bias is None or bias.dtype == weight.dtype
    assert seq_idx is None and initial_states is None and not return_final_states and final_states_out is None
    out = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, padding=weight.shape[1] - 1, groups=x.shape[1])
    out = out[..., :x.shape[-1]]
    return (out if activation is None else F.silu(out)).to(x.dtype)


def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, backend="triton", cu_seqlens=None, **kw):
    """fla.modules.causal_conv1d.causal_conv1d in torch: x [b, l, dim] (any strides), weight [dim, width];
    causal depthwise conv, optional silu -> (output in x's dtype, final state or None)."""
    assert activation in (None, "silu", "swish") and weight.dim() == 2 and x.shape[2] == weight.shape[0]
    assert residual is None and initial_state is None and not output_final_state and cu_seqlens is None
    assert weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype)
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=weight.shape[1] - 1, groups=x.shape[2])
    out = out[..., :x.shape[1]].transpose(1, 2)
    return (out if activation is None else F.silu(out)).to(x.dtype), None


STANDINS = {"scan": ("mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined),
            "norm": ("mamba_ssm.ops.triton.layernorm_gated", rmsnorm_fn),
            "conv": ("causal_conv1d", causal_conv1d_fn),
            "conv_fla": ("fla.modules.causal_conv1d", causal_conv1d)}


@pytest.fixture
def install(monkeypatch):
    """install(scan=fn, ...) puts fn (wrapped to record its calls' tensor dtypes) in place of the real kernel,
    as the module models.mamba imports it from; kernels not named are made unimportable. -> the call log."""
    calls = []

    def put(**fns):
        for key, (module, fn) in STANDINS.items():
            chosen = fns.get(key)
            if chosen is None:
                monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
                continue
            mod = types.ModuleType(module)
            setattr(mod, fn.__name__, _logged(key, fn if chosen is True else chosen, calls))
            monkeypatch.setitem(sys.modules, module, mod)
        mamba.gpu_kernels.cache_clear()
        return calls

    monkeypatch.setattr(mamba, "USE_KERNEL", True)
    yield put
    mamba.gpu_kernels.cache_clear()


def _logged(key, fn, calls):
    @functools.wraps(fn)
    def call(*args, **kw):
        calls.append((key, [a.dtype for a in list(args) + list(kw.values()) if isinstance(a, torch.Tensor)]))
        return fn(*args, **kw)
    return call


def mixer_and_input(heads=8, seed=0, dtype=torch.float32, **changes):
    """A mixer with every parameter perturbed, dt clamped at both ends (time_step_min 0.3, time_step_max 1.5,
    so the clamp matters), and an input. heads=8: in_proj width 168, a multiple of 8 (causal-conv1d's
    channel-last stride condition); heads=4: width 100, which it cannot take."""
    cfg = ModelConfig(vocab_size=16, hidden_size=24, pattern="M", mamba_num_heads=heads, mamba_head_dim=8,
                      n_groups=2, ssm_state_size=8, chunk_size=16, time_step_min=0.3, time_step_max=1.5, **changes)
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(cfg).to(dtype)
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return mixer, torch.randn(2, 40, 24, dtype=dtype)


def run(mixer, u, gpu, monkeypatch, mask=None, autocast=False):
    """Output and gradients (input, then every parameter) of the mixer on the CUDA path (gpu) or the CPU path."""
    monkeypatch.setattr(mamba, "_on_gpu", lambda t: gpu)
    mixer.zero_grad()
    u = u.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = mixer(u, attention_mask=mask)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view(y.shape)).sum().backward()
    return [y.detach(), u.grad] + [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in mixer.parameters()]


def rel_err(a, b):
    """Largest difference over the pairs, each relative to the larger of 1 and the reference's largest value."""
    return max(((x - y).abs().max() / max(1.0, x.abs().max().item())).item() for x, y in zip(a, b))


def padded_mask():
    mask = torch.ones(2, 40, dtype=torch.float64)
    mask[1, :7] = 0
    return mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kernels", [("scan",), ("norm",), ("conv",), ("conv_fla",), ("scan", "norm", "conv"),
                                     ("scan", "norm", "conv_fla")])
def test_gpu_kernels_equal_cpu_path(kernels, dtype, install, monkeypatch):
    """The CUDA dispatch with the named kernels (the others: the whole-tensor torch ops) equals the CPU
    path, output and gradients, with padding masked; every named kernel was called once per mixer call."""
    calls = install(**{k: True for k in kernels})
    mixer, u = mixer_and_input(dtype=dtype)
    ref = run(mixer, u, False, monkeypatch, padded_mask())
    assert not calls
    got = run(mixer, u, True, monkeypatch, padded_mask())
    assert sorted(k for k, _ in calls) == sorted(kernels)
    assert rel_err(ref if dtype == torch.float64 else ref[:2], got) < TOL


@pytest.mark.parametrize("heads,width", [(4, 4), (8, 1), (8, 5)])
def test_conv_kernel_skipped_where_unfit(heads, width, install, monkeypatch):
    """Where causal-conv1d refuses (an in_proj width of 100, not a multiple of 8, for its channel-last
    strides; a conv width outside 2..4) the conv falls back to F.conv1d; the scan and norm kernels still
    run and the result still equals the CPU path."""
    calls = install(scan=True, norm=True, conv=True)
    mixer, u = mixer_and_input(heads=heads, dtype=torch.float64, conv_kernel=width)
    ref = run(mixer, u, False, monkeypatch)
    got = run(mixer, u, True, monkeypatch)
    assert sorted(k for k, _ in calls) == ["norm", "scan"]
    assert rel_err(ref, got) < TOL


def _without(fn, **forced):
    """fn with some keyword arguments forced (a dispatch that forgot or changed them)."""
    @functools.wraps(fn)
    def call(*args, **kw):
        return fn(*args, **{**kw, **forced})
    return call


MUTANTS = {
    "scan without dt_bias": dict(scan=_without(mamba_chunk_scan_combined, dt_bias=None)),
    "scan without softplus": dict(scan=_without(mamba_chunk_scan_combined, dt_softplus=False)),
    "scan without dt_limit": dict(scan=_without(mamba_chunk_scan_combined, dt_limit=(0.0, float("inf")))),
    "scan without D": dict(scan=_without(mamba_chunk_scan_combined, D=None)),
    "norm before gate": dict(norm=_without(rmsnorm_fn, norm_before_gate=True)),
    "norm over all channels": dict(norm=_without(rmsnorm_fn, group_size=None)),
    "conv without silu": dict(conv=_without(causal_conv1d_fn, activation=None)),
    "fla conv without silu": dict(conv_fla=_without(causal_conv1d, activation=None)),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_comparison_catches_a_wrong_call(name, install, monkeypatch):
    """The equality above can fail: a kernel called without one of its arguments breaks it by far."""
    calls = install(**MUTANTS[name])
    mixer, u = mixer_and_input(dtype=torch.float64)
    ref = run(mixer, u, False, monkeypatch, padded_mask())
    got = run(mixer, u, True, monkeypatch, padded_mask())
    assert calls and rel_err(ref, got) > 100 * TOL


@pytest.mark.parametrize("conv", ["conv", "conv_fla"])
def test_bf16_reaches_the_kernels_without_fp32_copies(conv, install, monkeypatch):
    """Under bf16 autocast the kernels get bf16 activations (conv input, x, dt, B, C, the scan output and
    the gate) with no fp32 copy made first; only the fp32 parameters (weights, dt_bias, A, D) are fp32
    (fla's conv takes its weight in x's dtype, as autocast's conv does). The result stays within bf16
    rounding of the fp32 CPU path."""
    calls = install(scan=True, norm=True, **{conv: True})
    mixer, u = mixer_and_input()
    ref = run(mixer, u, False, monkeypatch)
    got = run(mixer, u, True, monkeypatch, autocast=True)
    seen = dict(calls)
    assert seen[conv][0] == torch.bfloat16  # x
    assert seen["scan"][:2] == [torch.bfloat16] * 2 and seen["scan"][3:5] == [torch.bfloat16] * 2  # x, dt; B, C
    assert seen["norm"][0] == torch.bfloat16 and seen["norm"][-1] == torch.bfloat16  # y; z
    assert rel_err(ref[:1], [got[0].float()]) < 0.1


def test_kernels_off_without_use_kernel(install, monkeypatch):
    """USE_KERNEL = False (the benchmarks' pure-PyTorch variant) leaves every installed kernel unused."""
    calls = install(scan=True, norm=True, conv=True)
    monkeypatch.setattr(mamba, "USE_KERNEL", False)
    mixer, u = mixer_and_input()
    run(mixer, u, True, monkeypatch)
    assert not calls and mamba.gpu_kernels().scan is not None


def test_bench_gpu_smoke(tmp_path, monkeypatch):
    """bench/bench_gpu.py --smoke runs every part end to end on CPU at tiny shapes (its main, in process)
    and writes its report's keys: parity, the earlier 1.3B measurements, the three windows in bf16 and FP8
    (plain, distill, transformers) and the FP8 loss gap."""
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "DEV", torch.device("cpu"))
    out = tmp_path / "smoke.json"
    bench.main(["--smoke", "--json", str(out)])
    assert mamba.USE_KERNEL
    rep = json.loads(out.read_text())
    assert {"device", "parity_fp32", "train_step_bf16", "fwd_bwd_vs_transformers_bf16", "windows",
            "fp8_loss_gap"} <= set(rep)
    assert set(rep["windows"]) == {"hybrid_1.3b", "nemotron_h_8b_window", "nano_moe_window"}
    for w in rep["windows"].values():
        assert {"params", "bf16", "fp8"} <= set(w)
        for prec in ("bf16", "fp8"):
            assert {"plain", "distill", "transformers"} <= set(w[prec]), prec
            assert all(isinstance(w[prec][k], dict) for k in ("plain", "distill", "transformers")), w[prec]
        assert {"tok_s", "mfu_spec", "step_s"} <= set(w["bf16"]["plain"])
        assert {"tok_s", "mfu_spec", "step_s", "over_plain"} <= set(w["bf16"]["distill"])
    assert {"steps", "loss_bf16", "loss_fp8", "rel_gap"} <= set(rep["fp8_loss_gap"])


def test_gpu_summary_is_flat_and_null_where_not_measured(tmp_path):
    """bench/gpu_summary.py takes each figure from the run's own outputs and writes null for every figure
    the run did not measure (here: no FP8 gap, no fused-loss run, no Super MoE row). An earlier summary in the
    folder (the device script writes one there) is not read as a report: its nulls would hide this run's."""
    spec = importlib.util.spec_from_file_location("gpu_summary", ROOT / "bench" / "gpu_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "profile.json").write_text(json.dumps({"device": "GPU X", "date": "2026-11-26", "windows": {"8b": {
        "ours_over_transformers": 1.4, "vs_transformers": {"1x1024": {"ratio": 1.1}, "1x4096": {"ratio": "error"}}}}}))
    (tmp_path / "windows.json").write_text(json.dumps({"windows": {"nemotron_h_8b_window": {
        "fp8_speedup_plain": 1.25, "bf16": {"distill": {"over_plain": 1.5}}}}}))
    (tmp_path / "gpu_mfu.json").write_text(json.dumps({"mfu_1p3b_bf16": {"mfu_spec": 0.41}}))
    (tmp_path / "moe.log").write_text('nano ...\n{"rows": [{"window": "nano", "grouped_over_dense": 0.7}]}\n')
    (tmp_path / "gpu_summary.json").write_text(json.dumps({"mfu_1p3b_bf16": None, "device": "old"}))
    s = mod.main([str(tmp_path), "--out", str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text()) == s
    assert list(s) == list(mod.KEYS)
    assert s["device"] == "GPU X" and s["mfu_1p3b_bf16"] == 0.41 and s["fp8_vs_bf16"] == 1.25
    assert s["vs_transformers"] == {"1x1024": 1.1, "1x4096": None, "2x4096": 1.4}
    assert s["distill_vs_plain"] == 1.5 and s["fp8_loss_gap_rel"] is None and s["loss_peak_gib"] is None
    assert s["moe_vs_dense"] == {"nano": 0.7, "super": None}


def test_profile_tables_count_kernels_not_user_ranges(monkeypatch):
    """bench/gpu_profile.py's kernel table leaves out the GPU-side user ranges (torch.optim's
    "Optimizer.step#AdamW.step", whose time is its kernels' again): the total is the kernels' alone."""
    from torch.autograd import DeviceType
    spec = importlib.util.spec_from_file_location("gpu_profile", ROOT / "bench" / "gpu_profile.py")
    prof_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prof_mod)

    def ev(key, us, dev=DeviceType.CUDA, annotation=False):
        return types.SimpleNamespace(key=key, self_device_time_total=us, count=1, device_type=dev,
                                     input_shapes=[], is_user_annotation=annotation)
    events = [ev("multi_tensor_apply_kernel<FusedAdam>", 18.0), ev("Optimizer.step#AdamW.step", 18.5, annotation=True),
              ev("nvjet_sm90_gemm", 40.0), ev("aten::mm", 40.0, DeviceType.CPU)]
    fake = types.SimpleNamespace(key_averages=lambda group_by_input_shape=False: events)
    rows, total, ops = prof_mod.kernel_rows(fake)
    assert [r[0] for r in rows] == ["nvjet_sm90_gemm", "multi_tensor_apply_kernel<FusedAdam>"] and total == 58.0
    assert list(ops) == ["aten::mm"]
