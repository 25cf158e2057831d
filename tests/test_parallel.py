"""Tensor / expert / data parallelism (pipelines.distributed.parallel, pipelines.training.vocab_parallel) against the
single-process model: real gloo runs under torchrun (tests/dist_worker.py, one launch per world size)
and one-process 'fake' process-group checks of the sharding plans at world size 8.

Tolerances: losses, gradient norms and first-step gradients must agree to 1e-5 (measured <= 3e-6).
Final weights after 3 AdamW steps are held to Frobenius 1e-4 / elementwise 1e-3 of each tensor's max:
Adam's update g / (|g| + eps) turns a 1e-10 summation-order difference in a gradient near eps=1e-8
into a ~1e-6 weight difference, which plain single-process gradient accumulation shows as well
(measured 2.7e-5 elementwise); a real sharding bug moves weights by ~lr = 3e-3 (4e-2 relative).
"""
import copy
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.model import HybridLM, init_weights

from torch.distributed.tensor import DTensor

from remodel.pipelines.distributed.parallel import local_tensor, parallel_info, parallelize, sharded_dims, unshard_tensor
from remodel.pipelines.distributed.styles import shard_tensor

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")
TRAIN_CASES = {2: ["tp", "tp_llama", "tp_qk_norm_full", "ep_dp", "ep_dp_gpt_oss", "tp_ep"], 4: ["tp", "dp_tp", "dp_tp_ep_dp", "dp_tp_ep_tp"]}
EXPECT = {  # (tp, ep, dp) per case and world size
    (2, "tp"): (2, 1, 1), (2, "tp_llama"): (2, 1, 1), (2, "tp_qk_norm_full"): (2, 1, 1), (2, "ep_dp"): (1, 2, 2), (2, "ep_dp_gpt_oss"): (1, 2, 2), (2, "tp_ep"): (2, 2, 1),
    (4, "tp"): (4, 1, 1), (4, "dp_tp"): (2, 1, 2), (4, "dp_tp_ep_dp"): (2, 2, 2), (4, "dp_tp_ep_tp"): (2, 2, 2),
}


