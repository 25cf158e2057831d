import itertools
import math
import json
from pathlib import Path

import pytest
import torch

from remodel.compress.prune import layer_units, new_config, plan_keep, validate_targets
from remodel.compress.scores import save_scores
from remodel.compress.train_memory import TrainSetup, train_memory_bytes
from remodel.compress.search_space import WIDTHS, Serving, axis_values, build_space, depth_units, extremes, search
from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.hf import check_exportable, config_from_hf
from remodel.models.params import count_params, memory_bytes
from remodel.pipelines.commands.inspection import fmt_count
from remodel.pipelines.commands.plan import FIELDS, candidate_config, plan

CONFIGS = Path(__file__).resolve().parents[1] / "models" / "configs"
TINY = ModelConfig(vocab_size=96, hidden_size=64, pattern="M-M*-ME-M-", num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, intermediate_size=128, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
                   ssm_state_size=8, chunk_size=8, n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=64,
                   moe_shared_expert_intermediate_size=64, router="sigmoid", n_group=2, topk_group=2)
LLAMA = ModelConfig(vocab_size=96, hidden_size=64, pattern="*-" * 5, num_attention_heads=8, num_key_value_heads=2,
                    head_dim=8, rope_theta=10000.0, intermediate_size=96, mlp_act="silu", mlp_gated=True)
BRUTE_AXES = ("hidden_size", "ffn_size", "mamba_heads", "mamba_head_dim", "experts", "depth")
# Granite 4.0-H's decoder layers: 'ME' and '*E' share the expert axes (one value for every layer, not one per type)
GRANITE = config_from_hf(dict(
    model_type="granitemoehybrid", vocab_size=96, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, layer_types=["linear_attention", "full_attention"] + ["linear_attention"] * 4
    + ["full_attention", "linear_attention"], intermediate_size=64, shared_intermediate_size=64, num_local_experts=16,
    num_experts_per_tok=2, mamba_n_heads=16, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8,
    embedding_multiplier=2.0))
# Jamba: dense MLPs beside experts, both sized by its one intermediate_size (one knob; depth left out: where its
# periods place attention and experts depends on which layers go, not on how many)
JAMBA = config_from_hf(dict(
    model_type="jamba", vocab_size=96, hidden_size=64, num_hidden_layers=8, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, attn_layer_period=4, attn_layer_offset=0,
    expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4))
BRUTE = {"nemotron": (TINY, BRUTE_AXES),
         "granite": (GRANITE, ("hidden_size", "mamba_heads", "experts", "expert_ffn_size", "depth")),
         "jamba": (JAMBA, ("hidden_size", "ffn_size", "experts", "expert_ffn_size", "mamba1_d_state"))}


def shipped(name):
    return config_from_hf(json.loads((CONFIGS / f"{name}.json").read_text()))


def metrics(cfg, train=TrainSetup(recompute="selective", tp=2, dp=2, batch=4, seq_len=64, teacher_params=10**6)):
    c = count_params(cfg)
    return c["total"], c["active"], memory_bytes(cfg)["total"], train_memory_bytes(cfg, train)["total"]


def find(cands, widths, removed_by_kind):
    return [c for c in cands if all(c["widths"][a] == v for a, v in widths.items())
            and c["layers_removed"] == removed_by_kind]


def check_exact(cfg, cands, **mem):
    """Every candidate re-derived independently: its config from pattern + widths, counted by models.params."""
    for c in cands:
        new = cfg.replace(pattern=c["pattern"], **{FIELDS[a]: v for a, v in c["widths"].items()})
        assert new == candidate_config(cfg, c)
        cp = count_params(new)
        assert (c["params"], c["active_params"]) == (cp["total"], cp["active"])
        assert c["memory_bytes"] == memory_bytes(new, **mem)["total"]
        kinds = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
        for ch, kind in kinds.items():
            assert cfg.count(ch) - new.count(ch) == c["layers_removed"].get(kind, 0)


# ---- the published shapes ------------------------------------------------------------------------

