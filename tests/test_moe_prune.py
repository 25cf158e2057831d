"""MoE pruning (issue 20, items 2 and 3): LatentMoE latent-size pruning and expert importance.

Every pruning test compares the pruned model with the unpruned one where the dropped units are
masked by hand (tests/kinds/moe.py: latent channels: fc1_latent_proj rows and fc2_latent_proj columns zeroed;
experts: never selectable by the router), in fp32, within 1e-5.
"""
import pytest
import torch

from remodel.cli import main
from remodel.compress.baselines import magnitude_scores, random_scores
from remodel.compress.expert_scores import rank_experts
from remodel.compress.importance import score_model, seq_mean_abs
from remodel.compress.prune import plan_keep, prune_model, validate_targets
from remodel.compress.scores import load_scores
from remodel.models.errors import RemodelError
from remodel.models.load import load_model, save_model
from remodel.models.params import count_params
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path
from tests.conftest import IDS, LATENT, SOFTMAX, random_model as make_model
from tests.masking import masked_reference as masked


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@torch.no_grad()
def logits(model, ids=IDS):
    return model(ids).float()


def check_pruned_equals_masked(model, keep):
    pruned = prune_model(model, keep)
    a, b, full = logits(pruned), logits(masked(model, keep)), logits(model)
    diff, moved = (a - b).abs().max().item(), (a - full).abs().max().item()
    assert diff <= 1e-5, diff
    assert moved > 1e-3  # the pruning changed the model: the comparison is not vacuous
    return pruned


# ---- latent size ------------------------------------------------------------------------------

@pytest.mark.parametrize("targets", [dict(latent_size=16), dict(latent_size=8, experts=6, expert_ffn_size=8)])
def test_latent_pruning_equals_masking(targets):
    model = make_model(LATENT)
    keep = plan_keep(LATENT, random_scores(LATENT, seed=1), targets)
    assert {k for k in keep if k.endswith("latent")} == {"layers.1.latent", "layers.3.latent"}
    assert not torch.equal(keep["layers.1.latent"], keep["layers.3.latent"])  # per layer, by its own scores
    pruned = check_pruned_equals_masked(model, keep)
    Lt, E, Fm, H = targets["latent_size"], pruned.cfg.moe.n_routed_experts, pruned.cfg.moe.moe_intermediate_size, 32
    assert pruned.cfg.moe.moe_latent_size == Lt and E == targets.get("experts", 8)
    for m in pruned.moe_layers():
        assert m.fc1_latent_proj.weight.shape == (Lt, H) and m.fc2_latent_proj.weight.shape == (H, Lt)
        assert m.experts.up_proj.shape == (E, Fm, Lt) and m.experts.down_proj.shape == (E, Lt, Fm)
        assert m.gate.weight.shape == (E, H) and m.gate.e_score_correction_bias.shape == (E,)
        assert m.shared_experts.up_proj.weight.shape == (24, H)  # the shared expert is left alone
    c = count_params(pruned.cfg)
    assert c["total"] == sum(p.numel() for p in pruned.parameters())
    assert c["buffers"] == sum(b.numel() for n, b in pruned.named_buffers() if n.endswith("correction_bias"))
    before = count_params(LATENT, by_axis=True)
    if set(targets) == {"latent_size"}:  # the marginal count of the latent axis is exact
        assert before["total"] - c["total"] == (24 - Lt) * before["by_axis"]["latent_size"]["per_unit"]


