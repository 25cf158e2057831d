"""Group-aware Gated DeltaNet targets (issue 53): value heads come in whole key-head groups, and where the key
heads are pruned too the groups are the kept ones. From 4 key x 8 value heads (2 value heads per key head),
`--linear-key-heads 2 --linear-value-heads 2` is valid (2 groups of 1) and was refused against the source's 4 key
heads; `--linear-key-heads 2 --linear-value-heads 8` is not (2 groups hold 4) and passed the check, to fail only
after scoring. Checked on every path: validate_targets (before any work, `--scores` and `--data` alike), the CLI's
two paths (transformers reloads the result), and the search space (its combinations are exactly those prune
accepts; its candidates prune).
"""
import itertools
import json
import shutil

import pytest
import torch

from remodel import cli
from remodel.compress.prune import plan_keep, prune_model, validate_targets
from remodel.compress.scores import load_scores
from remodel.compress.search_space import _joint_ok, build_space
from remodel.models.errors import RemodelError
from remodel.models.families import FAMILIES
from remodel.models.hf import config_from_hf
from remodel.models.kinds import widths as cfg_widths
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path
from tests.conftest import hf_pair

FAMILY = "qwen3_5_text"
TINY = dict(FAMILIES[FAMILY].tiny["plain"], linear_num_key_heads=4, linear_num_value_heads=8,
            vocab_size=2048)  # the embedded tokenizer's vocabulary
GDN = ("linear_key_heads", "linear_value_heads")


