"""TII Falcon-H1 (models/families/falcon_h1.py, the parallel mixer models/parallel_mixer.py) against transformers'
`falcon_h1` (the oracle): tiny random FalconH1ForCausalLMs with every multiplier away from 1 (and the Mamba
norm variants) are saved, loaded by remodel, compared logit for logit and gradient for gradient, exported
back bit for bit, loaded again by transformers, evaluated, and pruned on every axis."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from remodel import cli
from remodel.models.errors import RemodelError
from remodel.models.families import FAMILIES, default_family
from remodel.models.hf import check_exportable, config_from_hf, weight_table
from remodel.models.load import save_model
from remodel.models.model import HybridLM
from remodel.models.params import count_params
from tests.conftest import assert_left_padding, assert_same_tensors, hf_meta_model, hf_pair

FAMILY = "falcon_h1"
V, B, L = 128, 2, 37
# head_dim 12 (not hidden / heads), a Mamba width mamba_d_ssm 48 (not mamba_expand * hidden)
BASE = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=12, intermediate_size=48, mamba_d_ssm=48, mamba_n_heads=6, mamba_d_head=8, mamba_n_groups=2,
            mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16)
SCALED = dict(embedding_multiplier=3.0, lm_head_multiplier=0.4, key_multiplier=0.6, attention_in_multiplier=1.3,
              attention_out_multiplier=0.7, ssm_in_multiplier=1.4, ssm_out_multiplier=0.8,
              ssm_multipliers=[0.5, 1.5, 0.7, 1.2, 0.9], mlp_multipliers=[1.6, 0.6])
CASES = {
    "scaled": dict(BASE, **SCALED),  # no Mamba norm (transformers' default): y * silu(z)
    # gate, then norm; logits, attention scores and the Mamba branch large enough (lm_head_multiplier 4,
    # key_multiplier 2.5, ssm_out_multiplier 3) that the loss feels a 10% change of any multiplier
    "rms_norm": dict(BASE, mamba_rms_norm=True, mamba_norm_before_gate=False,
                     **{**SCALED, "lm_head_multiplier": 4.0, "key_multiplier": 2.5, "ssm_out_multiplier": 3.0}),
    # norm then gate, every bias, tied embeddings, a dt clamp that bites, other multipliers
    "norm_before_gate_biased_tied": dict(BASE, mamba_rms_norm=True, mamba_norm_before_gate=True, attention_bias=True,
                                         mlp_bias=True, mamba_proj_bias=True, projectors_bias=True,
                                         mamba_conv_bias=False, tie_word_embeddings=True, time_step_limit=(0.01, 5.0),
                                         rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                                         **{**SCALED, "key_multiplier": 1.7, "ssm_multipliers": [1.2, 0.8, 1.1, 0.6, 1.3]}),
}
SCALARS = ("embedding_multiplier", "lm_head_multiplier", "key_multiplier", "attention_in_multiplier",
           "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("falcon_h1")


def build(case, root):
    """-> (transformers model, our model, checkpoint dir), built once per case (tests/conftest.hf_pair)."""
    return hf_pair(FAMILY, root, case, len(case), **CASES[case])


def ids(seed=0, n=B):
    return torch.randint(0, V, (n, L), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_config_maps_to_pairs(case, root):
    _, ours, _ = build(case, root)
    c, cfg = CASES[case], ours.cfg
    assert cfg.pattern == "P-" * 3 and FAMILIES[FAMILY].depth_units(cfg) == [[0, 1], [2, 3], [4, 5]]
    assert default_family(cfg) == FAMILY
    assert (cfg.head_dim, cfg.mamba_inner, cfg.mamba_head_dim) == (12, 48, 8)
    assert {k: getattr(cfg, k) for k in SCALARS} == {k: c[k] for k in SCALARS}
    assert cfg.ssm_multipliers == tuple(c["ssm_multipliers"]) and cfg.mlp_multipliers == tuple(c["mlp_multipliers"])
    assert (cfg.mamba_rms_norm, cfg.mamba_norm_before_gate) == (c.get("mamba_rms_norm", False),
                                                                c.get("mamba_norm_before_gate", True))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_gradients(case, root):
    hf, ours, _ = build(case, root)
    x, labels = ids(0), ids(1)
    for m in (hf, ours):
        m.zero_grad(set_to_none=True)
    ref, out = hf(x).logits, ours(x)
    assert out.shape == ref.shape == (B, L, V)
    assert (out - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    assert ref.std().item() > 0.3  # not a comparison of near-constant outputs
    F.cross_entropy(ref.reshape(-1, V), labels.reshape(-1)).backward()
    F.cross_entropy(out.reshape(-1, V), labels.reshape(-1)).backward()
    hf_params, ours_params = dict(hf.named_parameters()), dict(ours.named_parameters())
    for our_name, hf_name, _ in weight_table(ours.cfg, FAMILY):
        if hf_name not in hf_params:  # tied: lm_head is the embeddings
            continue
        g_ours, g_ref = ours_params[our_name].grad, hf_params[hf_name].grad
        pad = hf.config.pad_token_id  # transformers' padding_idx row gets no gradient from the input side
        if our_name == "embeddings.weight" and pad is not None:
            g_ours, g_ref = (torch.cat([g[:pad], g[pad + 1:]]) for g in (g_ours, g_ref))
        assert (g_ours - g_ref).abs().max().item() <= 1e-5 + 1e-4 * g_ref.abs().max().item(), our_name
    assert {o for o, _, _ in weight_table(ours.cfg, FAMILY)} == set(ours_params)
    assert set(hf_params) == {h for _, h, _ in weight_table(ours.cfg, FAMILY)}


@pytest.mark.parametrize("case", ["scaled", "rms_norm"])
def test_left_padding(case, root):
    hf, ours, _ = build(case, root)
    assert_left_padding(hf, ours, ids(2))


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_identical(case, root):
    hf, ours, d = build(case, root)
    out = save_model(ours, root / f"{case}_out", family=FAMILY)
    assert_same_tensors(d, out)
    src, dst = (json.loads((p / "config.json").read_text()) for p in (d, out))
    for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "mamba_d_ssm", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_conv_bias",
              "mamba_proj_bias", "projectors_bias", "mamba_rms_norm", "mamba_norm_before_gate", "time_step_limit",
              "attention_bias", "mlp_bias", "tie_word_embeddings", "rms_norm_eps", "rope_parameters",
              "ssm_multipliers", "mlp_multipliers", *SCALARS):
        assert dst[k] == src[k], k
    back = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        got, want = back(ids(3)).logits, hf(ids(3)).logits
        # weights equal bit for bit (above), logits to fp32 rounding: BLAS sums of a loaded copy may differ
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()  # (bit-unequal with ATEN_CPU_CAPABILITY=default)


@pytest.mark.parametrize("case", list(CASES))
def test_parameter_count_and_inspect(case, root, capsys):
    hf, ours, d = build(case, root)
    n_hf = sum(p.numel() for p in hf.parameters())
    assert count_params(ours.cfg, family=FAMILY)["hf_total"] == n_hf == sum(p.numel() for p in ours.parameters())
    assert cli.main(["inspect", str(d)]) == 0
    shown = capsys.readouterr().out
    assert ours.cfg.pattern in shown and f"{n_hf:,}" in shown


def _hf_loss(hf, blocks):
    """transformers' own mean next-token loss (its labels path) over equal-sized batches of blocks."""
    with torch.no_grad():
        return sum(hf(b, labels=b).loss.item() for b in blocks.split(B)) / math.ceil(len(blocks) / B)


