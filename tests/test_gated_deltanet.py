"""The Gated DeltaNet kind beyond the family suite (tests/test_families.py runs logits, gradients, export,
pruned == masked and TP on every family that holds it): its activation scores against a direct computation
on transformers' own modules, and a tiny Qwen3.5 taken through score -> prune on every GDN width -> eval by
the CLI alone, the pruned checkpoint reloaded by transformers with the logits of the in-memory pruning."""
import shutil

import pytest
import torch
import torch.nn.functional as F

from remodel import cli
from remodel.compress.importance import score_model
from remodel.compress.prune import plan_keep, prune_model
from remodel.compress.scores import load_scores
from remodel.models.families import FAMILIES
from remodel.models.load import load_model
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path
from tests.conftest import hf_pair

CASE = dict(FAMILIES["qwen3_5_text"].tiny["grouped_biased_tied"], vocab_size=2048)  # 3 value heads per key head


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf, ours, d = hf_pair("qwen3_5_text", tmp_path_factory.mktemp("gdn"), "model", 3, **CASE)
    for f in embedded_tokenizer_path().iterdir():
        shutil.copy(f, d / f.name)
    return hf, ours, d


def _direct(hf, batches):
    """{HF layer j: (q [hk*dk], k, out_proj input [hv*dv])} of sqrt(sum over sequences of the squared
    sequence mean of |x|): the post-conv q and k channels by hand from linear_attn's input, its out_proj
    input as transformers computes it."""
    got, out = {}, {}

    def pre(j):
        def hook(mod, args, kwargs):
            got.setdefault(j, []).append(("in", kwargs.get("hidden_states", args[0] if args else None)))
        return hook

    def pre_out(j):
        return lambda mod, args: got.setdefault(j, []).append(("out", args[0]))
    hooks = []
    for j, layer in enumerate(hf.model.layers):
        if hasattr(layer, "linear_attn"):
            hooks += [layer.linear_attn.register_forward_pre_hook(pre(j), with_kwargs=True),
                      layer.linear_attn.out_proj.register_forward_pre_hook(pre_out(j))]
    with torch.no_grad():
        for ids in batches:
            hf(ids)
    for h in hooks:
        h.remove()
    agg = lambda x: x.abs().mean(1).square().sum(0)  # noqa: E731
    for j, events in got.items():
        la = hf.model.layers[j].linear_attn
        qk = la.key_dim
        acc = {"q": 0, "k": 0, "v": 0}
        for what, x in events:
            if what == "out":
                acc["v"] = acc["v"] + agg(x)
                continue
            mixed = la.in_proj_qkv(x).transpose(1, 2)
            conv = F.silu(F.conv1d(mixed, la.conv1d.weight, la.conv1d.bias, padding=la.conv_kernel_size - 1,
                                   groups=mixed.shape[1])[..., :x.shape[1]]).transpose(1, 2)
            acc["q"], acc["k"] = acc["q"] + agg(conv[..., :qk]), acc["k"] + agg(conv[..., qk:2 * qk])
        out[j] = {k: v.sqrt() for k, v in acc.items()}
        out[j]["v"] = out[j]["v"] * la.out_proj.weight.detach().norm(dim=0)
    return out


def test_activation_scores_equal_a_direct_computation(pair):
    hf, ours, _ = pair
    cfg = ours.cfg
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, cfg.vocab_size, (2, 19), generator=g) for _ in range(2)]
    scores, _ = score_model(ours, batches, loss_increase=False)
    want = _direct(hf, batches)
    assert want
    hk, hv, dk, dv = (cfg.gated_deltanet.linear_num_key_heads, cfg.gated_deltanet.linear_num_value_heads, cfg.gated_deltanet.linear_key_head_dim,
                      cfg.gated_deltanet.linear_value_head_dim)
    for j, w in want.items():
        p = f"layers.{2 * j}."
        assert scores[p + "lin_q"].shape == (hk, dk) and scores[p + "lin_v"].shape == (hv, dv)
        for site, key in (("lin_q", "q"), ("lin_k", "k"), ("lin_v", "v")):
            torch.testing.assert_close(scores[p + site].flatten(), w[key].float(), rtol=1e-4, atol=1e-6)


