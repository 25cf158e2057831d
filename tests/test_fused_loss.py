"""pipelines.training.fused_loss against the unfused pipelines.training.losses on materialised logits: values and gradients
(fp32 within 1e-6, bf16 and autocast within bf16 tolerances), every chunking, the vocab-parallel group
(2 gloo processes), FSDP2 over 2 dp ranks (the trainer's objective, gathered gradients within 1e-5 of
one process, measured <= 6e-7), and memory: nothing [N, V] is saved for backward and peak RSS stays far below it."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from remodel.pipelines.training import fused_loss
from remodel.pipelines.training.fused_loss import fused_kl_div, fused_lm_loss
from remodel.pipelines.training.losses import kl_div, lm_loss
from tests.rss import PEAK_RSS

ROOT = Path(__file__).resolve().parents[1]
N, H, HT, V = 67, 24, 40, 300  # N prime: no chunk size > 1 below N divides it


def rel(a, b) -> float:
    """Norm-relative difference of a against the reference b."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    w = (0.3 * torch.randn(V, H, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::7] = -100
    h_t = torch.randn(N, HT, generator=g).to(dtype)
    w_t = (0.3 * torch.randn(V, HT, generator=g)).to(dtype)
    return h, w, labels, h_t, w_t


def value_and_grads(loss, h, w):
    return (loss.detach(),) + torch.autograd.grad(loss, (h, w))


def assert_close(got, ref, tol):
    for name, a, b in zip(("loss", "grad_h", "grad_w"), got, ref):
        assert rel(a, b) <= tol, (name, rel(a, b))


@pytest.mark.parametrize("chunk", [1, 8, 16, N, 1000, None])
def test_ce_matches_unfused_fp32(chunk):
    h, w, labels, _, _ = inputs()
    ref = value_and_grads(lm_loss(h @ w.T, labels), h, w)
    got = value_and_grads(fused_lm_loss(h, w, labels, chunk=chunk), h, w)
    assert_close(got, ref, 1e-6)
    assert ref[0].item() > 1.0  # a real loss, not an empty mean


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("chunk", [5, 16, None])
def test_kl_matches_unfused_fp32(temperature, chunk):
    """Teacher of another hidden size (HT != H); frozen: only h_s and w_s get gradients."""
    h, w, _, h_t, w_t = inputs()
    ref = value_and_grads(kl_div(h @ w.T, h_t @ w_t.T, temperature), h, w)
    got = value_and_grads(fused_kl_div(h, w, h_t, w_t, temperature, chunk=chunk), h, w)
    assert_close(got, ref, 1e-6)
    assert ref[0].item() > 0.1


def test_kl_mask_and_grad_output_scaling():
    h, w, _, h_t, w_t = inputs()
    mask = torch.arange(N) % 3 != 0
    ref = value_and_grads(3.0 * kl_div(h @ w.T, h_t @ w_t.T, 1.5, mask=mask), h, w)
    got = value_and_grads(3.0 * fused_kl_div(h, w, h_t, w_t, 1.5, chunk=10, mask=mask), h, w)
    assert_close(got, ref, 1e-6)


@pytest.mark.parametrize("chunk", [16, None])
def test_vocabulary_blocks_match_unfused_fp32(chunk, monkeypatch):
    """The GPU's plan on CPU: blocks of the vocabulary (CHUNK_ELEMS small: 64 of the 300 rows per block) with one
    token chunk (grad_W rows written once per block) and with several (accumulated): CE and KL equal the
    unfused losses and gradients, as with the whole vocabulary in one block."""
    monkeypatch.setattr(fused_loss, "CHUNK_ELEMS", 71 * (chunk or N))
    plan = fused_loss._plan
    monkeypatch.setattr(fused_loss, "_plan", lambda *a, cuda=False, **k: plan(*a, cuda=True, **k))  # the GPU plan
    rows, vb = fused_loss._plan(chunk, N, V)
    assert vb < V and (rows < N) == (chunk is not None)
    h, w, labels, h_t, w_t = inputs()
    ref = value_and_grads(lm_loss(h @ w.T, labels), h, w)
    assert_close(value_and_grads(fused_lm_loss(h, w, labels, chunk=chunk), h, w), ref, 1e-6)
    ref = value_and_grads(kl_div(h @ w.T, h_t @ w_t.T, 2.0), h, w)
    assert_close(value_and_grads(fused_kl_div(h, w, h_t, w_t, 2.0, chunk=chunk), h, w), ref, 1e-6)