@pytest.mark.parametrize("case", list(CASES))
def test_eval_loss_parity(case, root):
    from remodel.pipelines.training.evaluate import evaluate

    hf, _, d = build(case, root)
    blocks = ids(7, n=2 * B)
    assert abs(evaluate(d, blocks, batch=B)["loss"] - _hf_loss(hf, blocks)) <= 5e-5


MULTIPLIERS = [(k, None) for k in SCALARS] + [("ssm_multipliers", i) for i in range(5)] + \
    [("mlp_multipliers", i) for i in range(2)]


@pytest.mark.parametrize("field,index", MULTIPLIERS)
def test_each_multiplier_is_used(field, index, root):
    """The same weights with one multiplier 10% off no longer give transformers' loss: every one is used."""
    from remodel.pipelines.training.evaluate import evaluate

    hf, ours, _ = build("rms_norm", root)
    blocks = ids(7, n=2 * B)
    v = getattr(ours.cfg, field)
    off = HybridLM(ours.cfg.replace(**{field: v * 1.1 if index is None else
                                       tuple(x * 1.1 if i == index else x for i, x in enumerate(v))}))
    off.load_state_dict(ours.state_dict())
    ref, same, changed = _hf_loss(hf, blocks), evaluate(ours, blocks, batch=B)["loss"], evaluate(off.eval(), blocks, batch=B)["loss"]
    assert abs(same - ref) <= 5e-5 and abs(changed - ref) > 5e-4  # 10x the parity test's tolerance