def test_56b_to_47b_minipuzzle_shape():
    src, pub = shipped("nemotron-h-56b"), shipped("nemotron-h-47b")
    assert count_params(pub)["total"] == 46_791_554_816
    want_w = {"hidden_size": 8192, "ffn_size": 30720, "mamba_heads": 256, "mamba_head_dim": 64, "attn_heads": 64}
    want_r = {"mamba": 9, "mlp": 6, "attention": 5}
    # MiniPuzzle's own search space (depth by type + FFN; hidden, Mamba, attention kept): listed in the table
    d = plan("nemotron-h-56b", params=46.8e9, axes=("ffn_size", "depth"), top=30)
    hit = find(d["candidates"], want_w, want_r)
    assert len(hit) == 1, [(c["widths"]["ffn_size"], c["layers_removed"]) for c in d["candidates"]]
    c = hit[0]
    print(f"47B shape: rank {c['rank']} of {d['maximal']} maximal / {d['window']} in the window")
    assert c["params"] == count_params(pub)["total"] == 46_791_554_816
    assert c["memory_bytes"] == memory_bytes(pub)["total"]  # same counts per type, same memory
    assert c["num_layers"] == 98 and c["pattern"].count("M") == 45 and c["pattern"].count("-") == 48
    assert c["prune_targets"]["ffn_size"] == 30720 and len(c["prune_targets"]["drop_layers"]) == 20
    assert all(x["params"] <= 46.8e9 and x["params"] >= 0.98 * 46.8e9 for x in d["candidates"])
    check_exact(src, d["candidates"])
    # with a long-context deployment budget (1M tokens, attention KV dominates) it moves to the top
    d2 = plan("nemotron-h-56b", params=46.8e9, memory_gb=116e9 / 2**30, seq_len=2**20, axes=("ffn_size", "depth"), top=5)
    hit2 = find(d2["candidates"], want_w, want_r)
    assert hit2 and hit2[0]["memory_bytes"] == memory_bytes(pub, seq_len=2**20)["total"] <= 116e9
    assert hit2[0]["rank"] < c["rank"]
    # default space (hidden, FFN, Mamba heads, depth): present, ranked by closeness among ~7k maximal ones
    sp = build_space(src)
    rows, stats = search(sp, {"params": 46.8e9}, 0.02, top=10**6)
    ranks = [i + 1 for i, r in enumerate(rows) if r["removed"] == {"M": 9, "-": 6, "*": 5}
             and all(r["widths"][a] == v for a, v in want_w.items())]
    print(f"47B shape in the default space: rank {ranks} of {len(rows)}")
    assert len(ranks) == 1 and len(rows) == stats["maximal"]
    assert rows[ranks[0] - 1]["metrics"][0] == 46_791_554_816


def test_8b_to_4b_minitron_ssm_shape():
    src, pub = shipped("nemotron-h-8b"), shipped("nemotron-h-4b")
    assert count_params(pub)["total"] == 4_489_223_040
    d = plan("nemotron-h-8b", params=4.5e9, axes="width", top=20)
    hit = find(d["candidates"], {"hidden_size": 3072, "ffn_size": 12288, "mamba_heads": 112, "attn_heads": 32}, {})
    assert len(hit) == 1
    c = hit[0]
    print(f"4B shape: rank {c['rank']} of {d['maximal']} maximal / {d['window']} in the window")
    assert c["params"] == count_params(pub)["total"] == 4_489_223_040
    assert c["pattern"] == src.pattern == pub.pattern and c["drop_layers"] == []
    a, b = candidate_config(src, c).to_dict(), pub.to_dict()
    assert {k: v for k, v in a.items() if k != "extra"} == {k: v for k, v in b.items() if k != "extra"}
    assert c["prune_targets"] == {"hidden_size": 3072, "ffn_size": 12288, "mamba_heads": 112}
    check_exact(src, d["candidates"])
    # the default space holds it too (with depth, thousands of shapes are as close)
    rows, _ = search(build_space(src), {"params": 4.5e9}, 0.02, top=10**6)
    assert sum(r["widths"]["hidden_size"] == 3072 and r["widths"]["ffn_size"] == 12288
               and r["widths"]["mamba_heads"] == 112 and not any(r["removed"].values()) for r in rows) == 1


