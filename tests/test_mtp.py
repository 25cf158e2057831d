"""MTP (multi-token prediction) layers, issue 20 item 1: the layout vLLM's nemotron_h_mtp.py reads, kept
byte-identical by `convert`, counted apart by `inspect`, scored from its own activations (the head runs
on the calibration data), pruned with the trunk (pruned == masked, fp32, <= 1e-5, for the trunk's and
the MTP head's logits), and invisible to transformers (trunk parity 1e-4)."""
import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from remodel.cli import main
from remodel.compress.baselines import random_scores
from remodel.compress.expert_scores import rank_experts
from remodel.compress.importance import score_model
from remodel.compress.streaming import score_streaming
from remodel.compress.prune import plan_keep, prune_model
from remodel.compress.scores import save_scores
from remodel.models.config import ModelConfig
from remodel.models.hf import config_from_hf, config_to_hf, our_shapes
from remodel.models.load import load_model, read_config_dict, save_model
from remodel.models.model import HybridLM
from remodel.models.params import count_params
from remodel.pipelines.commands.inspection import format_inspect, inspect
from tests.conftest import random_model

CFG = ModelConfig(vocab_size=96, hidden_size=32, pattern="ME*E", num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, mamba_num_heads=8, mamba_head_dim=4, n_groups=2, ssm_state_size=8, chunk_size=8,
                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                  moe_shared_expert_intermediate_size=24, moe_latent_size=24, router="sigmoid",
                  routed_scaling_factor=2.0, mtp_layers=1, mtp_pattern="*E")
IDS = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(1))


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@torch.no_grad()
def make_model(cfg=CFG, seed=0):
    """Random weights, norm gains away from 1 and a non-trivial router correction bias (MTP head's too)."""
    return random_model(cfg, seed, mtp=True)


@torch.no_grad()
def both_logits(model, ids=IDS):
    trunk, mtp = model.forward_mtp(ids)
    return trunk.float(), mtp[0].float()


# ---- layout and config -------------------------------------------------------------------------

def test_layout_is_vllms():
    """One step of '*E': fusion on mtp.layers.0, final_layernorm on mtp.layers.1, the trunk's mixer names."""
    names = [n for n in our_shapes(CFG) if n.startswith("mtp.")]
    assert names[:8] == ["mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
                         "mtp.layers.0.norm.weight", "mtp.layers.0.mixer.q_proj.weight",
                         "mtp.layers.0.mixer.k_proj.weight", "mtp.layers.0.mixer.v_proj.weight",
                         "mtp.layers.0.mixer.o_proj.weight"]
    assert names[-1] == "mtp.layers.1.final_layernorm.weight"
    assert our_shapes(CFG)["mtp.layers.0.eh_proj.weight"] == (32, 64)
    assert not any("final_layernorm" in n for n in names if n.startswith("mtp.layers.0."))
    hf = config_to_hf(CFG, "nemotron_h")
    assert hf["num_nextn_predict_layers"] == 1 and hf["mtp_layers_block_type"] == ["full_attention", "moe"]
    back = config_from_hf(hf)
    assert (back.mtp_layers, back.mtp_pattern) == (1, "*E") and our_shapes(back) == our_shapes(CFG)
    plain = config_from_hf(config_to_hf(CFG.replace(mtp_layers=0, mtp_pattern=""), "nemotron_h"))
    assert plain.mtp_layers == 0 and not hasattr(HybridLM(plain), "mtp")  # off unless the config has it


def test_super_counts_mtp_apart():
    """Super: one '*E' MTP step = eh_proj 2*4096^2 + 5 norms + one attention and one MoE layer of the trunk."""
    d = inspect("nemotron-3-super-120b-a12b")
    p, H = d["params"], 4096
    m = p["mtp"]
    assert p["total"] == 120_668_687_360  # the trunk, as transformers counts it: unchanged
    assert m["by_type"] == {"norms": 5 * H, "eh_proj": 2 * H * H, "attention": p["per_layer"]["attention"] - H,
                            "moe": p["per_layer"]["moe"] - H}
    assert m["total"] == 2_942_324_736 and m["with_trunk"] == 123_611_012_096
    assert "MTP head (1 x '*E', not in total)" in format_inspect(d)


