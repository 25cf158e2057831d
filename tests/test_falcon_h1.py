"""TII Falcon-H1 (models/families/falcon_h1.py, the parallel mixer models/parallel_mixer.py) against transformers'
`falcon_h1` (the oracle) beyond the family conformance suite (tests/test_families.py: logits, gradients, padding,
export, convert, inspect, eval of its tiny models with every multiplier away from 1 and the Mamba norm
variants, Family.tiny): the config mapping, every multiplier used, refusals, pruning every axis then
transformers' reload, activation and streaming scores, the plan's widths, the fused loss, the CUDA path."""
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from remodel import cli
from remodel.models.errors import RemodelError
from remodel.models.families import FAMILIES, default_family
from remodel.models.hf import check_exportable, config_from_hf
from remodel.models.load import save_model
from remodel.models.model import HybridLM
from remodel.models.params import count_params
from tests.conftest import assert_same_tensors, hf_meta_model, hf_pair

FAMILY = "falcon_h1"
V, B, L = 128, 2, 37
CASES = FAMILIES[FAMILY].tiny  # scaled, rms_norm, norm_before_gate_biased_tied: every multiplier away from 1
_PROJ = ("embedding_multiplier", "lm_head_multiplier", "key_multiplier", "attention_in_multiplier",
         "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier", "ssm_multipliers", "mlp_multipliers")
BASE = {k: v for k, v in CASES["scaled"].items() if k not in _PROJ}
SCALED = {k: CASES["scaled"][k] for k in _PROJ}
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
    assert (cfg.attention.head_dim, cfg.mamba_inner, cfg.mamba.mamba_head_dim) == (12, 48, 8)
    assert {k: cfg.get(k) for k in SCALARS} == {k: c[k] for k in SCALARS}
    assert cfg.mamba.ssm_multipliers == tuple(c["ssm_multipliers"]) and cfg.mlp.mlp_multipliers == tuple(c["mlp_multipliers"])
    assert (cfg.mamba.mamba_rms_norm, cfg.mamba.mamba_norm_before_gate) == (c.get("mamba_rms_norm", False),
                                                                c.get("mamba_norm_before_gate", True))


def _hf_loss(hf, blocks):
    """transformers' own mean next-token loss (its labels path) over equal-sized batches of blocks."""
    with torch.no_grad():
        return sum(hf(b, labels=b).loss.item() for b in blocks.split(B)) / math.ceil(len(blocks) / B)


MULTIPLIERS = [(k, None) for k in SCALARS] + [("ssm_multipliers", i) for i in range(5)] + \
    [("mlp_multipliers", i) for i in range(2)]


@pytest.mark.parametrize("field,index", MULTIPLIERS)
def test_each_multiplier_is_used(field, index, root):
    """The same weights with one multiplier 10% off no longer give transformers' loss: every one is used."""
    from remodel.pipelines.training.evaluate import evaluate

    hf, ours, _ = build("rms_norm", root)
    blocks = ids(7, n=2 * B)
    v = ours.cfg.get(field)
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
    assert (c.pattern, c.hidden_size, c.mlp.intermediate_size, c.attention.num_attention_heads) == ("P-P-", 24, 32, 2)
    assert (c.mamba.mamba_num_heads, c.mamba.mamba_head_dim) == (4, 4)
    assert {k: c.get(k) for k in SCALARS} == {k: cfg.get(k) for k in SCALARS}
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
    _activation_in_reads_mamba_in_proj(ours, scores)
    small = prune_model(ours, plan_keep(ours.cfg, scores, dict(attn_heads=2, mamba_heads=4), family=FAMILY))
    hf = AutoModelForCausalLM.from_pretrained(save_model(small, root / "scored_pruned", family=FAMILY)).float().eval()
    with torch.no_grad():
        assert (hf(ids(5)).logits - small(ids(5))).abs().max().item() < 1e-4