def test_multipliers_refused_by_other_families(root):
    _, ours, _ = build("rms_norm", root)
    bamba = ours.cfg.replace(pattern="M-*-", partial_rotary_factor=0.5, embedding_multiplier=1.0, mamba_num_heads=8)
    with pytest.raises(RemodelError, match="no per-projection multipliers"):
        check_exportable(bamba, "bamba")
    with pytest.raises(RemodelError, match="no per-projection multipliers"):
        check_exportable(ours.cfg.replace(pattern="*-" * 2, embedding_multiplier=1.0), "llama")


def test_refusals(root):
    _, ours, _ = build("scaled", root)
    cfg = ours.cfg
    with pytest.raises(RemodelError, match="pattern"):
        check_exportable(cfg.replace(pattern="M-P-"), FAMILY)
    with pytest.raises(RemodelError, match="residual_multiplier"):
        check_exportable(cfg.replace(residual_multiplier=0.5), FAMILY)
    with pytest.raises(RemodelError, match="whole heads"):
        check_exportable(cfg.replace(partial_rotary_factor=0.5), FAMILY)
    with pytest.raises(RemodelError, match="projectors_bias"):
        config_from_hf({"model_type": FAMILY, **CASES["scaled"], "projectors_bias": True})
    with pytest.raises(RemodelError, match="ssm_multipliers must be 5"):
        config_from_hf({"model_type": FAMILY, **CASES["scaled"], "ssm_multipliers": [1.0, 2.0]})
    with pytest.raises(RemodelError, match="key_multiplier"):
        config_from_hf({"model_type": FAMILY, **CASES["scaled"], "key_multiplier": 0})


@pytest.mark.parametrize("case", ["rms_norm", "norm_before_gate_biased_tied"])
def test_prune_every_axis_then_transformers_reloads(case, root):
    """Through the generic planner: hidden, query heads, Mamba heads and head size, the MLP and one decoder layer
    (parallel mixer + MLP) pruned; the result exports as falcon_h1, transformers loads it with our logits and our
    parameter count, the multipliers kept."""
    from remodel.compress.baselines import random_scores
    from remodel.compress.prune import plan_keep, prune_model

    _, ours, _ = build(case, root)
    cfg = ours.cfg
    targets = dict(hidden_size=24, ffn_size=32, attn_heads=2, mamba_heads=4, mamba_head_dim=4, num_layers=2)
    keep = plan_keep(cfg, random_scores(cfg, seed=1), targets, family=FAMILY)
    assert len(keep["layers"]) == 4 and all(keep["layers"][1::2] == keep["layers"][0::2] + 1)  # whole pairs
    small = prune_model(ours, keep)
    c = small.cfg
    assert (c.pattern, c.hidden_size, c.intermediate_size, c.num_attention_heads) == ("P-P-", 24, 32, 2)
    assert (c.mamba_num_heads, c.mamba_head_dim) == (4, 4)
    assert {k: getattr(c, k) for k in SCALARS} == {k: getattr(cfg, k) for k in SCALARS}
    out = save_model(small, root / f"{case}_pruned", family=FAMILY)
    hf = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert sum(p.numel() for p in hf.parameters()) == count_params(c, family=FAMILY)["hf_total"]
    with torch.no_grad():
        a, b = hf(ids(5)).logits, small(ids(5))
    assert (a - b).abs().max().item() < 1e-4