# ---- forward ------------------------------------------------------------------------------------

def _rms(x, w, eps):
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def test_mtp_forward_matches_the_vllm_formula():
    """mtp logits = lm_head(final_norm(E(A(eh_proj[enorm(emb(t+1)) | hnorm(h_t)])))), written out by hand."""
    model = make_model()
    h, _ = model.hidden(IDS)
    b0, b1 = model.mtp.layers
    eps = CFG.norm_eps
    x = F.linear(torch.cat([_rms(model.embeddings(IDS[:, 1:]), b0.enorm.weight, eps),
                            _rms(h[:, :-1], b0.hnorm.weight, eps)], -1), b0.eh_proj.weight)
    x = x + b0.mixer(_rms(x, b0.norm.weight, eps), None, None)
    x = x + b1.mixer(_rms(x, b1.norm.weight, eps))
    want = F.linear(_rms(x, b1.final_layernorm.weight, eps), model.lm_head.weight)
    trunk, mtp = both_logits(model)
    assert (mtp - want).abs().max().item() <= 1e-5
    assert (model.mtp_logits(h[:, :-1], IDS[:, 1:]) - want).abs().max().item() <= 1e-5
    assert (trunk - model(IDS)).abs().max().item() == 0


# ---- checkpoints: transformers ignores MTP, convert keeps it byte-identical -------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp") / "src"
    save_model(make_model(), d, family="nemotron_h", dtype=torch.bfloat16)
    return d


def _tensors(d):
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


def test_checkpoint_round_trip_and_transformers_parity(ckpt):
    from transformers import AutoModelForCausalLM
    names = _tensors(ckpt)
    assert "mtp.layers.0.eh_proj.weight" in names and "mtp.layers.1.mixer.experts.7.down_proj.weight" in names
    ours = load_model(ckpt)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()  # ignores mtp.*
    with torch.no_grad():
        diff = (hf(IDS).logits - ours(IDS)).abs().max().item()
    assert diff <= 1e-4, diff
    assert torch.equal(ours.mtp.layers[0].eh_proj.weight, names["mtp.layers.0.eh_proj.weight"].float())


def test_convert_is_byte_identical_with_mtp(ckpt, tmp_path):
    assert main(["convert", str(ckpt), str(tmp_path / "out")]) == 0  # the CLI, in this process
    a, b = _tensors(ckpt), _tensors(tmp_path / "out")
    assert sorted(a) == sorted(b) and sum(k.startswith("mtp.") for k in a) == 32
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].view(torch.uint8).equal(b[k].view(torch.uint8)), k
    assert read_config_dict(tmp_path / "out")["num_nextn_predict_layers"] == 1


# ---- pruning: the MTP blocks are cut on the trunk's axes --------------------------------------------

def _dropped(kept, n):
    m = torch.ones(n, dtype=torch.bool)
    m[kept] = False
    return m.nonzero()[:, 0]


def _kept_mean_rmsnorm(norm, n_kept):
    """RMSNorm over the kept hidden channels (the masked stream is zero on the others)."""
    def forward(x):
        x = x.float()
        return norm.weight * (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / n_kept + norm.eps))
    norm.forward = forward