def test_compiled_blocks_match_unfused(monkeypatch):
    """The CUDA path's torch.compile'd block arithmetic (`_kernel`), forced on CPU with the GPU's plan
    (vocabulary blocks, one and several token chunks): CE and KL (T = 2) values and gradients equal the
    unfused losses in fp32 within 1e-6 and under bf16 autocast within 2e-2 (the matmuls' rounding), so the
    kernels the GPU runs compute the same thing as the eager ones CPU runs."""
    kernel = fused_loss._kernel
    monkeypatch.setattr(fused_loss, "_kernel", lambda fn, cuda: kernel(fn, True))
    monkeypatch.setattr(fused_loss, "_COMPILED", {})
    monkeypatch.setattr(fused_loss, "CHUNK_ELEMS", 71 * N)
    plan = fused_loss._plan
    monkeypatch.setattr(fused_loss, "_plan", lambda *a, cuda=False, **k: plan(*a, cuda=True, **k))
    h, w, labels, h_t, w_t = inputs()
    for chunk in (None, 16):
        for fp32 in (True, False):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not fp32):
                ref_ce = value_and_grads(lm_loss(h @ w.T, labels), h, w)
                ref_kl = value_and_grads(kl_div(h @ w.T, h_t @ w_t.T, 2.0), h, w)
                got_ce = value_and_grads(fused_lm_loss(h, w, labels, chunk=chunk), h, w)
                got_kl = value_and_grads(fused_kl_div(h, w, h_t, w_t, 2.0, chunk=chunk), h, w)
            assert_close(got_ce, ref_ce, 1e-6 if fp32 else 2e-2)
            assert_close(got_kl, ref_kl, 1e-6 if fp32 else 2e-2)
    assert set(fused_loss._COMPILED) == {fused_loss._block_stats, fused_loss._softmax_grad, fused_loss._kl_block}


