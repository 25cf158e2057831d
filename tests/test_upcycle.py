"""Dense -> MoE upcycling with virtual groups: exactness in our model and in transformers, configs,
reported deviation, --exact refusals."""
import json
import math
import shutil

import pytest
import torch

from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.load import load_model, save_model
from remodel.models.moe import Router
from remodel.models.model import HybridLM, init_weights
from remodel.pipelines.commands import upcycle as pipeline
from remodel.pipelines.commands.upcycle import upcycle
from remodel.upcycle.virtual_groups import make_plan, router_weight, upcycle_mlp, upcycle_model

NEMO = dict(vocab_size=64, hidden_size=32, pattern="M*-M-", num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, intermediate_size=64, mamba_num_heads=8, mamba_head_dim=4, n_groups=2, ssm_state_size=8,
            chunk_size=16)
LLAMA = dict(vocab_size=64, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, rope_theta=10000.0, intermediate_size=64, mlp_act="silu", mlp_gated=True)
TOL = 1e-4


def _model(**kw):
    # std 0.2: logits O(1) and the MLPs move them by O(1), so a 1e-4 tolerance means something
    return init_weights(HybridLM(ModelConfig(**kw)), std=0.2, seed=0).eval()


def _ids(n=4, length=32, seed=1):
    return torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _hf_logits(path, ids):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits


@pytest.fixture(scope="module")
def nemo(tmp_path_factory):
    m = _model(**NEMO)
    d = tmp_path_factory.mktemp("nemo") / "dense"
    save_model(m, d)
    return m, d, _hf_logits(d, _ids())


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    m = _model(**LLAMA)
    d = tmp_path_factory.mktemp("llama") / "dense"
    save_model(m, d, family="llama")
    return m, d, _hf_logits(d, _ids())


def _selections(model, ids):
    """(idx [T, k]) chosen by every MoE router during a forward."""
    got = []
    hooks = [moe.gate.register_forward_hook(lambda mod, i, o: got.append(o[2])) for moe in model.moe_layers()]
    with torch.no_grad():
        out = model(ids)
    for h in hooks:
        h.remove()
    return out, got