def _mask_block(b, p, keep, cfg, d):
    """Zero what pruning removes from block b (keep prefix p); d: dropped hidden channels or None."""
    m = b.mixer
    if b.kind == "*" and p + "attn_heads" in keep:
        for h in _dropped(keep[p + "attn_heads"], cfg.attention.num_attention_heads):
            m.o_proj.weight[:, h * cfg.attention.head_dim:(h + 1) * cfg.attention.head_dim] = 0
    if b.kind == "E":
        experts = keep.get(p + "experts", torch.arange(cfg.moe.n_routed_experts))
        if p + "experts" in keep:  # never selected: -inf on the selection score
            m.gate.e_score_correction_bias[_dropped(experts, cfg.moe.n_routed_experts)] = float("-inf")
        for row, e in enumerate(experts.tolist()):
            if p + "expert_ffn" in keep:
                m.experts.down_proj[e][:, _dropped(keep[p + "expert_ffn"][row], cfg.moe.moe_intermediate_size)] = 0
        if p + "latent" in keep:
            lat = _dropped(keep[p + "latent"], cfg.moe.moe_latent_size)
            m.fc1_latent_proj.weight[lat] = 0
            m.fc2_latent_proj.weight[:, lat] = 0
        if p + "shared_ffn" in keep:
            m.shared_experts.down_proj.weight[:, _dropped(keep[p + "shared_ffn"],
                                                          cfg.moe.moe_shared_expert_intermediate_size)] = 0
    if d is None:
        return
    outs = {"M": lambda: [m.out_proj], "*": lambda: [m.o_proj],
            "E": lambda: [m.fc2_latent_proj, m.shared_experts.down_proj]}[b.kind]()
    for lin in outs + ([b.eh_proj] if hasattr(b, "eh_proj") else []):
        lin.weight[d] = 0
    for n in ("norm", "enorm", "hnorm", "final_layernorm"):
        if hasattr(b, n):
            _kept_mean_rmsnorm(getattr(b, n), cfg.hidden_size - len(d))


@torch.no_grad()
def masked(model, keep):
    ref, cfg = copy.deepcopy(model), model.cfg
    d = _dropped(keep["hidden"], cfg.hidden_size) if "hidden" in keep else None
    if d is not None:
        ref.embeddings.weight[:, d] = 0
        _kept_mean_rmsnorm(ref.norm_f, len(keep["hidden"]))
    for i, b in enumerate(ref.layers):
        _mask_block(b, f"layers.{i}.", keep, cfg, d)
    for j, b in enumerate(ref.mtp.layers):
        _mask_block(b, f"mtp.layers.{j}.", keep, cfg, d)
    return ref


TARGETS = [dict(hidden_size=24), dict(experts=6, expert_ffn_size=8), dict(latent_size=16, shared_expert_size=16),
           dict(hidden_size=16, attn_heads=2, experts=4, expert_ffn_size=8, latent_size=16)]


@pytest.mark.parametrize("targets", TARGETS)
def test_pruned_equals_masked_trunk_and_mtp(targets):
    model = make_model()
    scores = random_scores(CFG, seed=3)
    keep = plan_keep(CFG, scores, targets)
    assert any(k.startswith("mtp.layers.1.") for k in keep) or list(targets) == ["hidden_size"]
    pruned = prune_model(model, keep)
    (t, m), (tr, mr), (t0, m0) = both_logits(pruned), both_logits(masked(model, keep)), both_logits(model)
    assert (t - tr).abs().max().item() <= 1e-5 and (m - mr).abs().max().item() <= 1e-5
    assert (m - m0).abs().max().item() > 1e-3  # the MTP head did change: the comparison is not vacuous
    c, s = pruned.cfg, dict(pruned.state_dict())
    assert s["mtp.layers.0.eh_proj.weight"].shape == (c.hidden_size, 2 * c.hidden_size)
    assert s["mtp.layers.1.mixer.experts.down_proj"].shape == (c.moe.n_routed_experts, c.moe_input_size,
                                                               c.moe.moe_intermediate_size)
    assert s["mtp.layers.0.mixer.q_proj.weight"].shape == (c.attention.num_attention_heads * c.attention.head_dim, c.hidden_size)


# ---- scoring: the MTP head is run on the calibration data and scores its own units ----------------

MASK = torch.ones(2, 13, dtype=torch.long)
MASK[1, 10:] = 0  # right padding on the second row