def test_activation_scores_then_prune(root):
    """Activation scoring hooks the parallel mixer's attention and Mamba sites; pruning from those scores loads."""
    from remodel.compress.importance import score_model
    from remodel.compress.prune import plan_keep, prune_model

    _, ours, _ = build("scaled", root)
    scores, _ = score_model(ours, [ids(50 + s) for s in range(2)], loss_batches=1)
    for i in (0, 2, 4):
        assert scores[f"layers.{i}.attn"].shape == (4, 12) and scores[f"layers.{i}.mamba_x"].shape == (6, 8)
    small = prune_model(ours, plan_keep(ours.cfg, scores, dict(attn_heads=2, mamba_heads=4), family=FAMILY))
    hf = AutoModelForCausalLM.from_pretrained(save_model(small, root / "scored_pruned", family=FAMILY)).float().eval()
    with torch.no_grad():
        assert (hf(ids(5)).logits - small(ids(5))).abs().max().item() < 1e-4


def test_streaming_scores_equal_whole_model_scores(root, tmp_path):
    """Layer-streaming scoring applies the embedding and lm_head multipliers as the whole model does."""
    from remodel.compress.importance import score_model, score_streaming
    _, ours, d = build("rms_norm", root)
    batches = [ids(50 + s) for s in range(3)]
    whole, wi = score_model(ours, batches, loss_batches=2)
    got, gi = score_streaming(d, batches, loss_batches=2, spill_dir=tmp_path)
    assert got.keys() == whole.keys() and "loss_increase" in got
    for k in whole:
        assert torch.allclose(got[k], whole[k], rtol=1e-5, atol=1e-7), k
    assert abs(gi["baseline_loss"] - wi["baseline_loss"]) <= 1e-6 * wi["baseline_loss"]


