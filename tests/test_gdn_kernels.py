"""The Gated DeltaNet numerics (models/gdn_kernels.py) against transformers' qwen3_5 torch path (the oracle),
the chunked rule against its token-by-token reference (values and gradients, float64), and the CUDA
dispatch to fla-core's Triton kernel through a stand-in with its signature installed as the module it is
imported from (as tests/test_gpu_paths.py does for mamba-ssm); the real kernel's parity runs where CUDA
and fla-core are present."""
import functools
import sys
import types

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5RMSNormGated, torch_chunk_gated_delta_rule,
                                                          torch_recurrent_gated_delta_rule)

import remodel.models.gdn_kernels as gdn
from remodel.models.gdn_kernels import (chunk_gated_delta_rule, chunk_gated_delta_rule_torch, gated_rms_norm,
                                        recurrent_gated_delta_rule)


def inputs(group=2, hk=2, length=45, dk=8, dv=12, dtype=torch.float32, seed=0, device="cpu"):
    """q, k [2, length, hk, dk], v [2, length, hk * group, dv], g (log decay, in [-2, 0]), beta in (0, 1),
    an initial state: random, each key head's value heads on different gates and values."""
    gen = torch.Generator().manual_seed(seed)
    hv = hk * group

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)

    q, k, v = rnd(2, length, hk, dk), rnd(2, length, hk, dk), rnd(2, length, hv, dv)
    g = -2 * torch.rand(2, length, hv, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
    beta = torch.rand(2, length, hv, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
    return q, k, v, g, beta, rnd(2, hv, dk, dv)


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_transformers(group, chunk, with_state):
    """fp32, 45 steps (no whole number of chunks of 16 or 64): output and final state equal transformers'
    torch_chunk_gated_delta_rule with use_qk_l2norm_in_kernel within 1e-5, for Hv = 1, 2, 3 x Hk."""
    q, k, v, g, beta, s0 = inputs(group=group)
    s0 = s0 if with_state else None
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, initial_state=s0)
    ref, ref_state = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, initial_state=s0,
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert out.shape == ref.shape == v.shape and out.dtype == torch.float32
    assert max_diff(out, ref) < 1e-5 and max_diff(state, ref_state) < 1e-5
    assert ref.abs().max() > 0.1 and ref_state.abs().max() > 0.1


def test_recurrent_equals_transformers():
    """The token-by-token reference equals transformers' torch_recurrent_gated_delta_rule (fp32, 1e-5)."""
    q, k, v, g, beta, s0 = inputs(group=3, length=20)
    out, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    ref, ref_state = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    assert max_diff(out, ref) < 1e-5 and max_diff(state, ref_state) < 1e-5


def _weighted(out, state):
    """A scalar that weighs every output and state entry differently (so every gradient entry counts)."""
    w_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view(out.shape)
    w_state = torch.linspace(1, -0.5, state.numel(), dtype=state.dtype, device=state.device).view(state.shape)
    return (out * w_out).sum() + (state * w_state).sum()


def _values_and_grads(fn, tensors):
    tensors = [t.detach().clone().requires_grad_(True) for t in tensors]
    out, state = fn(*tensors)
    _weighted(out, state).backward()
    return [out.detach(), state.detach()] + [t.grad for t in tensors]


@pytest.mark.parametrize("group,chunk", [(1, 16), (2, 16), (3, 8)])
def test_chunked_equals_recurrent_values_and_gradients(group, chunk):
    """float64: the chunked rule's output, final state and gradients for q, k, v, g, beta and the initial
    state equal the token-by-token reference's within 1e-10 (40 steps: 2.5 chunks of 16, 5 of 8)."""
    tensors = inputs(group=group, length=40, dtype=torch.float64)
    got = _values_and_grads(lambda *t: chunk_gated_delta_rule(*t[:5], chunk_size=chunk, initial_state=t[5]), tensors)
    ref = _values_and_grads(lambda *t: recurrent_gated_delta_rule(*t[:5], initial_state=t[5]), tensors)
    names = ["out", "state", "q", "k", "v", "g", "beta", "initial_state"]
    for name, a, b in zip(names, got, ref):
        assert a.shape == b.shape and b.abs().max() > 1e-3, name
        assert max_diff(a, b) < 1e-10, name


def test_bf16_in_bf16_out():
    """bf16 inputs: the output comes back in bf16, the state in fp32, both within bf16 rounding of fp32."""
    tensors = inputs(group=2)
    out, state = chunk_gated_delta_rule(*(t.bfloat16() for t in tensors[:5]), initial_state=tensors[5])
    ref, ref_state = chunk_gated_delta_rule(*tensors[:5], initial_state=tensors[5])
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert max_diff(out, ref) < 0.05 * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_equals_transformers(dtype):
    """gated_rms_norm equals Qwen3_5RMSNormGated with a random weight (in the input's dtype): fp32 within
    1e-6, bf16 bit for bit."""
    gen = torch.Generator().manual_seed(3)
    x, gate = (torch.randn(2, 7, 3, 16, generator=gen).to(dtype) for _ in range(2))
    norm = Qwen3_5RMSNormGated(16, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(16, generator=gen))
        ref = norm(x, gate)
        got = gated_rms_norm(x, gate, norm.weight, 1e-6)
    assert got.dtype == dtype
    assert max_diff(got, ref) <= (1e-6 if dtype == torch.float32 else 0.0)


# ---- the fla-core dispatch ---------------------------------------------------------------------------

def fla_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                               allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                               chunk_indices=None, cp_context=None, **kwargs):
    """fla.ops.gated_delta_rule.chunk_gated_delta_rule (fla-core 0.6) in torch: q, k [B, T, H, K],
    v [B, T, HV, V] with HV a multiple of H (value head h reads key head h // (HV // H), native GVA),
    g, beta [B, T, HV], initial_state [B, HV, K, V]; q scaled by `scale` (default K**-0.5) after the
    optional L2 norm -> (o [B, T, HV, V] in q's dtype, final state or None)."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    assert k.shape == q.shape and HV % H == 0 and v.shape[:2] == (B, T)
    assert g.shape == beta.shape == (B, T, HV) and not kwargs
    assert initial_state is None or initial_state.shape == (B, HV, K, v.shape[3])
    assert not (use_beta_sigmoid_in_kernel or allow_neg_eigval or state_v_first) and cu_seqlens is None
    if use_qk_l2norm_in_kernel:
        q, k = gdn.l2norm(q.float()), gdn.l2norm(k.float())
    scale = K ** -0.5 if scale is None else scale
    q = q * (scale * K ** 0.5)  # transformers' reference scales by K**-0.5 itself
    o, state = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                output_final_state=output_final_state)
    return o.to(v.dtype), state


@pytest.fixture
def install(monkeypatch):
    """install(fn) puts fn (recording each call's arguments and result) in place of fla's kernel, as the
    module gdn_kernels imports it from, and forces the kernel branch on CPU tensors (`_on_gpu`).
    -> the call log [(args, kwargs, result)]."""
    calls = []

    def put(fn=fla_chunk_gated_delta_rule):
        @functools.wraps(fn)
        def logged(*args, **kw):
            calls.append((args, kw, fn(*args, **kw)))
            return calls[-1][2]
        mod = types.ModuleType(gdn.FLA_KERNEL[0])
        setattr(mod, gdn.FLA_KERNEL[1], logged)
        monkeypatch.setitem(sys.modules, gdn.FLA_KERNEL[0], mod)
        gdn.fla_kernel.cache_clear()
        return calls

    monkeypatch.setattr(gdn, "USE_KERNEL", True)
    monkeypatch.setattr(gdn, "_on_gpu", lambda t: True)
    yield put
    gdn.fla_kernel.cache_clear()


@pytest.mark.parametrize("group", [1, 3])
def test_fla_call_layout_and_result(group, install):
    """The kernel branch calls fla once with q, k unexpanded [b, l, Hk, dk] (fla's native GVA), v, g, beta
    and the initial state as given, an explicit dk**-0.5 scale, its in-kernel q/k L2 norm and the final state
    asked for; fla's own result is what comes back, and it equals the pure path (1e-5, fp32)."""
    calls = install()
    q, k, v, g, beta, s0 = inputs(group=group)
    got = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    [(args, kw, result)] = calls
    assert all(a is b for a, b in zip(args, (q, k, v, g, beta))) and len(args) == 5
    assert kw == dict(scale=8 ** -0.5, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert kw["initial_state"] is s0 and got is result
    ref = chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=s0)
    assert max_diff(got[0], ref[0]) < 1e-5 and max_diff(got[1], ref[1]) < 1e-5


def _forcing(fn, **forced):
    """fn with some keyword arguments forced (a dispatch that forgot or changed them)."""
    @functools.wraps(fn)
    def call(*args, **kw):
        return fn(*args, **{**kw, **forced})
    return call


@pytest.mark.parametrize("mutant", [dict(use_qk_l2norm_in_kernel=False), dict(scale=1.0), dict(initial_state=None)])
def test_fla_comparison_catches_a_wrong_call(mutant, install):
    """The equality above can fail: a call without the L2 norm, with another scale or without the initial
    state is far from the pure path."""
    install(_forcing(fla_chunk_gated_delta_rule, **mutant))
    q, k, v, g, beta, s0 = inputs(group=2)
    got, _ = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    ref, _ = chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=s0)
    assert max_diff(got, ref) > 1e-2


@pytest.mark.parametrize("case", ["USE_KERNEL off", "float64", "key dim 264", "not on CUDA"])
def test_pure_path_where_fla_is_off_or_unfit(case, install, monkeypatch):
    """USE_KERNEL = False, float64 inputs, a key head dim over fla's 256 and CPU tensors take the pure path
    (the installed kernel is not called)."""
    calls = install()
    dtype, dk = (torch.float64 if case == "float64" else torch.float32), (264 if case == "key dim 264" else 8)
    if case == "USE_KERNEL off":
        monkeypatch.setattr(gdn, "USE_KERNEL", False)
    if case == "not on CUDA":
        monkeypatch.setattr(gdn, "_on_gpu", lambda t: t.is_cuda)
    q, k, v, g, beta, s0 = inputs(dtype=dtype, dk=dk, length=10)
    out, _ = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    assert not calls and gdn.fla_kernel() is not None and out.shape == v.shape


def test_backward_reads_each_chunk_without_a_zero_fill():
    """The chunked rule's backward builds no per-chunk gradient of a whole tensor: indexing x[:, :, i] in the
    chunk loop made `select_backward` zero-fill the full [b, h, c, C, *] tensor once per chunk (quadratic in
    length); unbinding once stacks the chunks' gradients in one pass, with the same gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.__name__] = self.ops.get(func.__name__, 0) + 1
            return func(*args, **(kwargs or {}))

    def selects(chunks):
        tensors = [t.requires_grad_(True) for t in inputs(length=16 * chunks, dtype=torch.float64)]
        out, state = chunk_gated_delta_rule_torch(*tensors[:5], chunk_size=16, initial_state=tensors[5])
        with Count() as count:
            _weighted(out, state).backward()
        return sum(n for op, n in count.ops.items() if op.startswith("select_backward")), tensors

    (few, _), (many, tensors) = selects(3), selects(12)
    assert few == many <= 3, (few, many)  # g's, beta's and the chunk-end decay's, once; the old loop: + 5 per chunk
    ref = _values_and_grads(lambda *t: recurrent_gated_delta_rule(*t[:5], initial_state=t[5]),
                            [t.detach() for t in tensors])
    assert max(max_diff(t.grad, r) for t, r in zip(tensors, ref[2:])) < 1e-10


def _fake_fla(monkeypatch, hopper=True, triton="3.6.0", tilelang=False):
    """fla.utils and fla.backends as fla-core 0.6 names them, with the hardware / Triton flags and the TileLang
    backend's availability given."""
    tv = tuple(int(x) for x in triton.split("."))
    utils = types.ModuleType("fla.utils")
    utils.IS_NVIDIA_HOPPER, utils.TRITON_ABOVE_3_4_0, utils.TRITON_ABOVE_3_7_1 = hopper, tv >= (3, 4, 0), tv >= (3, 7, 1)
    backends = types.ModuleType("fla.backends")
    backends.TileLangBackend = type("TileLangBackend", (), dict(is_available=classmethod(lambda c: tilelang),
                                                                is_enabled=classmethod(lambda c: True)))
    fla = types.ModuleType("fla")
    fla.utils, fla.backends = utils, backends
    for name, mod in (("fla", fla), ("fla.utils", utils), ("fla.backends", backends)):
        monkeypatch.setitem(sys.modules, name, mod)
    gdn.fla_backward_refused.cache_clear()


@pytest.mark.parametrize("case,refused", [(dict(), True), (dict(triton="3.7.1"), False), (dict(triton="3.3.1"), False),
                                          (dict(hopper=False), False), (dict(tilelang=True), False)])
def test_fla_backward_refusal_read_from_fla(case, refused, monkeypatch):
    """fla 0.6 raises in its gated backward on Hopper with Triton in [3.4.0, 3.7.1) and no TileLang (seen on an
    H200, Triton 3.6.0): `fla_backward_refused` reads fla's own flags and says so exactly there."""
    _fake_fla(monkeypatch, **case)
    try:
        assert bool(gdn.fla_backward_refused()) == refused
    finally:
        gdn.fla_backward_refused.cache_clear()


def test_pure_path_where_fla_refuses_the_backward(install, monkeypatch):
    """Where fla refuses the backward, a call that will need gradients takes the pure path (warned), so training
    runs; a call without gradients (eval, scoring) still takes fla's kernel."""
    calls = install()
    monkeypatch.setattr(gdn, "fla_backward_refused", lambda: "fla refuses here")
    gdn._warn_once.cache_clear()
    tensors = [t.requires_grad_(True) for t in inputs(length=20)]
    with pytest.warns(RuntimeWarning, match="fla refuses here"):
        out, _ = chunk_gated_delta_rule(*tensors[:5], initial_state=tensors[5])
    out.sum().backward()
    assert not calls and tensors[0].grad is not None
    with torch.no_grad():
        chunk_gated_delta_rule(*tensors[:5], initial_state=tensors[5])
    assert len(calls) == 1
    monkeypatch.setattr(gdn, "fla_backward_refused", lambda: None)
    chunk_gated_delta_rule(*tensors[:5], initial_state=tensors[5])
    assert len(calls) == 2  # not refused: fla takes the gradient call too


def _fla_on_cuda():
    return torch.cuda.is_available() and gdn.optional_import(*gdn.FLA_KERNEL) is not None


def _errors(got, ref, names):
    """Per tensor: (rmse(got - ref) / rmse(ref), max|got - ref| / max|ref|), fla-core's own test metric first."""
    out = {}
    for name, a, b in zip(names, got, ref):
        if a is None or a.shape != b.shape or not torch.isfinite(a).all():  # reported, not raised: see them all
            out[name] = (float("inf"), float("inf"))
            print(name, "missing" if a is None else f"shape {tuple(a.shape)} vs {tuple(b.shape)}, "
                  f"{(~torch.isfinite(a)).sum().item()} non-finite")
            continue
        d, b = (a.double() - b.double()), b.double()
        out[name] = ((d.square().mean().sqrt() / b.square().mean().sqrt()).item(),
                     (d.abs().max() / b.abs().max()).item())
    return out


NAMES = ["out", "state", "q", "k", "v", "g", "beta", "initial_state"]
# fla-core's own chunk test (tests/ops/test_gated_delta.py, fp16 inputs): the relative RMSE of o and the final
# state < 0.005, of dq, dk, dv, dh0 < 0.008, of dbeta, dg < 0.02. fp32 inputs run Triton's dots in TF32 (a 10-bit
# mantissa, fp16's): the same bounds. bf16 keeps 7 bits: its unit roundoff is 8x fp16's, and so are the bounds.
FLA_RMS = dict(out=0.005, state=0.005, q=0.008, k=0.008, v=0.008, initial_state=0.008, g=0.02, beta=0.02)
FLA_SCALE = {"fp32": 1.0, "bf16": 8.0}


def _over_fla_bounds(errors, dtype: str) -> dict:
    """The tensors whose relative RMSE is over fla-core's bound for `dtype` (inf: non-finite or missing)."""
    return {n: r for n, (r, _) in errors.items() if not r < FLA_RMS[n] * FLA_SCALE[dtype]}


def _parity_tensors(group, device, dtype):
    """The GPU parity case: 300 steps (chunks of 64 and a partial one), dk = dv = 64, bf16 q, k, v, beta."""
    tensors = inputs(group=group, hk=2, length=300, dk=64, dv=64, device=device)
    return [t.bfloat16() if dtype == "bf16" and i in (0, 1, 2, 4) else t for i, t in enumerate(tensors)]


def _run(*t):
    return chunk_gated_delta_rule(*t[:5], initial_state=t[5])


@pytest.mark.parametrize("mutant", [dict(use_qk_l2norm_in_kernel=False), dict(scale=1.0), dict(initial_state=None)])
def test_fla_bounds_catch_a_wrong_call(mutant, install, monkeypatch):
    """The GPU parity test's bounds (bf16's, the loosest) on its own shapes still fail a wrong call: a call
    without the L2 norm, with another scale or without the initial state, through the stand-in on CPU."""
    tensors = _parity_tensors(2, "cpu", "fp32")
    install(_forcing(fla_chunk_gated_delta_rule, **mutant))
    got = _values_and_grads(_run, tensors)
    install()
    right = _values_and_grads(_run, tensors)
    monkeypatch.setattr(gdn, "USE_KERNEL", False)
    ref = _values_and_grads(_run, tensors)
    assert not _over_fla_bounds(_errors(right, ref, NAMES), "bf16")  # the right call is inside them
    assert _over_fla_bounds(_errors(got, ref, NAMES), "bf16")  # ratios 0.4 (no initial state) to 1e13


@pytest.mark.skipif(not _fla_on_cuda(), reason="needs CUDA and fla-core")
@pytest.mark.parametrize("group,dtype", [(1, "bf16"), (2, "bf16"), (2, "fp32")])
def test_fla_kernel_equals_pure_path_on_gpu(group, dtype, monkeypatch):
    """On the GPU, fla-core's Triton kernel equals the pure path on the same inputs: output, final state and
    the gradients of q, k, v, g, beta and the initial state, each within fla-core's own bound for it
    (`FLA_RMS`, relative RMSE as fla's tests measure it; the pure path computes in fp32). Every tensor's
    errors (and max|diff| / max|ref|) are printed and in the failure message."""
    if gdn.fla_backward_refused():  # fla raises in its backward here; the forward is held below
        pytest.skip(gdn.fla_backward_refused())
    tensors = _parity_tensors(group, "cuda", dtype)
    monkeypatch.setattr(gdn, "USE_KERNEL", True)
    got = _values_and_grads(_run, tensors)
    monkeypatch.setattr(gdn, "USE_KERNEL", False)
    ref = _values_and_grads(_run, tensors)
    errors = _errors(got, ref, NAMES)
    print({k: f"rms {r:.2e} max {m:.2e}" for k, (r, m) in errors.items()})
    assert not _over_fla_bounds(errors, dtype), errors


@pytest.mark.skipif(not _fla_on_cuda(), reason="needs CUDA and fla-core")
@pytest.mark.parametrize("group,dtype", [(1, "bf16"), (2, "fp32")])
def test_fla_forward_equals_pure_path_on_gpu(group, dtype, monkeypatch):
    """On the GPU without gradients (where fla may refuse its backward, it still runs the forward): fla's output
    and final state within fla-core's bounds of the pure path, fla's kernel called."""
    tensors = _parity_tensors(group, "cuda", dtype)
    kernel, calls = gdn.fla_kernel(), []
    monkeypatch.setattr(gdn, "fla_kernel", lambda: lambda *a, **k: calls.append(1) or kernel(*a, **k))
    monkeypatch.setattr(gdn, "USE_KERNEL", True)
    with torch.no_grad():
        got = _run(*tensors)
        monkeypatch.setattr(gdn, "USE_KERNEL", False)
        ref = _run(*tensors)
    errors = _errors(got, ref, NAMES[:2])
    print({k: f"rms {r:.2e} max {m:.2e}" for k, (r, m) in errors.items()})
    assert calls and not _over_fla_bounds(errors, dtype), errors