def test_compiler_failure_falls_back_to_eager_once(monkeypatch):
    """Where torch.compile cannot build its kernels (a GPU machine without Triton or a C compiler), the fused
    losses warn once and run their block arithmetic eager: values and gradients still equal the unfused ones."""
    calls = []

    def failing(fn, **kw):
        def run(*args):
            calls.append(fn.__name__)
            raise torch._dynamo.exc.BackendCompilerFailed(lambda *a: None, RuntimeError("no C compiler"), None)
        return run
    kernel = fused_loss._kernel
    monkeypatch.setattr(fused_loss, "_kernel", lambda fn, cuda: kernel(fn, True))
    monkeypatch.setattr(fused_loss, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", failing)
    h, w, labels, h_t, w_t = inputs()
    with pytest.warns(UserWarning, match="torch.compile failed") as seen:
        got_ce = value_and_grads(fused_lm_loss(h, w, labels, chunk=16), h, w)
        got_kl = value_and_grads(fused_kl_div(h, w, h_t, w_t, 2.0, chunk=16), h, w)
    assert sorted(calls) == ["_block_stats", "_kl_block", "_softmax_grad"] and len(seen) == 3  # once each
    assert_close(got_ce, value_and_grads(lm_loss(h @ w.T, labels), h, w), 1e-6)
    assert_close(got_kl, value_and_grads(kl_div(h @ w.T, h_t @ w_t.T, 2.0), h, w), 1e-6)


@pytest.mark.parametrize("N,V,chunk,blocks", [(8190, 131072, None, 1), (8190, 131072, None, 2), (4096, 32768, 128, 1),
                                               (67, 300, None, 1), (100, 1000, 50, 2)])
def test_vocabulary_blocks_are_aligned(N, V, chunk, blocks):
    """A block narrower than the vocabulary is a multiple of 64 rows (8190 tokens of a 131072 vocabulary had
    given 4097-row blocks: odd leading dimensions, cuBLAS's align-1 kernels on the GPU, the step 1.7x slower),
    and still holds about CHUNK_ELEMS elements at most."""
    rows, vb = fused_loss._plan(chunk, N, V, blocks)
    assert vb == V or (vb % 64 == 0 and blocks * rows * vb <= max(fused_loss.CHUNK_ELEMS, blocks * rows * 64))


def test_ce_ignore_rows_get_zero_grad_and_no_grad_mode():
    h, w, labels, _, _ = inputs()
    gh = torch.autograd.grad(fused_lm_loss(h, w, labels, chunk=9), h)[0]
    assert gh[labels == -100].abs().max().item() == 0.0
    assert gh[labels != -100].abs().max().item() > 0.0
    with torch.no_grad():
        loss = fused_lm_loss(h, w, labels, chunk=9)
    assert not loss.requires_grad and abs(loss.item() - lm_loss(h @ w.T, labels).item()) < 1e-5


def test_bf16_inputs():
    """bf16 h and W: against the unfused bf16 path (bf16 logits) and against fp32 within bf16 tolerances."""
    h, w, labels, h_t, w_t = inputs(torch.bfloat16)
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    for fused, unfused in [
        (lambda a, b: fused_lm_loss(a, b, labels, chunk=16), lambda a, b: lm_loss(a @ b.T, labels)),
        (lambda a, b: fused_kl_div(a, b, h_t, w_t, 2.0, chunk=16), lambda a, b: kl_div(a @ b.T, h_t @ w_t.T, 2.0)),
    ]:
        got = value_and_grads(fused(h, w), h, w)
        assert got[1].dtype == got[2].dtype == torch.bfloat16
        assert_close(got, value_and_grads(unfused(h, w), h, w), 2e-2)
        assert_close(got, value_and_grads(unfused(h32, w32), h32, w32), 2e-2)


def test_autocast_fp32_master_weights():
    """fp32 h and W under CPU bf16 autocast (the trainer's setting): matmuls in bf16 like F.linear, fp32 grads."""
    h, w, labels, h_t, w_t = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = value_and_grads(fused_lm_loss(h, w, labels, chunk=16), h, w)
        ref = value_and_grads(lm_loss(torch.nn.functional.linear(h, w), labels), h, w)
        got_kl = value_and_grads(fused_kl_div(h, w, h_t, w_t, chunk=16), h, w)
        ref_kl = value_and_grads(kl_div(torch.nn.functional.linear(h, w), torch.nn.functional.linear(h_t, w_t)), h, w)
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.float32
    assert_close(got, ref, 2e-2)
    assert_close(got_kl, ref_kl, 2e-2)
    assert rel(got[0], lm_loss(h.detach() @ w.detach().T, labels)) < 2e-2


def largest_saved(fn) -> int:
    """Elements of the largest tensor autograd saves for backward while fn() runs its forward."""
    sizes = [0]

    def pack(t):
        sizes.append(t.numel())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return max(sizes)


def test_nothing_n_by_v_saved_for_backward():
    h, w, labels, h_t, w_t = inputs()
    assert largest_saved(lambda: lm_loss(h @ w.T, labels)) >= N * V  # the check sees unfused logits
    assert largest_saved(lambda: fused_lm_loss(h, w, labels, chunk=16)) <= V * H
    assert largest_saved(lambda: fused_kl_div(h, w, h_t, w_t, chunk=16)) <= V * H


MEMORY_SCRIPT = PEAK_RSS + textwrap.dedent('''
    import json, sys, torch
    from remodel.pipelines.training.fused_loss import fused_kl_div, fused_lm_loss
    from remodel.pipelines.training.losses import lm_loss
    torch.manual_seed(0)
    N, H, V = 4096, 32, 32768
    h = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    labels = torch.randint(0, V, (N,))
    h_t, w_t = torch.randn(N, 48), torch.randn(V, 48)
    chunk = int(sys.argv[1])
    runs = {"fused_ce": lambda n: fused_lm_loss(h[:n], w, labels[:n], chunk=chunk),
            "fused_kl": lambda n: fused_kl_div(h[:n], w, h_t[:n], w_t, chunk=chunk),
            "unfused_ce": lambda n: lm_loss(h[:n] @ w.T, labels[:n])}
    for name in runs:  # warm-up on 8 rows: one-time allocations (BLAS buffers, lazy init) out of the count
        runs[name](8).backward()
    out = {}
    for name in sys.argv[2:]:
        base = reset_peak()
        runs[name](N).backward()
        out[name] = status("VmHWM") - base
        h.grad = w.grad = None
    print(json.dumps(out))
''')


def test_peak_memory_far_below_logits(tmp_path):
    """N=4096, V=32768: the [N, V] fp32 logits are 512 MB. Fused CE and KL forward+backward in chunks of
    128 rows (16 MB blocks) grow the peak RSS by under 1/16 (CE, measured ~21 MB) and 1/6 (KL, ~60 MB)
    of that; the unfused CE (same process, control) by more than all of it (~1.6 GB)."""
    script = tmp_path / "mem.py"
    script.write_text(MEMORY_SCRIPT)
    # fixed mmap threshold: freed blocks go back to the OS, so the peak RSS counts live memory only
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2", "MALLOC_MMAP_THRESHOLD_": "65536"}
    res = subprocess.run([sys.executable, str(script), "128", "fused_ce", "fused_kl", "unfused_ce"], env=env,
                         check=True, capture_output=True, text=True, timeout=120)
    grow = json.loads(res.stdout.strip().splitlines()[-1])
    logits = 4096 * 32768 * 4
    assert grow["fused_ce"] < logits / 16, grow
    assert grow["fused_kl"] < logits / 6, grow
    assert grow["unfused_ce"] > logits, grow


def _tp_worker(rank, world, init_file, out_dir):
    """One rank of a vocab-parallel group: W and the teacher W sharded by rows (teacher also full)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    h, w, labels, h_t, w_t = inputs()
    Vl = V // world
    ws = w.detach()[rank * Vl:(rank + 1) * Vl].clone().requires_grad_()
    g = dist.group.WORLD
    res = {}
    for name, fn in [("ce", lambda: fused_lm_loss(h, ws, labels, chunk=16, group=g)),
                     ("kl_shard", lambda: fused_kl_div(h, ws, h_t, w_t[rank * Vl:(rank + 1) * Vl], 2.0, chunk=16, group=g)),
                     ("kl_full_teacher", lambda: fused_kl_div(h, ws, h_t, w_t, 2.0, chunk=16, group=g))]:
        loss, gh, gw = value_and_grads(fn(), h, ws)
        res[name] = [loss.item(), gh.tolist(), gw.tolist()]
    (Path(out_dir) / f"{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def test_vocab_parallel_group_matches_single_process(tmp_path):
    """2 gloo ranks, V split in halves: every rank's loss and grad_h equal the unsharded ones, its grad_W
    equals its rows of the unsharded grad_W."""
    import torch.multiprocessing as mp
    world = 2
    mp.spawn(_tp_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    h, w, labels, h_t, w_t = inputs()
    refs = {"ce": value_and_grads(lm_loss(h @ w.T, labels), h, w),
            "kl_shard": value_and_grads(kl_div(h @ w.T, h_t @ w_t.T, 2.0), h, w)}
    refs["kl_full_teacher"] = refs["kl_shard"]
    Vl = V // world
    for rank in range(world):
        res = json.loads((tmp_path / f"{rank}.json").read_text())
        for name, (loss, gh, gw) in res.items():
            ref = refs[name]
            got = (torch.tensor(loss), torch.tensor(gh), torch.tensor(gw))
            assert_close(got, (ref[0], ref[1], ref[2][rank * Vl:(rank + 1) * Vl]), 1e-6)


def _tiny_lm(H: int, tied: bool, seed: int):
    from remodel.models.config import ModelConfig
    from remodel.models.model import HybridLM, init_weights
    cfg = ModelConfig(vocab_size=256, hidden_size=H, pattern="M*-", tie_word_embeddings=tied, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=2 * H, mamba_num_heads=4, mamba_head_dim=8,
                      n_groups=2, ssm_state_size=8, chunk_size=16)
    return init_weights(HybridLM(cfg), seed=seed)


def _tiny_teacher():
    """Tied and confident (logits std ~9): its KL (~0.9) weighs on the gradients as much as the CE does."""
    teacher = _tiny_lm(40, True, 1).requires_grad_(False)
    with torch.no_grad():
        teacher.embeddings.weight.mul_(1000.0)
    return teacher


FSDP_W = dict(kl=1.0, lm=0.3, hidden=0.0, lb=0.0, z=0.0, temperature=2.0, topk=0, fused=True)
FSDP_IDS = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(0))


def _fsdp_worker(rank, world, init_file, out_dir):
    """One of 2 dp ranks: student (tied or not) and tied teacher under FSDP2, each rank its half of the
    batch, two forward/backward passes; rank 0 saves the losses and the gathered gradients."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from remodel.pipelines.training.objective import compute_losses
    from remodel.pipelines.distributed.parallel import full_grads, parallelize
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    teacher = parallelize(_tiny_teacher(), mesh, tp_dim=None, dp_dim="dp")
    res = {}
    for tied in (False, True):
        student = parallelize(_tiny_lm(32, tied, 0), mesh, tp_dim=None, dp_dim="dp")
        rows = FSDP_IDS[rank * 4 // world:(rank + 1) * 4 // world]
        losses = []
        for _ in range(2):  # the second pass gathers the root again after the first backward resharded it
            loss, _ = compute_losses(student, teacher, rows, FSDP_W)
            loss.backward()
            losses.append(loss.detach())
        assert isinstance(student.embeddings.weight.grad, DTensor)  # resharded, gradient reduce-scattered
        mean = torch.stack(losses)
        dist.all_reduce(mean)
        res[tied] = (mean / world, full_grads(student))
    if rank == 0:
        torch.save(res, Path(out_dir) / "fsdp.pt")
    dist.barrier()  # both ranks leave together: a rank tearing gloo down while its peer still works can abort
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_fsdp_data_parallel_grads_match_single_process(tmp_path):
    """Fused CE + KL under FSDP2 over 2 dp ranks (the student called through its forward, so the root
    gathers embeddings / lm_head and reduce-scatters their gradient): the dp-mean losses and the gathered
    gradients equal one process on the whole batch, untied and tied (lm_head = embeddings) student."""
    import torch.multiprocessing as mp

    from remodel.pipelines.training.objective import compute_losses
    mp.spawn(_fsdp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "fsdp.pt")
    teacher = _tiny_teacher()
    for tied in (False, True):
        student = _tiny_lm(32, tied, 0)
        loss, parts = compute_losses(student, teacher, FSDP_IDS, FSDP_W)
        assert parts["kl"] > 0.5
        loss.backward()
        losses, grads = got[tied]
        assert torch.allclose(losses, loss.detach().expand(2), rtol=1e-6), (losses, loss)
        ref = {n: 2 * p.grad for n, p in student.named_parameters()}  # two passes accumulated
        assert grads.keys() == ref.keys()
        err = {n: ((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in ref.items()}
        worst = max(err, key=err.get)
        print(f"fsdp dp 2, tied={tied}: loss rel {rel(losses[0], loss):.1e}, grads rel {err[worst]:.1e} ({worst})")
        assert err[worst] <= 1e-5, worst


@pytest.fixture
def fake_liger(monkeypatch):
    """A stand-in for liger-kernel's fused linear CE (the unfused loss, each call's arguments recorded), as
    fused_loss imports it, with the CUDA branch forced on CPU tensors. -> the call log."""
    import types
    calls = []

    def liger_ce(h, w, labels, ignore_index=-100):
        calls.append((h, w, labels, ignore_index))
        return lm_loss(h @ w.T, labels)
    mod = types.ModuleType(fused_loss.LIGER_CE[0])
    setattr(mod, fused_loss.LIGER_CE[1], liger_ce)
    monkeypatch.setitem(sys.modules, fused_loss.LIGER_CE[0], mod)
    monkeypatch.setattr(fused_loss, "_on_gpu", lambda h: True)
    monkeypatch.setattr(fused_loss, "LIGER", True)  # off by default (slower inside the H200 step)
    fused_loss.liger_ce.cache_clear()
    yield calls
    fused_loss.liger_ce.cache_clear()


def test_cuda_ce_is_liger_where_the_vocabulary_is_whole(fake_liger, monkeypatch):
    """On CUDA with the whole vocabulary on the rank, the CE is liger's fused linear CE, called once with the
    hidden states, weight, labels and ignore index as given and its result returned; with LIGER off, off
    CUDA, the vocabulary split over a group (liger has no vocab-parallel form) or no gradient wanted it is ours."""
    h, w, labels, _, _ = inputs()
    got = fused_lm_loss(h, w, labels, chunk=16)
    [(a, b, c, ignore)] = fake_liger
    assert a is h and b is w and c is labels and ignore == -100
    want = value_and_grads(lm_loss(h @ w.T, labels), h, w)
    assert_close(value_and_grads(got, h, w), want, 1e-6)
    monkeypatch.setattr(fused_loss, "LIGER", False)
    assert_close(value_and_grads(fused_lm_loss(h, w, labels, chunk=16), h, w), want, 1e-5)
    monkeypatch.setattr(fused_loss, "LIGER", True)
    monkeypatch.setattr(fused_loss, "group_size", lambda g: 2)
    assert fused_loss._liger_ce(h, object()) is None and len(fake_liger) == 1
    monkeypatch.setattr(fused_loss, "group_size", lambda g: 1)
    with torch.no_grad():  # a loss only logged (distillation's CE): liger would compute gradients in its forward
        assert_close((fused_lm_loss(h, w, labels, chunk=16),), (want[0],), 1e-5)
    monkeypatch.setattr(fused_loss, "_on_gpu", lambda h: h.is_cuda)
    fused_lm_loss(h, w, labels, chunk=16)
    assert len(fake_liger) == 1
