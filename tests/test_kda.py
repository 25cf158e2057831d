"""Kimi Delta Attention (the 'K' kind, issue 57): the chunked rule against a token-by-token float64 reference
written here from the recurrence, and against transformers' kimi_linear torch functions in fp32; fla-core's
chunk_kda called in its layout on CUDA (a fake module on CPU; the real one on a GPU); the activation scores
against a direct computation; the kimi_linear family through the CLI (inspect, score, prune every width and a
decoder layer, eval), transformers reloading the pruned checkpoint with the in-memory pruned logits.
(Logits, gradients, export, convert, counts and pruned == masked: the family suite, tests/test_families.py.)"""
import json
import sys
import types

import pytest
import torch

from remodel import cli
from remodel.compress.prune import plan_keep, prune_model
from remodel.models import kda_kernels
from remodel.models.families import FAMILIES
from remodel.models.kda_kernels import chunk_kda, chunk_kda_torch
from remodel.pipelines.data.data import embedded_corpus
from tests.conftest import KIND_CONFIGS, cli_flags, cli_inspect_and_score, cli_pair, prune_axes, random_model
from tests.conftest import reloaded_equals_in_memory

FAMILY, CASE = "kimi_linear", "kda_mla_moe"


def reference(q, k, v, g, beta, state):
    """The recurrence step by step in float64: q, k L2-normalised (eps 1e-6 under the root), q / sqrt(d); per head
    S <- diag(exp(g_t)) S; S <- S + k_t beta_t (v_t - S^T k_t)^T; o_t = S^T q_t."""
    q, k, v, g, beta, s = (x.double() for x in (q, k, v, g, beta, state))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / q.shape[-1] ** 0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    outs = []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None]  # [b, h, d, d]: each key channel's row decays by its own gate
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s))
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
    return torch.stack(outs, dim=1), s


def inputs(b=2, l=21, h=3, d=8, seed=0, dtype=torch.float64):
    g0 = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, l, h, d, generator=g0, dtype=dtype) for _ in range(3))
    g = -torch.rand(b, l, h, d, generator=g0, dtype=dtype) * 3  # strong per-channel decays, some near 0
    beta = torch.rand(b, l, h, generator=g0, dtype=dtype)
    state = torch.randn(b, h, d, d, generator=g0, dtype=dtype) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk", [1, 4, 8, 64])
def test_chunked_equals_the_float64_token_by_token_reference(chunk):
    q, k, v, g, beta, s0 = inputs()
    want, want_s = reference(q, k, v, g, beta, s0)
    got, got_s = chunk_kda_torch(q, k, v, g, beta, chunk, s0)
    assert got.dtype == torch.float64
    assert (got - want).abs().max() <= 1e-12 * want.abs().max() and want.abs().max() > 0.1
    assert (got_s - want_s).abs().max() <= 1e-12 * want_s.abs().max()


def test_chunked_gradients_equal_the_reference():
    xs = [x.requires_grad_() for x in inputs(l=11, seed=1)]
    want = torch.autograd.grad(reference(*xs)[0].square().sum(), xs)
    got = torch.autograd.grad(chunk_kda_torch(*xs[:5], 4, xs[5])[0].square().sum(), xs)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max()


def test_chunked_equals_transformers_in_fp32():
    from transformers.models.kimi_linear import modeling_kimi_linear as m
    q, k, v, g, beta, s0 = inputs(dtype=torch.float32, seed=2)
    want, want_s = m.chunk_kimi_delta_attention(q, k, v, g, beta, chunk_size=8, initial_state=s0,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
    got, got_s = chunk_kda_torch(q, k, v, g, beta, 8, s0)
    assert got.dtype == torch.float32
    assert (got - want).abs().max() <= 1e-5 and (got_s - want_s).abs().max() <= 1e-5


@pytest.fixture
def fake_fla(monkeypatch):
    """fla.ops.kda with a chunk_kda that records its call and computes the pure rule from what it is given."""
    calls = []

    def chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False):
        calls.append(dict(shapes=[tuple(t.shape) for t in (q, k, v, g, beta)], g_dtype=g.dtype, scale=scale,
                          norm=use_qk_l2norm_in_kernel, final=output_final_state))
        assert use_qk_l2norm_in_kernel and scale == q.shape[-1] ** -0.5
        return chunk_kda_torch(q, k, v, g, beta, 16, initial_state)
    mod = types.ModuleType("fla.ops.kda")
    mod.chunk_kda = chunk
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.kda", mod)
    kda_kernels.fla_kernel.cache_clear()
    yield calls
    kda_kernels.fla_kernel.cache_clear()