def test_axis_values_follow_the_divisors():
    c8 = shipped("nemotron-h-8b")
    assert axis_values(c8, "hidden_size", 0.45) == list(range(4096, 2253, -256))
    assert 12288 in axis_values(c8, "ffn_size", 0.45) and 12288 not in axis_values(c8, "ffn_size", 0.4)
    assert axis_values(c8, "mamba_heads", 0.45) == list(range(128, 70, -8))
    nano = shipped("nemotron-3-nano-30b-a3b")
    assert axis_values(nano, "hidden_size", 0.45) == [2688, 2560, 2304, 2048, 1792, 1536]  # 2688 = 10.5 x 256
    assert axis_values(nano, "expert_ffn_size", 0.45)[:3] == [1856, 1792, 1664]  # small width: steps of 128
    assert axis_values(nano, "experts", 0.45) == list(range(128, 71, -8))
    assert axis_values(nano, "attn_heads", 0.45) == list(range(32, 17, -2))  # multiples of the 2 KV heads
    assert axis_values(TINY, "experts", 0.45) == [16, 14, 12, 10]  # n_group=2
    for cfg in (TINY, LLAMA):
        assert depth_units(cfg) == layer_units(cfg)


# ---- the enumeration against brute force -----------------------------------------------------------

@pytest.fixture(scope="module", params=sorted(BRUTE))
def brute(request):
    """Every grid point of a config over its axes, counted by models.params on its own ModelConfig (granite:
    paired decoder-layer types sharing the expert axes; jamba: every pair of MLP and expert FFN widths, the points its
    config cannot hold left out by its own check)."""
    src, brute_axes = BRUTE[request.param]
    sp = build_space(src, brute_axes, serving=Serving(train=metrics.__defaults__[0]))
    if request.param == "granite":
        assert sp.types == ["ME", "*E"] and {"experts", "expert_ffn_size"} <= set(sp.outer_axes())
    if request.param == "jamba":
        assert sp.ties == {"expert_ffn_size": "ffn_size"} and sp.values["ffn_size"] == sp.values["expert_ffn_size"]
    axes = [a for a in WIDTHS if len(sp.values[a]) > 1]
    out = {}
    for w in itertools.product(*(sp.values[a] for a in axes)):
        for rem in itertools.product(*(range(sp.removable[t] + 1) for t in sp.types)):
            if sum(rem) > sp.max_removed:
                continue
            drop = [j for t, r in zip(sp.types, rem) for j in sp.units[t][:r]]
            cfg = candidate_config(src, {"widths": dict(zip(axes, w)), "drop_layers": drop})
            try:  # a point its family's config cannot hold (Granite: Mamba width = mamba_expand * hidden)
                check_exportable(cfg, sp.family)
            except RemodelError:
                continue
            out[(w, rem)] = metrics(cfg)
    return sp, axes, out


@pytest.mark.parametrize("budgets", [{"params": 0.7}, {"active_params": 0.8, "memory_bytes": 0.85}, {"train_bytes": 0.8}])
def test_search_matches_brute_force(brute, budgets):
    sp, axes, pts = brute
    src = pts[(tuple(sp.values[a][0] for a in axes), (0,) * len(sp.types))]
    names = ("params", "active_params", "memory_bytes", "train_bytes")
    lim = {m: int(f * src[names.index(m)]) for m, f in budgets.items()}
    tol = 0.05

    def fits(v):
        return all(v[names.index(m)] <= b for m, b in lim.items())

    def grow(w, rem):  # every single-knob step up (widths one config key holds, sp.ties, step as one knob)
        for k, a in enumerate(axes):
            i = sp.values[a].index(w[k])
            if i and a not in sp.ties:
                yield tuple(sp.values[b][i - 1] if a in (b, sp.ties.get(b)) else x for b, x in zip(axes, w)), rem
        for k in range(len(rem)):
            if rem[k]:
                yield w, rem[:k] + (rem[k] - 1,) + rem[k + 1:]

    want = {}
    for (w, rem), v in pts.items():
        slack = [(b - v[names.index(m)]) / b for m, b in lim.items()]
        if fits(v) and min(slack) <= tol and not any(g in pts and fits(pts[g]) for g in grow(w, rem)):
            want[(w, rem)] = sum(slack) / len(slack)
    rows, stats = search(sp, lim, tol, top=10**6)
    got = {(tuple(r["widths"][a] for a in axes), tuple(r["removed"][t] for t in sp.types)): r for r in rows}
    assert len(want) > {"nemotron_h": 5}.get(sp.family, 2) and stats["maximal"] == len(rows) == len(got)  # small grids
    assert set(got) == set(want)
    for key, r in got.items():
        assert tuple(r["metrics"]) == pts[key]
        assert r["distance"] == pytest.approx(want[key], abs=1e-12)
    # rows come in ranking order: distance in 0.1% steps, most parameters, distance, fewest layers removed
    keys = [(math.floor(r["distance"] / 1e-3), -r["metrics"][0], r["distance"], sum(r["removed"].values()))
            for r in rows]
    assert keys == sorted(keys)
    # the window without the maximality filter is larger: it held dominated shapes (not always on the
    # small Granite grid, where the Mamba-width rule leaves few points)
    assert stats["window"] > stats["maximal"] or sp.family == "granitemoehybrid"