def _mtp_keys(scores):
    return {k: v for k, v in scores.items() if k.startswith("mtp.")}


def test_a_scorer_on_the_trunk_alone_leaves_the_unrun_heads_unscored():
    """Attached to a model with an MTP head that the forward never runs: detach and result work, the trunk's
    MoE gets its reconstruction order, the head gets no scores."""
    from remodel.compress.importance import Scorer

    model = make_model()
    scorer = Scorer(model).attach()
    with torch.no_grad():
        model(IDS)
    scorer.detach()
    got = scorer.result()
    trunk = [k for k in got if k.endswith("expert_reconstruction")]
    assert trunk and all(k.startswith("layers.") for k in trunk) and not _mtp_keys(got)
    assert sorted(got[trunk[0]].tolist()) == list(range(CFG.moe.n_routed_experts))


def test_activation_scores_come_from_the_mtp_heads_own_activations():
    model, seen = make_model(), {}
    scores, _ = score_model(model, [IDS], loss_increase=False)
    shapes = {k: tuple(v.shape) for k, v in _mtp_keys(scores).items()}
    assert shapes == {"mtp.layers.0.attn": (4, 8), "mtp.layers.1.experts": (8,), "mtp.layers.1.expert_ffn": (8, 16),
                      "mtp.layers.1.expert_contribution": (8,), "mtp.layers.1.expert_frequency": (8,),
                      "mtp.layers.1.expert_reconstruction": (8,), "mtp.layers.1.expert_ffn_contribution": (8, 16),
                      "mtp.layers.1.shared_ffn": (24,), "mtp.layers.1.latent": (24,)}
    b0, b1 = model.mtp.layers
    h0 = b0.mixer.o_proj.register_forward_pre_hook(lambda m, a: seen.update(o=a[0]))
    h1 = b1.mixer.experts.register_forward_pre_hook(lambda m, a: seen.update(idx=a[2]))
    with torch.no_grad():
        model.forward_mtp(IDS)
    h0.remove(), h1.remove()
    want = seen["o"].abs().mean(1).square().sum(0).sqrt().view(4, 8)  # the head's own o_proj input, [b, l-1]
    assert torch.allclose(scores["mtp.layers.0.attn"], want, rtol=1e-5)
    freq = torch.bincount(seen["idx"].reshape(-1), minlength=8).float()
    assert torch.equal(scores["mtp.layers.1.expert_frequency"], freq) and freq.sum() == 2 * 12 * 2
    with torch.no_grad():  # other MTP weights: its scores move, the trunk's do not
        b1.mixer.experts.up_proj.mul_(1.5)
    again, _ = score_model(model, [IDS], loss_increase=False)
    assert all(torch.equal(v, again[k]) for k, v in scores.items() if not k.startswith("mtp."))
    assert not torch.allclose(again["mtp.layers.1.expert_contribution"], scores["mtp.layers.1.expert_contribution"])


def test_mtp_scores_whole_equal_streaming_with_padding(ckpt):
    whole, _ = score_model(load_model(ckpt), [IDS], [MASK], loss_increase=False)
    stream, _ = score_streaming(ckpt, [IDS], [MASK], loss_increase=False)
    assert _mtp_keys(whole) and sorted(_mtp_keys(whole)) == sorted(_mtp_keys(stream))
    for k, v in whole.items():
        assert torch.allclose(v, stream[k], rtol=1e-4, atol=1e-6), k
    assert whole["mtp.layers.1.expert_frequency"].sum() == (12 + 9) * 2  # rows whose two tokens are real