def test_cli_score_prune_every_gdn_width_and_eval(pair, tmp_path):
    from transformers import AutoModelForCausalLM
    _, ours, d = pair
    data = str(embedded_corpus()[1])
    assert cli.main(["inspect", str(d)]) == 0
    assert cli.main(["score", str(d), "--data", data, "--out", str(tmp_path / "s"), "--samples", "8",
                     "--seq-len", "32"]) == 0
    targets = {"linear_key_heads": 1, "linear_value_heads": 2, "linear_key_head_dim": 4, "linear_value_head_dim": 4}
    flags = [x for k, v in targets.items() for x in ("--" + k.replace("_", "-"), str(v))]
    out = tmp_path / "pruned"
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s")] + flags) == 0
    assert cli.main(["eval", str(out), "--data", data, "--seq-len", "32", "--max-tokens", "2048"]) == 0
    pruned = AutoModelForCausalLM.from_pretrained(out).float().eval()
    c = pruned.config
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim) == (1, 2, 4, 4)
    scores, _ = load_scores(tmp_path / "s")
    want_model = prune_model(ours, plan_keep(ours.cfg, scores, targets))
    x = torch.randint(0, ours.cfg.vocab_size, (2, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want, reloaded = pruned(x).logits, want_model(x), load_model(out)(x)
    assert (got - want).abs().max() <= 1e-4 and (reloaded - want).abs().max() <= 1e-5
    # a value-head target the kept key-head groups cannot hold evenly: one line, nothing written
    assert cli.main(["prune", str(d), str(tmp_path / "bad"), "--scores", str(tmp_path / "s"),
                     "--linear-key-heads", "1", "--linear-value-heads", "4"]) == 2
    assert not (tmp_path / "bad").exists()


def test_keep_is_group_aware():
    """Key-head groups go whole (ranked by their value heads' scores) and every kept group keeps the same
    number of its own value heads; channels are ranked over all heads."""
    from remodel.models.config import ModelConfig
    from remodel.models.gated_deltanet import GATED_DELTANET
    cfg = ModelConfig(vocab_size=8, hidden_size=8, pattern="D", linear_num_key_heads=2, linear_num_value_heads=6,
                      linear_key_head_dim=4, linear_value_head_dim=4)
    sv = torch.ones(6, 4)
    sv[3:] = 5.0  # group 1 (value heads 3..5) matters most, its head 4 least
    sv[4] = 2.0
    sv[0] = 3.0
    sv[:, 2] = 0.1  # value channel 2 matters least everywhere
    qk = torch.ones(2, 4)
    qk[:, 1] = 0.1  # key channel 1 matters least
    scores = {"p.lin_q": qk, "p.lin_k": qk, "p.lin_v": sv}
    score = lambda name, shape, why: scores[name]  # noqa: E731
    keep = GATED_DELTANET.keep(cfg, score, {"linear_key_heads": 1, "linear_value_heads": 2}, "p.")
    assert keep["p.lin_k_heads"].tolist() == [1] and keep["p.lin_v_heads"].tolist() == [3, 5]
    keep = GATED_DELTANET.keep(cfg, score, {"linear_value_heads": 4, "linear_key_head_dim": 3,
                                            "linear_value_head_dim": 3}, "p.")
    assert "p.lin_k_heads" not in keep and keep["p.lin_v_heads"].tolist() == [0, 1, 3, 5]
    assert keep["p.lin_dk"].tolist() == [0, 2, 3] and keep["p.lin_dv"].tolist() == [0, 1, 3]


def _mixer(seed=0):
    from remodel.models.config import ModelConfig
    from remodel.models.gated_deltanet import GatedDeltaNet
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=8, hidden_size=16, pattern="D", linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=8, linear_value_head_dim=8)
    return GatedDeltaNet(cfg).eval()


def test_gpu_conv_kernel_gets_the_conv_and_its_output_is_used(monkeypatch):
    """On CUDA the conv goes through the Mamba path's GPU conv (causal-conv1d's, else fla-core's): a stand-in
    with fla's signature, forced in on CPU, receives x [b, l, C] and the depthwise weight, and the mixer's
    output is computed from what it returns (break: the kernel's result ignored -> the doubled output is not seen)."""
    import remodel.models.gated_deltanet as G
    from remodel.models.mamba import GpuKernels
    m = _mixer()
    u = torch.randn(2, 9, 16)
    with torch.no_grad():
        want = m(u)
    calls = []

    def fla(x, w, b, activation):
        calls.append((tuple(x.shape), tuple(w.shape), activation))
        y = F.conv1d(x.transpose(1, 2), w[:, None], b, padding=w.shape[-1] - 1, groups=w.shape[0])[..., :x.shape[1]]
        return F.silu(y.transpose(1, 2)), None
    monkeypatch.setattr(G, "conv_kernels", lambda x: GpuKernels(conv_fla=fla))
    with torch.no_grad():
        got = m(u)
    assert calls == [((2, 9, 64), (64, 4), "silu")]  # conv channels: q, k 2 x 8 each, v 4 x 8
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(G, "conv_kernels", lambda x: GpuKernels(conv_fla=lambda *a, **k: (2 * fla(*a, **k)[0], None)))
    with torch.no_grad():
        assert (m(u) - want).abs().max() > 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixer_with_gpu_kernels_equals_pure_path_on_gpu(monkeypatch):
    """On a GPU: the mixer with fla-core's rule and the GPU conv (where installed) against the pure-PyTorch path,
    forward and every gradient, in fp32 (bf16-sized tolerance: the Triton kernels' own accumulation)."""
    from remodel.models import gdn_kernels
    m = _mixer().cuda()
    u = torch.randn(2, 70, 16, device="cuda", requires_grad=True)
    kernel, calls = gdn_kernels.fla_kernel(), []
    monkeypatch.setattr(gdn_kernels, "fla_kernel", lambda: lambda *a, **k: calls.append(1) or kernel(*a, **k))
    backward = not gdn_kernels.fla_backward_refused()  # else fla raises in its backward here: the forward alone
    outs = []
    for on in (True, False):
        monkeypatch.setattr(gdn_kernels, "USE_KERNEL", on)
        m.zero_grad()
        u.grad = None
        with torch.set_grad_enabled(backward):
            y = m(u)
        if backward:
            y.square().sum().backward()
        outs.append([y.detach()] + ([u.grad.clone()] + [p.grad.clone() for p in m.parameters()] if backward else []))
    assert calls and kernel is not None
    for a, b in zip(*outs):
        assert (a - b).abs().max() <= 2e-2 * b.abs().max() + 1e-5


WELL_CONDITIONED = dict(FAMILIES["qwen3_5_text"].tiny["plain"], rms_norm_eps=1e-2)


def test_pruned_equals_masked_in_fp32_on_every_gdn_width(tmp_path):
    """Pruned == masked in fp32 within 1e-5 on value heads, key-head groups and both head dims (alone and all
    at once, three seeds). The family suite checks the same slicing in float64 at 1e-10; in fp32 the tiny
    random models' rule outputs have rms ~0.002-0.02, so the per-head gated norm (eps 1e-6) multiplies fp32
    rounding by up to 1/sqrt(eps): measured 1e-5 for the unpruned model alone against float64. eps 1e-2 (a
    floor of 0.1 on the rms) bounds that amplification, as real widths (dv = 128) do: here pruned vs masked
    measured <= 3.2e-6 over 60 cases."""
    from remodel.compress.baselines import random_scores
    from tests.masking import masked_reference
    from tests.conftest import prune_axes
    _, model, _ = hf_pair("qwen3_5_text", tmp_path, "model", 3, **WELL_CONDITIONED)
    cfg = model.cfg
    axes = {n: t for n, t in prune_axes(cfg).items() if n.startswith("linear_")}
    assert sorted(axes) == ["linear_key_head_dim", "linear_key_heads", "linear_value_head_dim", "linear_value_heads"]
    x = torch.randint(0, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x)
        for seed in range(3):
            for name in [*axes, "all"]:
                keep = plan_keep(cfg, random_scores(cfg, seed=seed), axes if name == "all" else {name: axes[name]})
                pruned, masked = prune_model(model, keep)(x), masked_reference(model, keep)(x)
                assert pruned.dtype == torch.float32
                assert (pruned - masked).abs().max().item() <= 1e-5, (name, seed)
                assert (pruned - full).abs().max().item() > 1e-2, (name, seed)  # the pruning changed the model