def test_extremes_are_the_grid_extremes(brute):
    sp, axes, pts = brute
    ex = extremes(sp)
    ident = (tuple(sp.values[a][0] for a in axes), (0,) * len(sp.types))
    for k, m in enumerate(("params", "active_params", "memory_bytes", "train_bytes")):
        assert ex[m][0] == min(v[k] for v in pts.values())
        assert ex[m][1] == max(v[k] for key, v in pts.items() if key != ident)
        assert ex[m][2] == pts[ident][k]


# ---- budgets ---------------------------------------------------------------------------------------------

def test_active_params_budget_moe():
    nano = shipped("nemotron-3-nano-30b-a3b")
    d = plan("nemotron-3-nano-30b-a3b", params=20e9, active_params=3.0e9, top=15)
    cands = d["candidates"]
    assert cands and all(c["params"] <= 20e9 and c["active_params"] <= 3.0e9 for c in cands)
    assert any(c["widths"]["experts"] < 128 for c in cands)
    assert any(c["widths"]["expert_ffn_size"] < 1856 for c in cands)
    assert all(c["widths"]["expert_ffn_size"] % 8 == 0 and c["widths"]["hidden_size"] % 8 == 0 for c in cands)
    check_exact(nano, cands)
    # the active budget binds: the same params budget alone keeps more active parameters
    alone = plan("nemotron-3-nano-30b-a3b", params=20e9, top=10, verbose=False)["candidates"]
    bound = plan("nemotron-3-nano-30b-a3b", params=20e9, active_params=2.5e9, top=10, verbose=False)["candidates"]
    assert any(c["active_params"] > 2.5e9 for c in alone) and all(c["active_params"] <= 2.5e9 for c in bound)
    # an active budget alone: removing experts frees no active parameters, so the top shapes keep them all
    act = plan("nemotron-3-nano-30b-a3b", active_params=3.0e9, top=5, verbose=False)["candidates"]
    assert all(c["widths"]["experts"] == 128 and 0.98 * 3e9 <= c["active_params"] <= 3e9 for c in act)


def test_memory_budget_filters():
    src = shipped("nemotron-h-8b")
    by_params = plan("nemotron-h-8b", params=6e9, top=20, verbose=False)["candidates"]
    cap = min(c["memory_bytes"] for c in by_params) - 50e6
    d = plan("nemotron-h-8b", params=6e9, memory_gb=cap / 2**30, top=20)  # GiB
    assert all(c["memory_bytes"] <= cap and c["params"] <= 6e9 for c in d["candidates"])
    assert not {c["pattern"] + str(c["widths"]) for c in d["candidates"]} & \
        {c["pattern"] + str(c["widths"]) for c in by_params}
    check_exact(src, d["candidates"])
    # memory alone, at another context length: KV/state for batch x seq_len as memory_bytes counts it
    d = plan("nemotron-h-8b", memory_gb=10, batch=2, seq_len=32768, top=10, verbose=False)
    assert all(0.98 * 10 * 2**30 <= c["memory_bytes"] <= 10 * 2**30 for c in d["candidates"])
    check_exact(src, d["candidates"], batch=2, seq_len=32768)