def test_prune_uses_the_mtp_heads_own_activation_scores():
    model = make_model()
    scores = rank_experts(score_model(model, [IDS], loss_increase=False)[0], CFG, "contribution")
    targets = dict(hidden_size=16, attn_heads=2, experts=4, expert_ffn_size=8, latent_size=16, shared_expert_size=16)
    keep = plan_keep(CFG, scores, targets)
    own = scores["mtp.layers.1.expert_contribution"]
    assert keep["mtp.layers.1.experts"].tolist() == sorted(own.argsort(descending=True)[:4].tolist())
    for axis, key in (("latent", "latent"), ("shared_ffn", "shared_ffn")):
        assert keep[f"mtp.layers.1.{axis}"].tolist() == sorted(scores[f"mtp.layers.1.{key}"].argsort(
            descending=True)[:16].tolist())
    pruned = prune_model(model, keep)
    (t, m), (tr, mr) = both_logits(pruned), both_logits(masked(model, keep))
    assert (t - tr).abs().max().item() <= 1e-5 and (m - mr).abs().max().item() <= 1e-5


def test_mtp_scores_rank_its_own_units_else_the_last_trunk_layer():
    s = random_scores(CFG, seed=4)
    keep = plan_keep(CFG, s, dict(experts=5))
    assert torch.equal(keep["mtp.layers.1.experts"], keep["layers.3.experts"])  # stand-in: the last 'E' layer
    s["mtp.layers.1.experts"] = torch.arange(8.0)  # the MTP head's own scores, when given, decide
    assert plan_keep(CFG, s, dict(experts=5))["mtp.layers.1.experts"].tolist() == [3, 4, 5, 6, 7]


def test_cli_prune_keeps_mtp_pruned_and_loads_in_transformers(ckpt, tmp_path):
    from transformers import AutoModelForCausalLM
    scores = random_scores(CFG, seed=5)
    save_scores(tmp_path / "scores", scores, {"config": CFG.to_dict()})
    out = tmp_path / "pruned"
    assert main(["prune", str(ckpt), str(out), "--scores", str(tmp_path / "scores"), "--hidden-size", "24",
                 "--experts", "6", "--expert-ffn-size", "8"]) == 0  # the CLI, in this process
    t = _tensors(out)
    assert t["mtp.layers.0.eh_proj.weight"].shape == (24, 48)
    assert t["mtp.layers.1.mixer.experts.5.up_proj.weight"].shape == (8, 24)
    assert "mtp.layers.1.mixer.experts.6.up_proj.weight" not in t
    ours = load_model(out)
    want = prune_model(load_model(ckpt), plan_keep(CFG, scores, dict(hidden_size=24, experts=6, expert_ffn_size=8)))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (hf(IDS).logits - ours(IDS)).abs().max().item() <= 1e-4
        assert (both_logits(ours)[1] - both_logits(want)[1]).abs().max().item() <= 1e-5
    assert count_params(ours.cfg)["mtp"]["total"] == sum(v.numel() for k, v in t.items() if k.startswith("mtp.")
                                                         and not k.endswith("correction_bias"))


def test_declared_but_absent_mtp_is_off(tmp_path):
    """A config declaring MTP over weights without mtp.* (a trunk-only export) loads as the trunk alone."""
    from remodel.models.checkpoint import CheckpointReader
    from remodel.models.load import load_config
    from remodel.models.hf import weight_table
    plain = CFG.replace(mtp_layers=0, mtp_pattern="")
    model = make_model(plain)
    save_model(model, tmp_path / "src")
    cfg = read_config_dict(tmp_path / "src")
    cfg.update(num_nextn_predict_layers=1, mtp_layers_block_type=["full_attention", "moe"])
    (tmp_path / "src" / "config.json").write_text(__import__("json").dumps(cfg))
    assert load_config(tmp_path / "src").mtp_layers == 0
    with CheckpointReader(tmp_path / "src") as r:
        assert r.config["num_nextn_predict_layers_dropped"] == 1
    assert (load_model(tmp_path / "src")(IDS) - model(IDS)).abs().max().item() == 0
    assert inspect(str(tmp_path / "src"))["params"]["mtp"]["total"] == 0
    assert len(weight_table(plain, "nemotron_h")) == len(CheckpointReader(tmp_path / "src"))