def test_fla_kernel_is_called_in_its_layout_on_the_gpu_path(fake_fla, monkeypatch):
    cfg = KIND_CONFIGS["kda"]
    model = random_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 13))
    with torch.no_grad():
        pure = model(x)
        assert not fake_fla  # CPU tensors: the pure rule
        monkeypatch.setattr(kda_kernels, "on_gpu", lambda t: t.dtype != torch.float64)
        got = model(x)
        h, d = cfg.kda.kda_num_heads, cfg.kda.kda_head_dim
        assert [c["shapes"] for c in fake_fla] == [[(2, 13, h, d)] * 4 + [(2, 13, h)]] * 2  # once per KDA layer
        assert all(c["g_dtype"] == torch.float32 and c["final"] for c in fake_fla)
        assert (got - pure).abs().max() <= 1e-5
        monkeypatch.setattr(kda_kernels, "USE_KERNEL", False)  # the switch turns it off
        model(x)
        assert len(fake_fla) == 2
        monkeypatch.setattr(kda_kernels, "USE_KERNEL", True)
        model.double()(x)  # float64: Triton does not take it
        assert len(fake_fla) == 2


def test_a_missing_fla_takes_the_pure_rule(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla.ops.kda", None)  # import fails
    kda_kernels.fla_kernel.cache_clear()
    monkeypatch.setattr(kda_kernels, "on_gpu", lambda t: True)
    try:
        q, k, v, g, beta, s0 = inputs(dtype=torch.float32, seed=3)
        got, _ = chunk_kda(q, k, v, g, beta, 8, s0)
        want, _ = chunk_kda_torch(q, k, v, g, beta, 8, s0)
        assert torch.equal(got, want)
    finally:
        kda_kernels.fla_kernel.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available() or kda_kernels.optional_import(*kda_kernels.FLA_KERNEL) is None,
                    reason="needs a CUDA device and fla-core")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_chunk_kda_equals_the_pure_rule_on_gpu(dtype):
    q, k, v, g, beta, s0 = (x.cuda() for x in inputs(b=2, l=300, h=4, d=64, dtype=torch.float32, seed=4))
    q, k, v = (x.to(dtype) for x in (q, k, v))
    want, want_s = chunk_kda_torch(q, k, v, g, beta, 64, s0)
    got, got_s = chunk_kda(q, k, v, g, beta, 64, s0)
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    assert got.dtype == dtype
    assert (got.float() - want.float()).abs().max() <= tol * max(1.0, want.float().abs().max().item())
    assert (got_s.float() - want_s.float()).abs().max() <= tol * max(1.0, want_s.abs().max().item())


def test_activation_scores_equal_a_direct_computation():
    """Each KDA layer's kda_o score is, per o_proj input channel, sqrt(sum over sequences of the squared sequence
    mean of |x|) times o_proj's column norm (Wanda), x read here by a hook of our own on o_proj (the heads' gated,
    normed outputs)."""
    from remodel.compress.importance import score_model
    cfg = KIND_CONFIGS["kda"]
    model = random_model(cfg)
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, cfg.vocab_size, (2, 19), generator=g) for _ in range(2)]
    seen = {i: [] for i in range(cfg.num_layers)}
    hooks = [layer.mixer.o_proj.register_forward_pre_hook(lambda m, a, i=i: seen[i].append(a[0].detach()))
             for i, layer in enumerate(model.layers)]
    scores, _ = score_model(model, batches, loss_increase=False)
    for h in hooks:
        h.remove()
    for i, xs in seen.items():
        want = torch.cat([x.abs().mean(1).square() for x in xs]).sum(0).sqrt()
        want = want * model.layers[i].mixer.o_proj.weight.detach().norm(dim=0)
        got = scores[f"layers.{i}.kda_o"]
        assert got.shape == (cfg.kda.kda_num_heads, cfg.kda.kda_head_dim)
        torch.testing.assert_close(got.flatten(), want, rtol=1e-4, atol=1e-7)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    _, ours, d = cli_pair(FAMILY, CASE, tmp_path_factory.mktemp(FAMILY))
    return ours, d


def test_cli_inspect_score_prune_every_width_and_depth_eval(pair, tmp_path, capsys):
    ours, d = pair
    scores = cli_inspect_and_score(d, ours, tmp_path / "s", capsys)
    targets = prune_axes(ours.cfg)
    assert {"kda_heads", "experts", "mla_heads", "hidden_size"} <= set(targets)
    out = tmp_path / "widths"
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s"), *cli_flags(targets)]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == FAMILY and hf["linear_num_heads"] == targets["kda_heads"]
    assert hf["linear_head_dim"] == targets["kda_head_dim"]
    assert hf["hidden_size"] == targets["hidden_size"] and hf["num_attention_heads"] == targets["mla_heads"]
    reloaded_equals_in_memory(out, prune_model(ours, plan_keep(ours.cfg, scores, targets)))
    data = str(embedded_corpus()[1])
    assert cli.main(["eval", str(out), "--data", data, "--seq-len", "32", "--max-tokens", "2048"]) == 0
    out = tmp_path / "depth"  # decoder layer 2 (the MLA layer with its MoE) dropped whole
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s"), "--drop-layers", "2"]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["layer_types"] == ["linear_attention"] * 3 and hf["mlp_layer_types"] == ["dense", "sparse", "sparse"]