def _whole_groups(idx, G):
    """Every chosen group appears exactly G times, every shard T/G times."""
    T = idx.shape[1]
    groups = torch.nn.functional.one_hot(idx // G, idx.max().item() // G + 1).sum(1)
    shards = torch.nn.functional.one_hot(idx % G, G).sum(1)
    return bool(((groups == 0) | (groups == G)).all() and (shards == T // G).all())


@pytest.mark.parametrize("router", ["topk-softmax", "sigmoid"])
def test_relu2_virtual_groups_exact_in_our_model(nemo, router):
    dense, _, _ = nemo
    ids = _ids()
    with torch.no_grad():
        ref = dense(ids)
    for G in (1, 2, 4, 8):
        for S in (0, 32):
            moe, p = upcycle_model(dense, make_plan(dense.cfg, experts=4 * G, granularity=G, top_k=2 * G, shared=S,
                                                    router=router))
            out, sel = _selections(moe, ids)
            assert p.exact and math.isclose(p.s ** 3, G, rel_tol=1e-12)
            assert (out - ref).abs().max().item() < TOL, (G, S)
            assert moe.cfg.pattern == "M*EME" and moe.cfg.moe.moe_intermediate_size == (64 - S) // G
            for idx in sel:  # whole groups, and the routing really varies across tokens
                assert _whole_groups(idx, G)
                assert len({tuple(sorted(set((r // G).tolist()))) for r in idx}) > 1


def test_inexact_settings_deviate(nemo):
    """Controls: the scaling, the grouping and the router mode each matter (the tests above can fail)."""
    dense, _, _ = nemo
    ids = _ids()
    with torch.no_grad():
        ref = dense(ids)
        moe, _ = upcycle_model(dense, make_plan(dense.cfg, experts=16, granularity=4, top_k=8, router="sigmoid"))
        for m in moe.moe_layers():  # undo the s^3 = G scaling
            m.experts.up_proj.div_(4 ** (1 / 3))
            m.experts.down_proj.div_(4 ** (1 / 3))
        assert (moe(ids) - ref).abs().max().item() > 1e-2
        moe, p = upcycle_model(dense, make_plan(dense.cfg, 16, 4, 6, router="sigmoid"))  # 4 does not divide 6
        assert not p.exact and (moe(ids) - ref).abs().max().item() > 1e-2
        moe, p = upcycle_model(dense, make_plan(dense.cfg, experts=16, granularity=4, top_k=8, router="softmax-topk"))
        assert not p.exact and p.a == 4 * 16 / 8 and (moe(ids) - ref).abs().max().item() > 1e-3


@pytest.mark.parametrize("G", [1, 2, 4, 8])
def test_nemotron_export_exact_in_transformers(nemo, tmp_path, G):
    dense, src, hf_ref = nemo
    for S in (0, 32):
        out = tmp_path / f"moe{S}"
        rep = upcycle(src, out, experts=4 * G, granularity=G, top_k=2 * G, shared_expert_size=S, seed=3,
                      router="sigmoid")  # the pre-issue-59 default, explicit
        got = _hf_logits(out, _ids())
        assert (got - hf_ref).abs().max().item() < TOL, (G, S)
        assert rep["router"]["mode"] == "sigmoid" and rep["exact_expected"]
        assert rep["deviation"]["max_abs_logit_diff"] < TOL and rep["scaling"]["a"] == G
        c = json.loads((out / "config.json").read_text())
        assert c["model_type"] == "nemotron_h" and "auto_map" not in c
        assert c["layers_block_type"] == ["linear_attention", "full_attention", "moe", "linear_attention", "moe"]
        assert (c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]) == (4 * G, 2 * G, (64 - S) // G)
        assert c["moe_shared_expert_intermediate_size"] == (S or 1)  # 0 is written as a zero size-1 expert
        assert c["norm_topk_prob"] is True and c["routed_scaling_factor"] == 1.0 and c["n_group"] == 1
        assert json.loads((out / "remodel_report.json").read_text())["experts"] == 4 * G


def _group_router_grads(moe, G: int, ids) -> list[tuple[float, float]]:
    """Per MoE layer: (|LM-loss gradient summed over each virtual group's router rows|, |row gradients|)."""
    moe.zero_grad()
    logits = moe(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    out = []
    for m in moe.moe_layers():
        g = m.gate.weight.grad
        out.append((g.view(-1, G, g.shape[-1]).sum(1).norm().item(), g.norm().item()))
    return out


def test_sigmoid_raw_router_learns_which_group(nemo):
    """Why sigmoid-raw exists (issue 29): with top-k = G a renormalising router picks one whole group and
    normalises its members' weights to 1/G, so the LM loss gives the group's rows no net gradient (only a
    share-out among members) and the choice of group never learns. Raw sigmoid gates carry that gradient;
    it stays within ~1% of the dense model at step 0 (gates ~ 1/2, router std 0.02/sqrt(H), a = 2G/T)."""
    dense = nemo[0]
    ids = _ids()
    with torch.no_grad():
        ref = dense(ids)
    norm, _ = upcycle_model(dense, make_plan(dense.cfg, experts=16, granularity=4, top_k=4, router="sigmoid"))
    raw, p = upcycle_model(dense, make_plan(dense.cfg, experts=16, granularity=4, top_k=4, router="sigmoid-raw"))
    assert not p.exact and p.a == 2.0 and p.why_not_exact
    for group, rows in _group_router_grads(norm.train(), 4, ids):
        assert rows > 1e-6 and group < 1e-4 * rows  # members share out, the group as a whole gets nothing
    for group, rows in _group_router_grads(raw.train(), 4, ids):
        assert group > 0.1 * rows
    with torch.no_grad():
        dev = (raw.eval()(ids) - ref).abs().max().item()
    assert 1e-6 < dev < 0.02 * ref.abs().max().item()


def test_sigmoid_raw_exports_to_nemotron_h(nemo, tmp_path):
    """sigmoid-raw is nemotron_h's router with norm_topk_prob false: transformers reads it and agrees with
    our model of the written checkpoint; --exact refuses it."""
    rep = upcycle(nemo[1], tmp_path / "raw", experts=8, granularity=4, top_k=4, router="sigmoid-raw", seed=2)
    c = json.loads((tmp_path / "raw" / "config.json").read_text())
    assert c["norm_topk_prob"] is False and rep["router"]["norm_topk_prob"] is False
    assert rep["router"]["init_std"] == pytest.approx(0.02 / 32 ** 0.5) and rep["scaling"]["a"] == 2.0
    with torch.no_grad():
        ours = load_model(tmp_path / "raw").eval()(_ids())
    assert (_hf_logits(tmp_path / "raw", _ids()) - ours).abs().max().item() < TOL
    assert 0 < rep["deviation"]["max_abs_logit_diff"] < 0.05
    with pytest.raises(RemodelError, match="sigmoid-raw"):
        upcycle(nemo[1], tmp_path / "ex", experts=8, granularity=4, top_k=4, router="sigmoid-raw", exact=True)
    assert not (tmp_path / "ex").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pipeline_matches_in_memory_upcycle(nemo, tmp_path, dtype):
    """The streamed checkpoint is bit for bit the in-memory upcycle (bf16: scaled once, rounded once)."""
    src = tmp_path / "src"
    save_model(nemo[0], src, dtype=dtype)
    rep = upcycle(src, tmp_path / "o", experts=8, granularity=2, top_k=4, shared_expert_size=16, seed=5,
                  router="sigmoid")  # the pre-issue-59 default, explicit
    got = load_model(tmp_path / "o", dtype=dtype).state_dict()
    dense = load_model(src, dtype=dtype)
    plan = make_plan(dense.cfg, experts=8, granularity=2, top_k=4, shared=16, router="sigmoid")
    want = upcycle_model(dense, plan, seed=5)[0].state_dict()
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert rep["dtype"] == [str(dtype)[6:]]
    assert (dtype == torch.bfloat16) == any("bfloat16" in n for n in rep["notes"])
    dev = rep["deviation"]
    assert dev["rel_diff"] < (1e-5 if dtype == torch.float32 else 1e-2)
    # the streamed check gives the figure of a whole-model fp32 forward of both checkpoints
    dense32 = load_model(src)
    moe32 = upcycle_model(dense32, plan, seed=5, round_to=dtype)[0]
    ids = torch.randint(0, 64, pipeline.DEVIATION_TOKENS, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = (moe32(ids) - dense32(ids)).abs().max().item()
    assert math.isclose(dev["max_abs_logit_diff"], whole, rel_tol=1e-3, abs_tol=1e-6), (dev, whole)
    # per upcycled layer: fp32 reproduces the dense MLP; bf16 shows the rounding of s = 2^(1/3)
    assert [x["layer"] for x in dev["layers"]] == [2, 4]
    worst = max(x["rel_out_diff"] for x in dev["layers"])
    assert worst < 1e-5 if dtype == torch.float32 else 1e-4 < worst < 3e-2


def test_shared_index_and_expert_math():
    """Tensor level: any carved neuron set + virtual groups reproduce the dense relu2 MLP exactly,
    and expert e is the scaled shard e mod G."""
    from remodel.models.mlp import MLP
    from remodel.models.moe import MoE

    cfg = ModelConfig(**NEMO)
    mlp = MLP(32, 64, "relu2", False)
    torch.nn.init.normal_(mlp.up_proj.weight, std=0.3)
    x = torch.randn(256, 32)
    p = make_plan(cfg, 12, 4, 8, 16, "sigmoid")  # E=3, 2 of 3 groups chosen
    idx = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:16]
    t = upcycle_mlp(p, mlp.up_proj.weight.data, mlp.down_proj.weight.data, None, router_weight(p, 32, 0),
                    shared_index=idx)
    moe = MoE(cfg.replace(pattern="E", n_routed_experts=12, num_experts_per_tok=8, moe_intermediate_size=12,
                          moe_shared_expert_intermediate_size=16))
    moe.load_state_dict({k: v.fused() if hasattr(v, "fused") else v for k, v in t.items()})
    with torch.no_grad():
        assert (moe(x) - mlp(x)).abs().max().item() < 1e-5 * mlp(x).abs().max().item()
    rest = torch.tensor([i for i in range(64) if i not in set(idx.tolist())])
    assert torch.equal(t["shared_experts.up_proj.weight"], mlp.up_proj.weight.data[idx])
    assert torch.equal(t["experts.up_proj"][6], mlp.up_proj.weight.data[rest[24:36]] * p.s)  # e=6: shard 2
    assert torch.equal(t["experts.down_proj"][9], mlp.down_proj.weight.data[:, rest[12:24]] * p.s)  # shard 1


@pytest.mark.parametrize("gated,dtype", [(False, torch.float32), (True, torch.bfloat16)])
def test_check_shard_experts_equal_per_expert_dispatch(gated, dtype):
    """The deviation check runs each of the G shards once (upcycle.deviation.ShardExperts); that must
    equal models.mlp.Experts over the N written experts, for any routing (also a token routed to two
    copies of one shard) and for weights stored in bf16."""
    from remodel.models.moe import Experts
    from remodel.upcycle.deviation import ShardExperts
    from remodel.upcycle.virtual_groups import LazyExperts

    G, N, Fm, H, T, k = 4, 12, 8, 16, 40, 5
    gen = torch.Generator().manual_seed(3)
    sh = {n: (torch.randn(G, *s, generator=gen) * 0.3).to(dtype) for n, s in
          (("up_proj", (Fm, H)), ("gate_proj", (Fm, H)), ("down_proj", (H, Fm)))}
    cfg = ModelConfig(**{**NEMO, "pattern": "E", "n_routed_experts": N, "num_experts_per_tok": k,
                         "moe_intermediate_size": Fm, "mlp_act": "silu" if gated else "relu2", "mlp_gated": gated})
    ref = Experts(cfg.replace(hidden_size=H))
    ex = ShardExperts(cfg.mlp.mlp_act)
    for n, v in sh.items():
        if n == "gate_proj" and not gated:
            continue
        setattr(ref, n, torch.nn.Parameter(LazyExperts(v.float(), N).fused()))
        setattr(ex, {"up_proj": "up", "gate_proj": "gate", "down_proj": "down"}[n], LazyExperts(v, N))
    x = torch.randn(T, H, generator=gen)
    idx = torch.stack([torch.randperm(N, generator=gen)[:k] for _ in range(T)])
    idx[0, :2] = torch.tensor([1, 1 + G])  # two copies of shard 1
    w = torch.rand(T, k, generator=gen)
    with torch.no_grad():
        a, b = ex(x, w, idx), ref(x, w, idx)
    assert (a - b).abs().max().item() < 1e-6 * b.abs().max().item()


def test_llama_g1_exact_in_transformers(llama, tmp_path):
    dense, src, hf_ref = llama
    for to, S in (("mixtral", 0), ("qwen2_moe", 0), ("qwen2_moe", 16)):
        out = tmp_path / f"{to}{S}"
        rep = upcycle(src, out, experts=4, granularity=1, top_k=2, shared_expert_size=S, to=to, exact=True)
        assert (_hf_logits(out, _ids()) - hf_ref).abs().max().item() < TOL, (to, S)
        assert rep["exact_expected"] and rep["deviation"]["max_abs_logit_diff"] < TOL
        c = json.loads((out / "config.json").read_text())
        assert c["model_type"] == to and c["num_experts_per_tok"] == 2
        if to == "mixtral":
            assert (c["num_local_experts"], c["intermediate_size"]) == (4, 64)
        else:
            assert (c["num_experts"], c["moe_intermediate_size"], c["norm_topk_prob"]) == (4, 64 - S, True)
            assert c["shared_expert_intermediate_size"] == (S or 1) and c["decoder_sparse_step"] == 1


def test_gelu_exact_for_g1_and_reported_for_g2(tmp_path):
    """Plain GeLU (nemotron_h mlp_hidden_act): G=1 is exact in transformers; G=2 is an approximation whose
    deviation is measured (and is what transformers measures); --exact puts the factor on W2: exact."""
    src = tmp_path / "gelu"
    save_model(_model(**{**NEMO, "mlp_act": "gelu"}), src)
    ids = _ids()
    ref = _hf_logits(src, ids)
    rep = upcycle(src, tmp_path / "g1", experts=4, granularity=1, top_k=2, exact=True)
    assert rep["exact_expected"] and rep["activation"] == "gelu" and rep["scaling"]["s"] == 1.0
    assert (_hf_logits(tmp_path / "g1", ids) - ref).abs().max().item() < TOL
    assert rep["deviation"]["max_abs_logit_diff"] < TOL
    rep = upcycle(src, tmp_path / "g2", experts=8, granularity=2, top_k=4, router="sigmoid")  # the old default
    dev = rep["deviation"]
    assert not rep["exact_expected"] and "gelu" in rep["why_not_exact"][0]
    assert math.isclose(rep["scaling"]["s"], 2 ** 0.5)  # a^(1/2): GeLU is degree 1 in W1
    assert min(x["rel_out_diff"] for x in dev["layers"]) > 1e-3 and dev["max_abs_logit_diff"] > 1e-3
    b, n = pipeline.DEVIATION_TOKENS
    ids = torch.randint(0, 64, (b, n), generator=torch.Generator().manual_seed(0))
    hf = (_hf_logits(tmp_path / "g2", ids) - _hf_logits(src, ids)).abs().max().item()
    assert math.isclose(hf, dev["max_abs_logit_diff"], rel_tol=1e-3, abs_tol=1e-5)
    rep = upcycle(src, tmp_path / "g2x", experts=8, granularity=2, top_k=4, exact=True)  # whole factor on W2
    assert rep["exact_expected"] and (_hf_logits(tmp_path / "g2x", ids) - _hf_logits(src, ids)).abs().max().item() < TOL


def test_gated_gelu_split_pairs_gate_and_up():
    """Gated GeLU (Megatron's known G>1 bug): each shard keeps its gate row with its up row, so the G
    unscaled shards add up to the dense MLP exactly; G=1 upcycling is exact in our model."""
    from remodel.models.mlp import MLP

    cfg = ModelConfig(**{**LLAMA, "mlp_act": "gelu"})
    mlp = MLP(32, 64, "gelu", True)
    for w in (mlp.up_proj.weight, mlp.gate_proj.weight, mlp.down_proj.weight):
        torch.nn.init.normal_(w, std=0.3)
    x = torch.randn(128, 32)
    p = make_plan(cfg, 8, 4, 4, 0, "topk-softmax")
    t = upcycle_mlp(p, mlp.up_proj.weight.data, mlp.down_proj.weight.data, mlp.gate_proj.weight.data,
                    router_weight(p, 32, 0))
    with torch.no_grad():
        g, u, d = ([t[f"experts.{n}"][j] / p.s for j in range(4)] for n in ("gate_proj", "up_proj", "down_proj"))
        parts = sum(torch.nn.functional.gelu(x @ g[j].T) * (x @ u[j].T) @ d[j].T for j in range(4))
        want = mlp(x)
        assert (parts - want).abs().max().item() < 1e-5 * want.abs().max().item()
        dense = _model(**{**LLAMA, "mlp_act": "gelu"})
        moe, p1 = upcycle_model(dense, make_plan(dense.cfg, experts=4, granularity=1, top_k=2))
        assert p1.exact and (moe(_ids()) - dense(_ids())).abs().max().item() < TOL
        moe, p4 = upcycle_model(dense, make_plan(dense.cfg, experts=8, granularity=4, top_k=4))
        assert not p4.exact and (moe(_ids()) - dense(_ids())).abs().max().item() > 1e-3


def test_llama_granular_deviation_reported(llama, tmp_path):
    _, src, _ = llama
    out = tmp_path / "g2"
    rep = upcycle(src, out, experts=8, granularity=2, top_k=2, to="mixtral")
    dev = rep["deviation"]
    assert not rep["exact_expected"] and "silu" in rep["why_not_exact"][0]
    assert math.isclose(rep["scaling"]["s"], 2 ** (1 / 3))
    assert 1e-6 < dev["max_abs_logit_diff"] < 1e3 and 0 < dev["rel_diff"] < 10
    # the recorded figure is what transformers itself measures on the same tokens
    b, n = pipeline.DEVIATION_TOKENS
    ids = torch.randint(0, 64, (b, n), generator=torch.Generator().manual_seed(0))
    hf = (_hf_logits(out, ids) - _hf_logits(src, ids)).abs().max().item()
    assert math.isclose(hf, dev["max_abs_logit_diff"], rel_tol=1e-3, abs_tol=1e-5)
    assert json.loads((out / "remodel_report.json").read_text())["deviation"] == dev


def _refused(tmp_path, src, match, **kw):
    out, before = tmp_path / "out", sorted(tmp_path.iterdir())
    with pytest.raises(RemodelError, match=match) as e:
        upcycle(src, out, **kw)
    assert "\n" not in str(e.value)
    assert not out.exists() and sorted(tmp_path.iterdir()) == before  # no OUT, no temporary sibling


def test_exact_refusals(nemo, llama, tmp_path):
    _, nsrc, _ = nemo
    _, lsrc, _ = llama
    _refused(tmp_path, nsrc, "not a multiple of granularity", experts=8, granularity=2, top_k=3, exact=True)
    rep = upcycle(lsrc, tmp_path / "x", experts=8, granularity=2, top_k=2, exact=True)  # W2 x a: exact
    assert rep["exact_expected"] and rep["scaling"]["placement"] == "down"
    _refused(tmp_path, lsrc, "softmax-topk", experts=4, granularity=1, top_k=2, router="softmax-topk",
             to="qwen2_moe", exact=True)


def test_other_refusals(nemo, llama, tmp_path):
    _, nsrc, _ = nemo
    _, lsrc, _ = llama
    _refused(tmp_path, nsrc, "only has the sigmoid router, renormalised or not", experts=8, granularity=2, top_k=2,
             router="topk-softmax")
    _refused(tmp_path, lsrc, "no q/k norm", experts=4, granularity=1, top_k=2, to="qwen3_moe")
    _refused(tmp_path, lsrc, "no shared expert", experts=4, granularity=1, top_k=2, shared_expert_size=16, to="mixtral")
    _refused(tmp_path, nsrc, "not divisible by G", experts=10, granularity=5, top_k=5)
    _refused(tmp_path, nsrc, "not a multiple of --granularity", experts=10, granularity=4, top_k=4)
    bad = tmp_path / "bad"  # config disagrees with the weights: caught before anything is written
    shutil.copytree(nsrc, bad)
    c = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**c, "intermediate_size": 32}))
    _refused(tmp_path, bad, "has shape", experts=8, granularity=2, top_k=2)


def test_group_ties_select_whole_groups():
    """Random routers on many tokens: group members tie bit for bit and top-k never splits a group,
    in our router and in transformers' own nemotron_h / qwen2_moe routers."""
    from transformers import AutoConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    H, N, G, T = 64, 128, 8, 32
    cfg = ModelConfig(**{**NEMO, "hidden_size": H, "pattern": "-"})
    p = make_plan(cfg, N, G, T, 0, "sigmoid")
    w = router_weight(p, H, seed=0)
    x = torch.randn(4096, H) * 3
    for kind in ("sigmoid", "softmax"):
        r = Router(cfg.replace(pattern="E", n_routed_experts=N, num_experts_per_tok=T, moe_intermediate_size=8,
                               router=kind))
        r.weight.data.copy_(w)
        logits, _, idx = r(x)
        assert torch.equal(logits.view(-1, N // G, G), logits.view(-1, N // G, G)[..., :1].expand(-1, -1, G))
        assert _whole_groups(idx, G)
    hf_cfg = AutoConfig.for_model("nemotron_h", hidden_size=H, n_routed_experts=N, num_experts_per_tok=T)
    hf_q = AutoConfig.for_model("qwen2_moe", hidden_size=H, num_experts=N, num_experts_per_tok=T)
    for router in (NemotronHTopkRouter(hf_cfg), Qwen2MoeTopKRouter(hf_q)):
        router.weight.data.copy_(w)
        with torch.no_grad():
            assert _whole_groups(router(x)[2], G)


@torch.no_grad()
def _hf_logits32(path, ids):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits


@pytest.mark.parametrize("act,router,G", [("relu2", "sigmoid", 4), ("gelu", "sigmoid", 4), ("silu", "topk-softmax", 2),
                                          ("silu", "topk-softmax", 4)])
def test_exact_is_exact_in_bf16(tmp_path, act, router, G):
    """--exact on a bf16 checkpoint: the whole factor a = G on down_proj (a power of two: no rounding),
    so transformers (fp32 compute) gives the dense logits for relu2, GeLU and SwiGLU sources alike."""
    kw = {**NEMO, "mlp_act": act} if act != "silu" else LLAMA
    src = tmp_path / "src"
    save_model(_model(**kw), src, family="llama" if act == "silu" else "nemotron_h", dtype=torch.bfloat16)
    ids = _ids()
    rep = upcycle(src, tmp_path / "o", experts=4 * G, granularity=G, top_k=2 * G, router=router, exact=True)
    assert rep["exact_expected"] and rep["scaling"]["placement"] == "down"
    assert (rep["scaling"]["w1_scale"], rep["scaling"]["w2_scale"]) == (1.0, G) and rep["written_dtype"] == "bfloat16"
    assert (_hf_logits32(tmp_path / "o", ids) - _hf_logits32(src, ids)).abs().max().item() < TOL
    assert rep["deviation"]["max_abs_logit_diff"] < TOL
    if act != "relu2":  # without --exact: the paper's balanced split, an approximation for GeLU / SwiGLU
        rep = upcycle(src, tmp_path / "b", experts=4 * G, granularity=G, top_k=2 * G, router=router)
        assert rep["scaling"]["placement"] == "balanced" and not rep["exact_expected"]


def test_exact_dtype_rules(nemo, tmp_path):
    """a = 3 rounds in bf16: --exact refuses naming --dtype; --dtype float32 makes it exact (bf16 x 3 fits
    in fp32); softmax-topk is never exact (its kept weights sum to < 1), and says what to change."""
    src = tmp_path / "src"
    save_model(_model(**{**NEMO, "intermediate_size": 48}), src, dtype=torch.bfloat16)
    _refused(tmp_path, src, "--exact: scaling down_proj by a=3 .* rounds in bfloat16; pass --dtype float32",
             experts=6, granularity=3, top_k=3, exact=True)
    rep = upcycle(src, tmp_path / "o", experts=6, granularity=3, top_k=3, exact=True, dtype=torch.float32)
    assert rep["written_dtype"] == "float32"
    assert json.loads((tmp_path / "o" / "config.json").read_text())["dtype"] == "float32"
    ids = _ids()
    assert (_hf_logits32(tmp_path / "o", ids) - _hf_logits32(src, ids)).abs().max().item() < TOL
    _refused(tmp_path, nemo[1], "drop --exact", experts=8, granularity=2, top_k=3, exact=True)
    _refused(tmp_path, nemo[1], "--dtype bfloat16 cannot hold every float32 weight", experts=8, granularity=2,
             top_k=4, exact=True, dtype=torch.bfloat16)


def test_exact_softmax_topk_refused(llama, tmp_path):
    _refused(tmp_path, llama[1], "softmax-topk router never reproduces.*drop --exact", experts=8, granularity=2,
             top_k=4, router="softmax-topk", to="qwen2_moe", exact=True)


def test_upcycle_dtype(nemo, tmp_path):
    """--dtype casts every floating tensor but the sigmoid router's fp32 correction bias."""
    from safetensors import safe_open
    rep = upcycle(nemo[1], tmp_path / "o", experts=8, granularity=2, top_k=4, dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "o" / "model.safetensors"), "pt") as f:
        dts = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {v for k, v in dts.items() if "e_score_correction_bias" not in k} == {"BF16"}
    assert {v for k, v in dts.items() if "e_score_correction_bias" in k} == {"F32"}
    assert rep["written_dtype"] == "bfloat16"


def test_family_without_upcycling_target_refuses_in_one_line():
    """A family that names no default upcycling target (a new family that does not override the Family
    default) answers with a one-line RemodelError naming --to, not a NotImplementedError traceback."""
    from remodel.models.families.family import Family
    new = Family("newfamily", "NewFamilyForCausalLM")
    with pytest.raises(RemodelError, match="--to") as e:
        new.upcycle_into(None, "topk-softmax", 0)
    assert "\n" not in str(e.value) and "newfamily" in str(e.value)