def test_infeasible_budgets_refused():
    ex = extremes(build_space(shipped("nemotron-h-8b")))["params"]
    with pytest.raises(RemodelError) as e:
        plan("nemotron-h-8b", params=9e9)
    msg = str(e.value)
    assert "nothing to prune" in msg and "\n" not in msg and fmt_count(ex[0]) in msg and fmt_count(ex[1]) in msg
    with pytest.raises(RemodelError) as e:
        plan("nemotron-h-8b", params=ex[0] - 1)
    msg = str(e.value)
    assert "below every candidate" in msg and "\n" not in msg and fmt_count(ex[0]) in msg and fmt_count(ex[1]) in msg
    assert plan("nemotron-h-8b", params=ex[0], top=1, verbose=False)["candidates"][0]["params"] == ex[0]
    for bad in (dict(params=-1), dict(params=float("nan")), dict()):
        with pytest.raises(RemodelError):
            plan("nemotron-h-8b", **bad)
    with pytest.raises(RemodelError, match="unknown search axes"):
        plan("nemotron-h-8b", params=5e9, axes="hidden_size,heads")
    with pytest.raises(RemodelError, match="no such checkpoint"):
        plan("no-such-model", params=5e9)
    # each budget reachable alone, not both: at 1M tokens the smallest memory drops attention (KV),
    # the smallest parameter count drops MLPs
    ex2 = extremes(build_space(shipped("nemotron-h-8b"), serving=Serving(seq_len=2**20)))
    with pytest.raises(RemodelError, match="no candidate meets every budget together") as e:
        plan("nemotron-h-8b", params=ex2["params"][0], memory_gb=ex2["memory_bytes"][0] / 2**30, seq_len=2**20)
    assert "\n" not in str(e.value) and f"{ex2['memory_bytes'][0] / 2**30:.2f} GiB" in str(e.value)


def _reference_seconds() -> float:
    """A fixed vectorised numpy workload, timed in this process: the machine's pace right now."""
    import time
    import numpy as np
    x = np.random.default_rng(0).random(2 * 10**6)
    t = time.perf_counter()
    for _ in range(5):
        np.sort(x * 1.5 + 2.0)
    return time.perf_counter() - t


def test_fast_on_56b():
    """The >1e7-point grid is searched vectorised, in seconds: under 5 s, or (on a slow or loaded machine,
    issue 39) under 15x a reference numpy workload timed just before in this process (measured ~4-5x on
    the developers' VM, where plan takes ~3 s); best of 3 attempts. A per-candidate Python loop would be
    minutes, 100x over either bound."""
    times = []
    for _ in range(3):
        ref = _reference_seconds()
        d = plan("nemotron-h-56b", params=46.8e9, verbose=False)
        times.append((d["seconds"], ref))
        if d["seconds"] < max(5.0, 15 * ref):
            break
    assert d["grid"] > 10**7 and d["seconds"] < max(5.0, 15 * ref), times
    assert len(d["candidates"]) == 20 and d["candidates"][0]["under_budget"]["params"] >= 0


# ---- depth from scores, and the pruner accepts every candidate ---------------------------------------