def test_cli_prune_kda_head_dim_alone_and_its_refusals(pair, tmp_path, capsys):
    """`remodel prune --kda-head-dim N`: config linear_head_dim N, the gates' rank N too (f_a / g_a rows, f_b /
    g_b columns), the checkpoint transformers reloads with the in-memory pruned model's logits (1e-4); N = 0 or
    above the source's head dim is a one-line refusal naming the flag, nothing written."""
    ours, d = pair
    scores = cli_inspect_and_score(d, ours, tmp_path / "s", capsys)
    n = ours.cfg.kda.kda_head_dim // 2
    out = tmp_path / "hd"
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s"), "--kda-head-dim", str(n)]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["linear_head_dim"] == n and hf["linear_num_heads"] == ours.cfg.kda.kda_num_heads
    pruned = prune_model(ours, plan_keep(ours.cfg, scores, {"kda_head_dim": n}))
    mixer = next(b.mixer for b in pruned.layers if hasattr(b.mixer, "f_a_proj"))
    assert mixer.f_a_proj.weight.shape[0] == mixer.g_b_proj.weight.shape[1] == n
    assert mixer.o_norm.weight.shape == (n,) and mixer.q_proj.weight.shape[0] == ours.cfg.kda.kda_num_heads * n
    reloaded_equals_in_memory(out, pruned)
    capsys.readouterr()
    for bad in ("0", str(ours.cfg.kda.kda_head_dim + 1)):
        bad_out = tmp_path / f"bad{bad}"
        assert cli.main(["prune", str(d), str(bad_out), "--scores", str(tmp_path / "s"), "--kda-head-dim", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert "--kda-head-dim" in err and "\n" not in err and not bad_out.exists(), err


def test_released_kimi_linear_48b_counts_and_plan():
    """Kimi-Linear-48B-A3B-Instruct (models/configs/kimi-linear-48b-a3b.json, provenance in its README): inspect ==
    transformers' KimiLinearForCausalLM built from the file (meta device), 48B without the embedding and lm_head
    as published, ~3B active; plan to 30B returns candidates transformers counts exactly as plan does."""
    from pathlib import Path

    from remodel.models.hf import config_from_hf, config_to_hf
    from remodel.pipelines.commands.inspection import inspect
    from remodel.pipelines.commands.plan import candidate_config, plan
    from tests.conftest import hf_meta_model
    d = json.loads((Path(__file__).resolve().parents[1] / "models/configs/kimi-linear-48b-a3b.json").read_text())
    hf_total = lambda c: sum(p.numel() for p in hf_meta_model(c).parameters())  # noqa: E731
    p = inspect("kimi-linear-48b-a3b")["params"]
    assert p["total"] == p["hf_total"] == hf_total(d) == 49_122_675_072
    embeddings = 2 * 163840 * 2304
    assert round((p["total"] - embeddings) / 1e9) == 48 and round((p["active"] - embeddings) / 1e9) == 3
    assert config_from_hf(d).pattern[1::2] == "-" + "E" * 26  # first_k_dense_replace 1
    assert config_from_hf(d).pattern[0::2] == "".join("L" if j + 1 in (4, 8, 12, 16, 20, 24, 27) else "K"
                                                       for j in range(27))
    budget = 30e9
    plan_d = plan("kimi-linear-48b-a3b", params=budget, top=3, verbose=False)
    cands, src = plan_d["candidates"], config_from_hf(d)
    assert plan_d["family"] == "kimi_linear" and len(cands) == 3
    assert all(0.98 * budget <= c["params"] <= budget for c in cands)
    for c in cands:
        hf = config_to_hf(candidate_config(src, c, plan_d["family"]), plan_d["family"])
        assert hf["model_type"] == "kimi_linear" and hf_total(hf) == c["params"], c["widths"]


def test_the_released_spelling_of_a_dense_mlp_is_read(tmp_path):
    """The released checkpoints keep layer 0's dense MLP under `mlp.` (transformers writes `block_sparse_moe.`):
    remodel reads either, with the same logits."""
    import shutil

    from safetensors.torch import load_file, save_file

    from remodel.models.load import load_model
    from tests.conftest import hf_pair
    hf, ours, d = hf_pair(FAMILY, tmp_path, "src", 7, **FAMILIES[FAMILY].tiny[CASE])
    out = tmp_path / "released"
    shutil.copytree(d, out)
    t = load_file(out / "model.safetensors")
    renamed = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in t.items()}
    assert renamed.keys() != t.keys() and "model.layers.0.mlp.gate_proj.weight" in renamed
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    x = torch.randint(0, ours.cfg.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(load_model(out)(x), ours(x))