def tiny_cfg():
    return config_from_hf({"model_type": FAMILY, **TINY})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(our model, its checkpoint dir with the tokenizer, scores of a `remodel score` run on it)."""
    root = tmp_path_factory.mktemp("gdn_targets")
    _, ours, d = hf_pair(FAMILY, root, "model", 3, **TINY)
    for f in embedded_tokenizer_path().iterdir():
        shutil.copy(f, d / f.name)
    assert cli.main(["score", str(d), "--data", str(embedded_corpus()[1]), "--out", str(root / "s"),
                     "--samples", "4", "--seq-len", "16", "--no-loss-increase"]) == 0
    return ours, d, root / "s"


@pytest.mark.parametrize("targets,kept", [
    ({"linear_key_heads": 2, "linear_value_heads": 2}, (2, 2)),  # the refused case: 2 groups of 1
    ({"linear_key_heads": 2, "linear_value_heads": 4}, (2, 4)),
    ({"linear_key_heads": 2}, (2, 4)),  # the kept key heads keep their value heads
    ({"linear_key_heads": 3}, (3, 6)),  # (was refused: the source's 8 value heads checked against 3)
    ({"linear_key_heads": 1, "linear_value_heads": 1}, (1, 1)),
    ({"linear_value_heads": 4}, (4, 4)),  # 4 groups of 1
])
def test_valid_grouped_targets_are_accepted_and_planned(targets, kept):
    cfg = tiny_cfg()
    assert validate_targets(cfg, targets) == targets
    g = torch.Generator().manual_seed(0)
    scores = {f"layers.{i}.{s}": torch.rand(shape, generator=g) for i, c in enumerate(cfg.pattern) if c == "D"
              for s, shape in (("lin_q", (4, 8)), ("lin_k", (4, 8)), ("lin_v", (8, 6)))}
    keep = plan_keep(cfg, scores, targets)
    for i in (i for i, c in enumerate(cfg.pattern) if c == "D"):
        heads = keep[f"layers.{i}.lin_v_heads"]
        assert len(heads) == kept[1] and len(keep.get(f"layers.{i}.lin_k_heads", range(4))) == kept[0]
        groups = heads // 2  # value head h sits in key head h // 2: the same number kept in every kept group
        assert torch.unique(groups, return_counts=True)[1].unique().numel() == 1


@pytest.mark.parametrize("targets,message", [
    ({"linear_key_heads": 2, "linear_value_heads": 8},
     "--linear-value-heads 8 is more than the groups kept by --linear-key-heads 2 hold (2 each, 4 in all); "
     "nearest valid: 4"),
    ({"linear_key_heads": 2, "linear_value_heads": 3},
     "--linear-value-heads 3 is not a multiple of --linear-key-heads 2 (every key-head group keeps the same number "
     "of value heads); nearest valid: 2 or 4"),
    ({"linear_key_heads": 3, "linear_value_heads": 4},
     "--linear-value-heads 4 is not a multiple of --linear-key-heads 3"),
    ({"linear_value_heads": 6}, "--linear-value-heads 6 is not a multiple of linear_num_key_heads=4"),
])
def test_invalid_grouped_targets_refused_before_any_work(targets, message):
    with pytest.raises(RemodelError) as e:
        validate_targets(tiny_cfg(), targets)
    assert message in str(e.value) and "\n" not in str(e.value)


def _reloaded(out, kh, vh):
    """transformers' model from `out`: the pruned config and tensor shapes as targeted, finite logits."""
    from transformers import AutoModelForCausalLM
    hf = json.loads((out / "config.json").read_text())
    assert (hf["model_type"], hf["linear_num_key_heads"], hf["linear_num_value_heads"]) == (FAMILY, kh, vh)
    m = AutoModelForCausalLM.from_pretrained(out).float().eval()
    layer = next(l.linear_attn for l in m.model.layers if hasattr(l, "linear_attn"))
    dk, dv, H = TINY["linear_key_head_dim"], TINY["linear_value_head_dim"], TINY["hidden_size"]
    assert tuple(layer.in_proj_qkv.weight.shape) == (2 * kh * dk + vh * dv, H)
    assert tuple(layer.in_proj_z.weight.shape) == (vh * dv, H) and tuple(layer.in_proj_a.weight.shape) == (vh, H)
    assert tuple(layer.out_proj.weight.shape) == (H, vh * dv)
    x = torch.randint(0, TINY["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = m(x).logits
    assert logits.shape == (2, 17, TINY["vocab_size"]) and torch.isfinite(logits).all() and logits.std() > 0
    return logits


def test_two_width_prune_from_data_and_by_cli_from_scores_reloads_in_transformers(model, tmp_path):
    ours, d, scores = model
    from remodel.pipelines.commands.prune import prune
    out = tmp_path / "data"  # the --data path (a short scoring run into OUT/scores, then the prune)
    prune(str(d), str(out), data=str(embedded_corpus()[1]), samples=4, seq_len=16, linear_key_heads=2,
          linear_value_heads=2)
    _reloaded(out, 2, 2)
    out = tmp_path / "scores"  # the --scores path, with the logits of the same pruning done in memory
    assert cli.main(["prune", str(d), str(out), "--scores", str(scores), "--linear-key-heads", "2",
                     "--linear-value-heads", "2"]) == 0
    s, _ = load_scores(scores)
    with torch.no_grad():
        want = prune_model(ours, plan_keep(ours.cfg, s, {"linear_key_heads": 2, "linear_value_heads": 2}))(
            torch.randint(0, TINY["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(1)))
    assert (_reloaded(out, 2, 2) - want).abs().max().item() <= 1e-4
    out = tmp_path / "keys"  # key heads alone: each kept group keeps its value heads
    assert cli.main(["prune", str(d), str(out), "--scores", str(scores), "--linear-key-heads", "3"]) == 0
    _reloaded(out, 3, 6)


def test_search_space_combinations_are_what_prune_accepts():
    """Over the searched grid of key x value heads, the combinations the search counts (the rest cost INVALID)
    are exactly those validate_targets accepts, and include key-head cuts (which the search crashed on)."""
    cfg = tiny_cfg()
    sp = build_space(cfg, ",".join(GDN), max_width_cut=0.8, family=FAMILY)
    assert sp.values["linear_key_heads"] == [4, 3, 2, 1] and sp.values["linear_value_heads"] == [8, 7, 6, 5, 4, 3, 2]
    ok = set()
    for kh, vh in itertools.product(sp.values["linear_key_heads"], sp.values["linear_value_heads"]):
        d = cfg_widths(cfg, linear_key_heads=kh, linear_value_heads=vh)
        try:
            validate_targets(cfg, {"linear_key_heads": kh, "linear_value_heads": vh})
            accepted = True
        except RemodelError:
            accepted = False
        assert _joint_ok(sp, d) == accepted, (kh, vh)
        if accepted:
            ok.add((kh, vh))
    assert ok == {(4, 8), (4, 4), (3, 6), (3, 3), (2, 4), (2, 2), (1, 2)}
    assert build_space(cfg, "all", family=FAMILY).values["linear_key_heads"] == [4, 3]  # every axis at once


def test_search_candidates_prune_and_reload(model, tmp_path):
    """`remodel search` over the GDN head counts (plan's candidates, pruned in memory with the scores, ranked,
    the best written): the written model has the kept groups and transformers reloads it."""
    from remodel.pipelines.commands.plan import plan
    from remodel.pipelines.commands.search import search_job
    ours, d, scores = model
    total = sum(p.numel() for p in ours.parameters())
    budget = total - 9000  # more than cutting the value heads alone (8 -> 4) saves: key heads must go too
    got = plan(str(d), params=budget, axes=",".join(GDN), max_width_cut=0.8, top=50, verbose=False)
    pairs = {(c["widths"]["linear_key_heads"], c["widths"]["linear_value_heads"]) for c in got["candidates"]}
    assert pairs and all(k < 4 for k, _ in pairs), pairs
    s, _ = load_scores(scores)
    for c in got["candidates"]:
        pruned = prune_model(ours, plan_keep(ours.cfg, s, c["prune_targets"]))
        assert sum(p.numel() for p in pruned.parameters()) == c["params"] <= budget
    out = tmp_path / "searched"
    search_job(str(d), str(out), str(embedded_corpus()[1]), params=budget, scores=str(scores), top=3, candidates=1,
               seq_len=32, batch=4, eval_tokens=512, progress=False,
               plan_options={"axes": ",".join(GDN), "max_width_cut": 0.8})
    hf = json.loads((out / "config.json").read_text())
    _reloaded(out, hf["linear_num_key_heads"], hf["linear_num_value_heads"])
    assert hf["linear_num_key_heads"] < 4