def test_streaming_scores_equal_whole_model_scores(root, tmp_path):
    """Layer-streaming scoring applies the embedding and lm_head multipliers as the whole model does."""
    from remodel.compress.importance import score_model
    from remodel.compress.streaming import Streaming, score_streaming
    _, ours, d = build("rms_norm", root)
    batches = [ids(50 + s) for s in range(3)]
    whole, wi = score_model(ours, batches, loss_batches=2)
    got, gi = score_streaming(d, batches, loss_batches=2, run=Streaming(spill_dir=tmp_path))
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


def test_upcycle_deviation_check_is_the_forward_with_every_multiplier(root):
    """Issue 40 Deliver 3, Falcon-H1's half: `remodel upcycle` refuses Falcon-H1 in one line (no MoE family
    holds parallel mixers), so no written checkpoint exists; the deviation check itself (upcycle.deviation's
    StreamCheck, which the command runs layer by layer as weights stream) is run here on the tensors of a
    Falcon-H1 model with every multiplier != 1, its MLP layers upcycled in memory. Its logit deviation equals
    the difference of two whole forwards: the in-memory MoE model's and transformers' Falcon-H1 (the source),
    so the streamed forward applies the embedding, key, attention / SSM in-out, per-segment SSM and lm_head
    multipliers as transformers does (break: final_hidden without lm_head_multiplier -> fails)."""
    from remodel.upcycle.deviation import StreamCheck
    from remodel.upcycle.virtual_groups import layer_seed, make_plan, router_weight, upcycle_mlp, upcycle_model
    hf, ours, _ = build("scaled", root)
    cfg = ours.cfg
    assert all(CASES["scaled"][k] != 1 for k in SCALARS)
    p = make_plan(cfg, 8, 2, 2)
    moe, _ = upcycle_model(ours, p, seed=3)
    check = StreamCheck(cfg, moe.cfg, seed=1, sequences=2, seq_len=24)
    state = ours.state_dict()
    for key in ["embeddings.weight"] + [f"layers.{i}" for i in range(cfg.num_layers)] + ["norm_f.weight", "lm_head.weight"]:
        group = {k: v for k, v in state.items() if k == key or k.startswith(key + ".")}
        upcycled = None
        if key.startswith("layers.") and ours.layers[int(key.split(".")[1])].spec.upcycles_to:
            m, i = key + ".mixer.", int(key.split(".")[1])
            upcycled = upcycle_mlp(p, state[m + "up_proj.weight"], state[m + "down_proj.weight"],
                                   state[m + "gate_proj.weight"], router_weight(p, cfg.hidden_size, layer_seed(3, i)))
        check.feed(key, group, upcycled)
    with torch.no_grad():
        want = (moe(check.ids) - hf(check.ids).logits).abs().max().item()
    assert want > 1e-3  # a deviation worth comparing (the experts drop the MLP multipliers, the split is not exact)
    got = check.result["max_abs_logit_diff"]
    assert abs(got - want) <= 1e-4 * want + 1e-5, (got, want)


def _activation_in_reads_mamba_in_proj(ours, scores):
    """in_sites (score --method activation_in) through the parallel mixer: mamba_x from a hook on mamba.in_proj's
    x segment (its raw output, before the SSM multipliers) x out_proj's column norms; attention as the default."""
    from remodel.compress.importance import score_model
    from remodel.models.mamba import MAMBA

    x, acc, cfg = MAMBA.segment_span(ours.cfg, "mamba_in_proj", "x"), {}, ours.cfg
    hooks = [ours.layers[i].mixer.mamba.in_proj.register_forward_hook(
        lambda m, a, out, i=i: acc.__setitem__(i, acc.get(i, 0) + out[..., x].double().abs().mean(1).square().sum(0)))
        for i in (0, 2, 4)]
    old, _ = score_model(ours, [ids(50 + s) for s in range(2)], loss_increase=False, in_sites=True)
    for h in hooks:
        h.remove()
    for i in (0, 2, 4):
        want = acc[i].sqrt() * ours.layers[i].mixer.mamba.out_proj.weight.double().norm(dim=0)
        assert torch.equal(old[f"layers.{i}.attn"], scores[f"layers.{i}.attn"])
        got = old[f"layers.{i}.mamba_x"].double().flatten()
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
        assert (got - scores[f"layers.{i}.mamba_x"].double().flatten()).abs().max() > 0.05 * got.abs().max()