def _scores_dir(tmp_path, cfg, with_loss=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {"block_importance": torch.rand(cfg.num_layers, generator=g), "hidden": torch.rand(cfg.hidden_size, generator=g)}
    if with_loss:
        t["loss_increase"] = torch.rand(cfg.num_layers, generator=g)
    for i, c in enumerate(cfg.pattern):
        p = f"layers.{i}."
        if c == "-":
            t[p + "ffn"] = torch.rand(cfg.mlp.intermediate_size, generator=g)
        elif c == "*":
            t[p + "attn"] = torch.rand(cfg.attention.num_attention_heads, cfg.attention.head_dim, generator=g)
        elif c == "M":
            t[p + "mamba_x"] = torch.rand(cfg.mamba.mamba_num_heads, cfg.mamba.mamba_head_dim, generator=g)
        elif c == "E":
            t[p + "experts"] = torch.rand(cfg.moe.n_routed_experts, generator=g)
            t[p + "expert_ffn"] = torch.rand(cfg.moe.n_routed_experts, cfg.moe.moe_intermediate_size, generator=g)
            t[p + "shared_ffn"] = torch.rand(cfg.moe.moe_shared_expert_intermediate_size, generator=g)
    out = tmp_path / f"scores{int(with_loss)}"
    save_scores(out, t, {"config": cfg.to_dict(), "samples": 1, "seq_len": 8, "tokens": 8})
    return out, t


@pytest.mark.parametrize("with_loss", [True, False])
def test_scores_choose_the_least_important_layers(tmp_path, with_loss):
    sdir, t = _scores_dir(tmp_path, TINY, with_loss)
    metric = "loss_increase" if with_loss else "block_importance"
    d = plan(TINY, params=0.75 * count_params(TINY)["total"], scores=sdir, top=10)
    assert d["scored"] and d["depth_metric"] == metric
    s = t[metric].tolist()
    deep = [c for c in d["candidates"] if c["drop_layers"]]
    assert deep
    for c in d["candidates"]:
        for ch, r in c["removed"].items():
            of_type = sorted((i for i, x in enumerate(TINY.pattern) if x == ch), key=lambda i: (s[i], i))
            assert sorted(i for i in c["drop_layers"] if TINY.pattern[i] == ch) == sorted(of_type[:r])
        assert c["pattern"] == "".join(x for i, x in enumerate(TINY.pattern) if i not in c["drop_layers"])
        if c["drop_layers"]:
            assert c["depth_choice"] == metric and c["drop_cost"] == pytest.approx(sum(s[i] for i in c["drop_layers"]))
        # the pruner takes the candidate as it is and builds exactly this model
        keep = plan_keep(TINY, t, c["prune_targets"])
        new = new_config(TINY, keep)
        assert new == candidate_config(TINY, c)
        assert count_params(new)["total"] == c["params"]
    check_exact(TINY, d["candidates"])


def test_scores_for_another_model_refused(tmp_path):
    sdir, _ = _scores_dir(tmp_path, TINY.replace(hidden_size=48))
    with pytest.raises(RemodelError, match="different model"):
        plan(TINY, params=0.75 * count_params(TINY)["total"], scores=sdir)


def test_without_scores_depth_is_an_evenly_spaced_placeholder():
    d = plan(TINY, params=0.92 * count_params(TINY)["total"], axes="depth", top=5, verbose=False)
    assert d["candidates"] and all(c["drop_layers"] for c in d["candidates"])
    for c in d["candidates"]:
        assert c["depth_choice"] == "evenly spaced (placeholder, no scores)"
        for ch, r in c["removed"].items():
            idx = [i for i, x in enumerate(TINY.pattern) if x == ch]
            assert sorted(i for i in c["drop_layers"] if TINY.pattern[i] == ch) == \
                [idx[int((k + 0.5) * len(idx) / r)] for k in range(r)]


def test_llama_decoder_layers_drop_as_pairs(tmp_path):
    d = plan(LLAMA, params=0.7 * count_params(LLAMA)["total"], axes="all", tol=0.1, top=20)
    assert len(d["candidates"]) > 3
    assert d["family"] == "llama" and list(d["depth"]) == ["*-"]
    for c in d["candidates"]:
        assert c["pattern"] == "*-" * (len(c["pattern"]) // 2)
        assert c["widths"]["hidden_size"] % c["widths"]["attn_heads"] == 0
        assert c["widths"]["attn_heads"] % 2 == 0
        validate_targets(LLAMA, c["prune_targets"])  # the pruner accepts it (and transformers' config)
        assert all(0 <= j < 5 for j in c["drop_layers"])
    assert any(c["drop_layers"] for c in d["candidates"])
    check_exact(LLAMA, d["candidates"])


def test_every_candidate_is_a_valid_prune_target():
    for name, kw in (("nemotron-h-56b", dict(params=46.8e9)), ("nemotron-3-nano-30b-a3b", dict(params=15e9)),
                     ("nemotron-h-8b", dict(params=4.5e9, axes="all"))):
        cfg = shipped(name)
        for c in plan(name, top=10, verbose=False, **kw)["candidates"]:
            validate_targets(cfg, c["prune_targets"])


def test_cli_plan(capsys):
    from remodel.cli import main
    assert main(["plan", "nemotron-h-8b", "--params", "4.5B"]) == 0
    out = capsys.readouterr().out
    assert "params <= 4.500B" in out and "#1 pattern" in out
    assert main(["plan", "nemotron-h-8b", "--params", "9B"]) == 2
    assert "nothing to prune" in capsys.readouterr().err