def test_plan_searches_the_parallel_mixers_widths(tmp_path, capsys):
    """`remodel plan` searches the parallel mixer's query heads, Mamba heads and head size (its spec's widths)
    beside hidden, FFN and depth; each candidate's count is the parameter count of transformers' model of it."""
    from transformers import AutoConfig

    from remodel.models.hf import config_to_hf

    big = dict(BASE, vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, head_dim=128,
               intermediate_size=4096, mamba_d_ssm=2048, mamba_n_heads=32, mamba_d_head=64, mamba_d_state=64, **SCALED)
    src = tmp_path / "config.json"
    src.write_text(AutoConfig.for_model(FAMILY, **big).to_json_string())
    assert cli.main(["plan", str(src), "--params", "200e6", "--axes", "all", "--top", "3", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {a for a in ("mamba_heads", "mamba_head_dim", "attn_heads") if len(plan["space"][a]) > 1} == \
        {"mamba_heads", "mamba_head_dim", "attn_heads"}
    assert any({"mamba_heads", "mamba_head_dim", "attn_heads"} & set(c["changed"]) for c in plan["candidates"])
    cfg = config_from_hf(json.loads(src.read_text()))
    fields = {"hidden_size": "hidden_size", "ffn_size": "intermediate_size", "mamba_heads": "mamba_num_heads",
              "mamba_head_dim": "mamba_head_dim", "attn_heads": "num_attention_heads"}
    for c in plan["candidates"]:
        small = cfg.replace(pattern=c["pattern"], **{f: c["widths"][a] for a, f in fields.items()})
        hf = hf_meta_model(config_to_hf(small, FAMILY))
        assert c["params"] == sum(p.numel() for p in hf.parameters()), c["widths"]


def test_convert_round_trip_identical(root):
    """`remodel convert` (streaming, our names and back) writes the checkpoint transformers saved."""
    for case in ("scaled", "norm_before_gate_biased_tied"):
        _, _, d = build(case, root)
        out = root / f"{case}_converted"
        assert cli.main(["convert", str(d), str(out), "--to", FAMILY]) == 0
        assert_same_tensors(d, out, case)


def test_streaming_prune_equals_in_memory(root):
    """`remodel prune` streams the checkpoint: its output equals the in-memory prune's export tensor for tensor."""
    from remodel.compress.baselines import random_scores
    from remodel.compress.prune import plan_keep, prune_model
    from remodel.compress.scores import save_scores
    from remodel.pipelines.commands.prune import prune

    _, ours, d = build("rms_norm", root)
    cfg, scores = ours.cfg, random_scores(ours.cfg, seed=2)
    targets = dict(hidden_size=24, ffn_size=32, attn_heads=2, mamba_heads=4, mamba_head_dim=4, num_layers=2)
    meta = {"config": cfg.to_dict(), "source": "test", "samples": 0, "seq_len": 0, "tokens": 0,
            "baseline_loss": 0.0, "mode": "whole"}
    prune(d, root / "cli_pruned", save_scores(root / "rms_norm_scores", scores, meta), **targets)
    ref = save_model(prune_model(ours, plan_keep(cfg, scores, targets, family=FAMILY)), root / "mem_pruned",
                     family=FAMILY)
    assert_same_tensors(root / "cli_pruned", ref)


def test_training_loss_sees_the_multipliers(root):
    """The trainer's fused loss (hidden states and the lm_head weight) gives transformers' loss and gradients:
    the multipliers stay in the model, trained through, not in the weights."""
    from remodel.pipelines.training.fused_loss import fused_lm_loss, lm_head_weight

    hf, ours, _ = build("rms_norm", root)
    x = ids(9)
    for m in (hf, ours):
        m.zero_grad(set_to_none=True)
    h = ours(x, return_hidden=True)
    loss = fused_lm_loss(h[:, :-1].reshape(-1, h.shape[-1]), lm_head_weight(ours), x[:, 1:].reshape(-1))
    ref = hf(x, labels=x).loss
    assert abs(loss.item() - ref.item()) <= 5e-5
    loss.backward()
    ref.backward()
    for ours_name, hf_name in (("lm_head.weight", "lm_head.weight"),
                               ("layers.0.mixer.mamba.in_proj.weight", "model.layers.0.mamba.in_proj.weight"),
                               ("layers.2.mixer.attn.k_proj.weight", "model.layers.1.self_attn.k_proj.weight"),
                               ("layers.5.mixer.gate_proj.weight", "model.layers.2.feed_forward.gate_proj.weight")):
        g, g_ref = dict(ours.named_parameters())[ours_name].grad, dict(hf.named_parameters())[hf_name].grad
        assert (g - g_ref).abs().max().item() <= 1e-5 + 1e-4 * g_ref.abs().max().item(), ours_name


@pytest.mark.parametrize("case", list(CASES))
def test_whole_tensor_path_equals_transformers(case, root, monkeypatch):
    """The Mamba mixer's CUDA path (whole-tensor conv, scan and norm; run here on the CPU) computes each Mamba
    norm variant and the per-segment multipliers as transformers does."""
    import remodel.models.mamba as mamba

    hf, ours, _ = build(case, root)
    monkeypatch.setattr(mamba, "_on_gpu", lambda t: True)
    monkeypatch.setattr(mamba, "USE_KERNEL", False)
    with torch.no_grad():
        ref, out = hf(ids(4)).logits, ours(ids(4))
    assert (out - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