def test_latent_scores_are_the_two_latent_activations():
    model = make_model(LATENT, seed=2)
    batches = [torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    scores, _ = score_model(model, batches, loss_increase=False)
    with torch.no_grad():
        acc_in = acc_out = 0
        for ids in batches:
            _, states = model(ids, output_hidden_states=True)
            moe = model.layers[3].mixer
            x = model.layers[3].norm(states[3]).reshape(-1, 32)
            _, w, idx = moe.gate(x)
            lat = moe.fc1_latent_proj(x)
            y = moe.experts(lat, w, idx)
            acc_in = acc_in + seq_mean_abs(lat.view(3, 17, -1)).square().sum(0)
            acc_out = acc_out + seq_mean_abs(y.view(3, 17, -1)).square().sum(0)
    want = acc_in.sqrt() + acc_out.sqrt()
    got = scores["layers.3.latent"]
    assert got.shape == (24,) and ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    keep = plan_keep(LATENT, scores, dict(latent_size=16))  # activation scores drive the plan
    assert torch.equal(keep["layers.3.latent"], got.argsort(descending=True, stable=True)[:16].sort().values)


def test_latent_targets_are_refused_in_one_line():
    for cfg, t, words in [(LATENT, 12, "multiple of 8"), (LATENT, 32, "larger than"),
                          (SOFTMAX, 16, "no latent MoE")]:
        with pytest.raises(RemodelError, match=words) as e:
            validate_targets(cfg, dict(latent_size=t))
        assert "\n" not in str(e.value)


# ---- expert importance ------------------------------------------------------------------------

def test_contribution_differs_from_frequency():
    """Expert 0 of layer 1 is always selected (a large correction bias) but writes almost nothing:
    frequency ranks it first, the routed contribution last."""
    cfg = LATENT
    model = make_model(cfg, seed=3)
    with torch.no_grad():
        moe = model.layers[1].mixer
        moe.gate.e_score_correction_bias[0] = 10.0
        moe.experts.down_proj[0] *= 1e-4
    batches = [torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    masks = [torch.ones(2, 16, dtype=torch.long), torch.ones(2, 16, dtype=torch.long)]
    masks[1][1, 10:] = 0  # padding is not counted
    scores, info = score_model(model, batches, masks, loss_increase=False)
    tokens = info["tokens"]
    for i in (1, 3):
        p = f"layers.{i}."
        freq, contrib = scores[p + "expert_frequency"], scores[p + "expert_contribution"]
        assert freq.sum().item() == tokens * cfg.moe.num_experts_per_tok
        assert torch.allclose(contrib, scores[p + "experts"] * freq, rtol=1e-5)  # sum = mean x count
    by = {m: rank_experts(scores, cfg, m)["layers.1.experts"] for m in ("contribution", "frequency", "random")}
    assert scores["layers.1.expert_frequency"][0].item() == tokens  # selected for every token
    assert by["frequency"].argmax().item() == 0 and by["contribution"].argmin().item() == 0
    assert not torch.equal(rank_experts(scores, cfg, "random", seed=1)["layers.1.experts"], by["random"])
    keep = {m: plan_keep(cfg, rank_experts(scores, cfg, m), dict(experts=6))["layers.1.experts"]
            for m in ("contribution", "frequency")}
    assert 0 in keep["frequency"].tolist() and 0 not in keep["contribution"].tolist()
    with pytest.raises(RemodelError, match="unknown expert scoring method"):
        rank_experts(scores, cfg, "loudest")


ROUTERS = {"softmax": (SOFTMAX, 0.0), "softmax_renorm": (SOFTMAX.replace(norm_topk_prob=False), 0.0),
           "sigmoid_no_bias": (LATENT, 0.0), "sigmoid_bias": (LATENT, 0.5),
           "sigmoid_grouped": (LATENT.replace(n_group=2, topk_group=1), 0.5)}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_expert_pruning_equals_router_masking(name):
    cfg, bias = ROUTERS[name]
    model = make_model(cfg, seed=4, bias=bias)
    n = 4 if cfg.moe.n_group > 1 else 5
    keep = plan_keep(cfg, random_scores(cfg, seed=5), dict(experts=n))
    pruned = check_pruned_equals_masked(model, keep)
    for i, m in enumerate(pruned.moe_layers()):
        old = model.moe_layers()[i]
        kept = keep[f"layers.{[j for j, c in enumerate(cfg.pattern) if c == 'E'][i]}.experts"]
        assert torch.equal(m.gate.weight, old.gate.weight[kept])  # router rows follow the experts
        if cfg.moe.router == "sigmoid":
            assert torch.equal(m.gate.e_score_correction_bias, old.gate.e_score_correction_bias[kept])
        _, _, idx = m.gate(torch.randn(50, 32))
        assert idx.shape == (50, cfg.moe.num_experts_per_tok) and idx.max() < n  # top-k stays valid
        if cfg.moe.n_group > 1:  # every group keeps the same number of experts
            assert (kept // (cfg.moe.n_routed_experts // cfg.moe.n_group)).bincount().tolist() == [n // 2] * 2


def test_expert_targets_keep_top_k_valid():
    grouped = LATENT.replace(n_group=2, topk_group=1)
    for cfg, v, words in [(LATENT, 1, "fewer than num_experts_per_tok=2; nearest valid: 2"),
                          (grouped, 5, "n_group=2 expert groups"), (grouped, 2, "nearest valid: 4")]:
        with pytest.raises(RemodelError, match=words) as e:
            validate_targets(cfg, dict(experts=v))
        assert "\n" not in str(e.value)


# ---- the command line ---------------------------------------------------------------------------

def test_cli_scores_experts_and_prunes_latent(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    cfg = LATENT.replace(vocab_size=2048)
    model = make_model(cfg, seed=6)
    src = save_model(model, tmp_path / "src", aux_from=embedded_tokenizer_path())
    data = str(embedded_corpus()[1])
    base = ["score", str(src), "--data", data, "--samples", "4", "--seq-len", "32", "--no-loss-increase"]
    assert main(base + ["--out", str(tmp_path / "freq"), "--expert-method", "frequency"]) == 0
    assert main(base + ["--out", str(tmp_path / "contrib"), "--expert-method", "contribution"]) == 0
    assert main(base + ["--out", str(tmp_path / "recon")]) == 0  # the default
    f, meta = load_scores(tmp_path / "freq")
    c, meta_c = load_scores(tmp_path / "contrib")
    r, meta_r = load_scores(tmp_path / "recon")
    assert meta_r["expert_method"] == "reconstruction"
    assert meta["expert_method"] == "frequency" and meta_c["expert_method"] == "contribution"
    for i in (1, 3):
        p = f"layers.{i}."
        assert torch.equal(f[p + "experts"], f[p + "expert_frequency"])
        assert torch.equal(c[p + "experts"], c[p + "expert_contribution"])
        assert torch.equal(r[p + "experts"], r[p + "expert_reconstruction"])
        assert torch.equal(c[p + "expert_ffn"], c[p + "expert_ffn_contribution"])  # routed methods: channels too
        assert torch.equal(r[p + "expert_ffn"], c[p + "expert_ffn"])
        assert not torch.equal(f[p + "expert_ffn"], c[p + "expert_ffn"])
        assert c[p + "latent"].shape == (24,)
    out = tmp_path / "pruned"
    argv = ["prune", str(src), str(out), "--scores", str(tmp_path / "contrib"), "--latent-size", "16", "--experts", "6"]
    assert main(argv) == 0
    ours = load_model(out)
    assert ours.cfg.moe.moe_latent_size == 16 and ours.cfg.moe.n_routed_experts == 6
    assert count_params(ours.cfg)["total"] == sum(p.numel() for p in ours.parameters())
    ids = torch.randint(0, 2048, (2, 19), generator=torch.Generator().manual_seed(3))
    keep = plan_keep(cfg, c, dict(latent_size=16, experts=6))
    assert (logits(ours, ids) - logits(masked(model, keep), ids)).abs().max().item() <= 1e-5
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    assert (theirs - logits(ours, ids)).abs().max().item() <= 1e-4
    save_model(ours, tmp_path / "again")  # export / import round trip of the pruned model
    assert torch.equal(logits(load_model(tmp_path / "again"), ids), logits(ours, ids))
    capsys.readouterr()
    assert main(["prune", str(src), str(tmp_path / "bad"), "--scores", str(tmp_path / "contrib"),
                 "--latent-size", "12"]) == 2
    err = capsys.readouterr().err
    assert "multiple of 8" in err and err.count("\n") == 1 and not (tmp_path / "bad").exists()


def test_weight_baselines_cover_the_latent_axis():
    """Magnitude and random SCORES carry `layers.i.latent`, so --latent-size works with them too."""
    model = make_model(LATENT)
    m = model.layers[1].mixer
    sq = lambda t, dims: t.detach().square().sum(dims)  # noqa: E731
    want = (sq(m.fc1_latent_proj.weight, 1) + sq(m.fc2_latent_proj.weight, 0) + sq(m.experts.up_proj, (0, 1))
            + sq(m.experts.down_proj, (0, 2))).sqrt()
    mag = magnitude_scores(LATENT, model.state_dict().items())
    assert torch.allclose(mag["layers.1.latent"], want, rtol=1e-5)
    for s in (mag, random_scores(LATENT)):
        assert s["layers.1.latent"].shape == (24,) and s["layers.1.latent"].min() > 0
        check_pruned_equals_masked(model, plan_keep(LATENT, s, dict(latent_size=16)))