def launch(n, cases, env=None, timeout=240):
    """-> (returncode, {case: result}, seconds, end time, log tail)"""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", WORKER, *cases]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    end = time.time()
    results = {}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            results[r["case"]] = r
    print(f"\ntorchrun x{n} {cases}: {end - t0:.1f} s, rc {p.returncode}")
    return p.returncode, results, end - t0, end, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch per world size; the rank-failure launches (mostly waiting) run beside them."""
    d = tmp_path_factory.mktemp("die")
    with ThreadPoolExecutor(2) as ex:
        failing = {c: (str(d / c), ex.submit(launch, 2, [c], {"DIE_FILE": str(d / c), "DIST_TIMEOUT": "10"}, 180))
                   for c in ("die", "hang")}
        out = {}
        for n in (2, 4):
            cases = (["vocab"] if n == 2 else []) + TRAIN_CASES[n]
            rc, results, seconds, end, log = launch(n, cases)
            assert rc == 0, log
            out[n] = results
        out["failing"] = {c: (f, fut.result()) for c, (f, fut) in failing.items()}
    return out


@pytest.mark.parametrize("n,case", [(n, c) for n in (2, 4) for c in TRAIN_CASES[n]])
def test_training_matches_single_process(runs, n, case):
    r = runs[n][case]
    print({k: v for k, v in r.items() if k not in ("losses", "ref_losses", "ref_norms")})
    assert (r["tp"], r["ep"], r["dp"]) == EXPECT[(n, case)]
    assert r["loss_rel"] <= 1e-5 and r["norm_rel"] <= 1e-5, r
    assert r["grad_rel"] <= 1e-5, r  # every tensor's full gradient after the first backward
    assert r["clipped"] == 3  # gradient clipping was active at every step (global norm over shards)
    assert r["moved"] > 1e-2  # the weights really moved
    assert r["weight_fro"] <= 1e-4 and r["weight_rel"] <= 1e-3, r
    assert r["logits_rel"] <= 1e-4, r  # the gathered single-process HybridLM (strict load) runs like the reference


def test_all_heads_qk_norm_under_tp(runs):
    """q/k norms over all heads (qk_norm_full, OLMo 2 / OLMo-hybrid) under tp 2: each rank holds its heads'
    slice of the norm weights; the parallel forward's logits and the norm weights' gathered gradients equal
    one process's (the training itself: test_training_matches_single_process)."""
    r = runs[2]["tp_qk_norm_full"]
    names = [f"layers.{i}.mixer.{x}_norm.weight" for i in (0, 2) for x in "qk"]  # post-norm 'A' and pre-norm '*'
    assert r["norm_shards"] == {n: [4 * 8 // 2 if "q_norm" in n else 2 * 8 // 2] for n in names}
    assert r["fwd_rel"] <= 1e-5, r
    assert set(r["norm_grads"]) == set(names) and max(r["norm_grads"].values()) <= 1e-5, r


def test_vocab_parallel_losses(runs):
    r = runs[2]["vocab"]
    print(r)
    for k in ("ce_value", "ce_grad", "kl_value", "kl_grad", "worst"):
        assert r[k] <= 1e-6, r


@pytest.mark.parametrize("case", ["die", "hang"])
def test_dead_or_stalled_rank_does_not_hang(runs, case):
    """Rank 1 exits (or stalls) between forward and backward; the job must fail well within 60 s."""
    path, (rc, results, seconds, end, log) = runs["failing"][case]
    assert os.path.exists(path), log  # rank 1 reached the middle of step 2
    after = end - float(open(path).read())
    print(f"{case}: rc {rc}, launch {seconds:.1f} s, failed {after:.1f} s after rank 1 stopped")
    assert rc != 0 and not results, log
    assert after < 60


# ---- one process, 'fake' process group (collectives are no-ops) ---------------------------------

def cfg8(**kw):
    base = dict(vocab_size=64, hidden_size=32, pattern="M*-E", num_attention_heads=16, num_key_value_heads=8,
                head_dim=4, intermediate_size=48, mamba_num_heads=16, mamba_head_dim=4, n_groups=8, ssm_state_size=4,
                chunk_size=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                moe_shared_expert_intermediate_size=16)
    return ModelConfig(**{**base, **kw})


@contextmanager
def fake_world(rank, world):
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_indivisible_groups_one_line_error():
    model = HybridLM(cfg8(n_groups=2, mamba_num_heads=8))
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    with fake_world(1, 8):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        with pytest.raises(RemodelError) as e:
            parallelize(model, mesh, tp_dim="tp", dp_dim="dp")
    msg = str(e.value)
    assert "\n" not in msg and "n_groups=2" in msg and "tp=4" in msg
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes  # nothing was changed


def test_sharding_plan_world8():
    """tp 8 with ep folded over tp: local shapes, the interleaved Mamba in_proj rows, and row-parallel
    partial outputs of every rank's Mamba / attention / MLP summing to the full layer's output."""
    cfg = cfg8()
    full = init_weights(HybridLM(cfg), seed=0)
    u = torch.randn(2, 12, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    want = [layer.mixer(u) for layer in full.layers[:3]]
    got = [0, 0, 0]
    Im, GN, nh = cfg.mamba_inner, cfg.mamba.n_groups * cfg.mamba.d_state, cfg.mamba.mamba_num_heads
    for r in range(8):
        model = copy.deepcopy(full)
        with fake_world(r, 8):
            from torch.distributed.device_mesh import init_device_mesh
            parallelize(model, init_device_mesh("cpu", (8,), mesh_dim_names=("tp",)), ep_dim="tp")
            info = parallel_info(model)
            with torch.no_grad():
                for i in range(3):
                    got[i] = got[i] + model.layers[i].mixer(u)
        fsd, local = full.state_dict(), model.state_dict()
        assert set(local) == set(fsd)
        for name, t in local.items():  # the plain shards' specs, the stock styles' DTensor placements
            shape = list(fsd[name].shape)
            for d in [info.specs[name][1]] if name in info.specs else [d for _, d in sharded_dims(t)]:
                shape[d] //= 8
            assert list(local_tensor(t).shape) == shape, name
        assert isinstance(model.layers[1].mixer.q_proj.weight, DTensor)  # stock ColwiseParallel
        # group r's heads: rows z, x (heads of group r), B, C (group r), dt (heads of group r)
        hd, N = Im // 8, GN // 8
        rows = torch.cat([torch.arange(r * hd, (r + 1) * hd), Im + torch.arange(r * hd, (r + 1) * hd),
                          2 * Im + torch.arange(r * N, (r + 1) * N), 2 * Im + GN + torch.arange(r * N, (r + 1) * N),
                          2 * Im + 2 * GN + torch.arange(r * nh // 8, (r + 1) * nh // 8)])
        assert torch.equal(local["layers.0.mixer.in_proj.weight"], fsd["layers.0.mixer.in_proj.weight"][rows])
        # the mixers read one group / one KV head from their shards' shapes; their config is the full one
        assert model.layers[0].mixer._local()[0].mamba.n_groups == 1 and model.layers[0].mixer.norm.groups == 1
        assert local_tensor(model.layers[1].mixer.k_proj.weight).shape[0] == cfg.attention.head_dim
        assert all(layer.mixer.cfg.config == cfg for layer in model.layers if hasattr(layer.mixer, "cfg"))  # a KindView
        assert local["layers.3.mixer.experts.up_proj"].shape[0] == 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_shard_unshard_roundtrip():
    t = torch.arange(2 * 30).view(30, 2)
    sizes = [8, 8, 4, 4, 6]
    parts = [shard_tensor(t, 0, sizes, r, 2) for r in range(2)]
    assert torch.equal(parts[1][:4], t[4:8]) and torch.equal(parts[1][-3:], t[27:30])
    assert torch.equal(unshard_tensor(parts, 0, sizes), t)


def _plans(cfg):
    """Every layer's styles under cfg (built, not applied: no process group needed)."""
    from remodel.pipelines.distributed.styles import layer_plan
    model = HybridLM(cfg)
    return [layer_plan(cfg, layer.spec, layer.mixer, f"layers.{i}.mixer.", {}) for i, layer in enumerate(model.layers)]


def test_every_kind_plan_covers_the_layout_table():
    """Each kind's tp_plan names a style for every parameter the layout table splits, and the stock styles'
    fixed dims agree with the table, for every tiny config (Mamba, attention with biases and qk-norm, MLP,
    MoE with shared expert and latent, Falcon-H1's parallel mixer, OLMo-hybrid's q/k norms over all heads)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from tests.conftest import FAMILY_CONFIGS, KIND_CONFIGS, tiny_configs
    seen = set()
    for cfg in [*KIND_CONFIGS.values(), *FAMILY_CONFIGS.values(), *tiny_configs().values()]:
        for plan in _plans(cfg):
            seen |= {type(s).__name__ for s in plan.values()}
            assert all(isinstance(s, ColwiseParallel) for p, s in plan.items() if p.endswith(("q_proj", "up_proj")))
            assert all(isinstance(s, RowwiseParallel) for p, s in plan.items() if p.endswith(("o_proj", "out_proj")))
    assert {"ColwiseParallel", "RowwiseParallel", "SegmentShard", "SharedNorm", "ShardedNorm"} <= seen


def test_a_plan_that_disagrees_with_the_layout_table_is_refused(monkeypatch):
    from remodel.models.attention import ATTENTION
    cfg = ModelConfig(vocab_size=64, hidden_size=32, pattern="*-", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, intermediate_size=48)
    monkeypatch.setitem(ATTENTION.tp_plan, "o_proj", "colwise")  # the table splits o_proj's input dim
    with pytest.raises(RemodelError, match="colwise plan of 'attention.o_proj' disagrees with the layout table"):
        _plans(cfg)
    monkeypatch.setitem(ATTENTION.tp_plan, "o_proj", "shared_norm")  # a split norm weight is cut along dim 0
    with pytest.raises(RemodelError, match="shared_norm plan of 'attention.o_proj' disagrees with the layout table"):
        _plans(cfg)
    monkeypatch.delitem(ATTENTION.tp_plan, "o_proj")
    with pytest.raises(RemodelError, match=r"parameters under \['o_proj'\] are split by the layout table"):
        _plans(cfg)


def test_fp8_linears_get_torchao_float8_tp_styles():
    """After the FP8 swap (pipelines.training.fp8, whose Linears are a Float8Linear subclass), the tensor-
    parallel plan gives the FP8 Linears torchao's Float8 styles and the bf16 ones the stock styles."""
    pytest.importorskip("torchao")
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel
    from remodel.pipelines.distributed.styles import layer_plan
    from remodel.pipelines.training.fp8 import convert
    cfg = ModelConfig(vocab_size=64, hidden_size=32, pattern="*-*-*-", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, intermediate_size=48)
    model = HybridLM(cfg)
    fp8 = set(convert(model))
    plans = {f"layers.{i}.mixer.{p}": s for i, layer in enumerate(model.layers)
             for p, s in layer_plan(cfg, layer.spec, layer.mixer, f"layers.{i}.mixer.", {}).items()}
    assert "layers.2.mixer.q_proj" in fp8 and "layers.0.mixer.q_proj" not in fp8 and fp8 & set(plans)
    for name, style in plans.items():
        float8 = isinstance(style, (Float8ColwiseParallel, Float8RowwiseParallel))
        assert float8 == (name in fp8), name


@pytest.mark.parametrize("max_norm", [0.05, 1e9])
def test_clip_equals_torch_in_one_process(max_norm):
    """clip_grad_norm_ on a whole (unsharded) model equals torch.nn.utils.clip_grad_norm_: the norm and every
    clipped gradient (1e-6); a bound above the norm leaves the gradients as they were."""
    import copy
    from remodel.pipelines.distributed.parallel import clip_grad_norm_
    cfg = ModelConfig(vocab_size=64, hidden_size=32, pattern="M*-", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8,
                      chunk_size=8)
    model = init_weights(HybridLM(cfg), seed=0)
    (1e4 * model(torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))).square().mean()).backward()
    ref = copy.deepcopy(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        q.grad = p.grad.clone()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    got, want = clip_grad_norm_(model, max_norm), torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    assert abs(got.item() - want.item()) <= 1e-6 * want.item() and want.item() > 0.05
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-6 * max(1e-3, q.grad.abs().max().item()), n
    assert (max_norm > 1) == all(torch.equal(before[n], p.grad) for n, p in model.named_parameters())
