import gzip
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from remodel.compress.scores import load_scores, save_scores
from remodel.compress.search_space import build_space, extremes
from remodel.models.errors import RemodelError
from remodel.models.load import load_config, load_model, save_model
from remodel.models.config import ModelConfig
from remodel.models.model import HybridLM, init_weights
from remodel.models.params import count_params
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path, load_texts, pack
from remodel.pipelines.commands.inspection import fmt_count
from remodel.pipelines.commands.plan import plan
from remodel.pipelines.commands.search import search_job
from remodel.pipelines.training.evaluate import evaluate
from remodel.pipelines.distributed.runtime import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
TINY = ModelConfig(vocab_size=2048, hidden_size=64, pattern="M-M*M-M-M-", num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, intermediate_size=128, mamba_num_heads=8, mamba_head_dim=8,
                   n_groups=2, ssm_state_size=8, chunk_size=16)
KW = dict(seq_len=32, batch=4, score_samples=8, eval_tokens=512, progress=False)


def _dry():
    spec = importlib.util.spec_from_file_location("dry_run_56b", REPO / "bench" / "dry_run_56b.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The first 600 documents of the shipped corpus (every 20th is the held-out part)."""
    p = tmp_path_factory.mktemp("data") / "data.txt"
    with gzip.open(embedded_corpus()[0], "rt") as f:
        p.write_text("".join(next(f) for _ in range(600)))
    return p


def make_checkpoint(d, cfg, seed=0, std=0.1):
    model = init_weights(HybridLM(cfg), std=std, seed=seed)
    save_model(model, d, aux_from=embedded_tokenizer_path())
    return d


def random_scores(d, cfg, seed=0):
    """A SCORES directory with the contract's names and shapes (random values)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.rand(*shape, generator=g)  # noqa: E731
    t = {"hidden": r(cfg.hidden_size), "block_importance": r(cfg.num_layers), "loss_increase": r(cfg.num_layers)}
    for i, c in enumerate(cfg.pattern):
        p = f"layers.{i}."
        if c == "-":
            t[p + "ffn"] = r(cfg.mlp.intermediate_size)
        elif c == "*":
            t[p + "attn"] = r(cfg.attention.num_attention_heads, cfg.attention.head_dim)
        elif c == "M":
            t[p + "mamba_x"] = r(cfg.mamba.mamba_num_heads, cfg.mamba.mamba_head_dim)
    return save_scores(d, t, {"config": cfg.to_dict(), "samples": 1, "seq_len": 8, "tokens": 8})


def heldout(model_dir, data):
    tok = load_tokenizer(model_dir)
    return pack(load_texts(data, split_valid=True)[1], tok, KW["seq_len"], max_tokens=KW["eval_tokens"])


def test_search_end_to_end(tmp_path, data):
    from transformers import AutoModelForCausalLM

    src = make_checkpoint(tmp_path / "src", TINY)
    P = count_params(TINY)["total"]
    budget = 0.8 * P
    out = tmp_path / "out"
    rep = search_job(src, out, data, params=budget, candidates=2, distill_tokens=256, top=5, **KW)
    # the output: HF checkpoint + tokenizer + report + plot + reusable scores, nothing else left behind
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json", "remodel_report.json", "search.png", "scores"}
    assert (out / "search.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no temporary siblings
    assert json.loads((out / "remodel_report.json").read_text())["candidates"] == json.loads(
        json.dumps(rep["candidates"]))
    rows = rep["candidates"]
    assert len(rows) == 5 and all(0.98 * budget <= r["params"] <= budget for r in rows)
    # ranked by held-out loss; the best two distilled; the pick is the best of those after distillation
    by_loss = sorted(rows, key=lambda r: r["loss"])
    assert [r["loss_rank"] for r in by_loss] == [1, 2, 3, 4, 5]
    distilled = [r for r in rows if r.get("distilled_loss") is not None]
    assert {id(r) for r in distilled} == {id(r) for r in by_loss[:2]}
    assert all(r["distill_tokens"] >= 256 for r in distilled)
    pick = min(distilled, key=lambda r: r["distilled_loss"])
    assert [r["chosen"] for r in rows].count(True) == 1 and pick["chosen"]
    # the written model is that candidate: its shape, within the budget, loads in transformers
    cfg = load_config(out)
    assert cfg.pattern == pick["pattern"] and count_params(cfg)["total"] == pick["params"] <= budget
    assert cfg.hidden_size == pick["widths"]["hidden_size"] and cfg.mlp.intermediate_size == pick["widths"]["ffn_size"]
    ev = evaluate(out, heldout(out, data), batch=KW["batch"])
    assert ev["loss"] == pytest.approx(pick["distilled_loss"], abs=1e-4)
    hf = AutoModelForCausalLM.from_pretrained(out).float().eval()
    ids = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, load_model(out)(ids), atol=2e-4, rtol=1e-4)
    # depth follows the layer scores: each dropped layer is the least loss_increase of its type
    s = load_scores(out / "scores")[0]["loss_increase"].tolist()
    for r in rows:
        for ch, n in r["layers_removed"].items():
            c = {"mamba": "M", "mlp": "-", "attention": "*"}[ch]
            of_type = sorted((i for i, x in enumerate(TINY.pattern) if x == c), key=lambda i: (s[i], i))
            assert sorted(i for i in r["drop_layers"] if TINY.pattern[i] == c) == sorted(of_type[:n])

    # again from the cached scores, no distillation: the pick is the lowest held-out loss, as written
    out2 = tmp_path / "out2"
    rep2 = search_job(src, out2, data, params=budget, candidates=2, top=5, scores=out / "scores", **KW)
    assert not (out2 / "scores").exists() and rep2["scores"] == str(out / "scores")
    assert [r["loss"] for r in rep2["candidates"]] == pytest.approx([r["loss"] for r in rows], abs=1e-6)
    best = min(rep2["candidates"], key=lambda r: r["loss"])
    assert best["chosen"] and rep2["distilled"] == 0
    assert evaluate(out2, heldout(out2, data), batch=KW["batch"])["loss"] == pytest.approx(best["loss"], abs=1e-5)
    assert rep2["source"]["loss"] == pytest.approx(evaluate(src, heldout(src, data), batch=4)["loss"], abs=1e-6)


def test_infeasible_budgets_refused(tmp_path, data, capsys):
    src = make_checkpoint(tmp_path / "src", TINY)
    ex = extremes(build_space(TINY))["params"]
    for params, why in ((ex[0] - 1, "below every candidate"), (2 * ex[2], "nothing to prune")):
        out = tmp_path / "out"
        with pytest.raises(RemodelError) as e:
            search_job(src, out, data, params=params, **KW)
        msg = str(e.value)
        assert why in msg and "\n" not in msg and "smallest reachable" in msg
        assert fmt_count(ex[0]) in msg and fmt_count(ex[1]) in msg
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing written
    for bad in (dict(candidates=0), dict(distill_tokens=-1), dict(top=0)):
        with pytest.raises(RemodelError):
            search_job(src, tmp_path / "out", data, params=0.8 * ex[2], **{**KW, **bad})
    with pytest.raises(RemodelError, match="unknown plan options"):
        search_job(src, tmp_path / "out", data, params=0.8 * ex[2], plan_options={"top": 3}, **KW)
    with pytest.raises(RemodelError, match="bad divisor"):
        search_job(src, tmp_path / "out", data, params=0.8 * ex[2], plan_options={"divisors": {"mamba_heads": 2}}, **KW)
    with pytest.raises(RemodelError, match="data not found"):
        search_job(src, tmp_path / "out", tmp_path / "nope.txt", params=0.8 * ex[2], **KW)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    from remodel.cli import main  # the command line refuses the same way: exit 2, one line naming both sizes
    assert main(["search", str(src), str(tmp_path / "out"), "--data", str(data), "--params", "1k"]) == 2
    err = capsys.readouterr().err
    assert "below every candidate" in err and fmt_count(ex[0]) in err and fmt_count(ex[1]) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# ---- the 56B -> 47B dry run, scaled down -----------------------------------------------------------

@pytest.mark.parametrize("scale", [32, 64])
def test_scaled_56b_plan_picks_the_47b_class(scale):
    """The real 118-layer pattern with widths / scale: under the scaled params + 1M-context memory
    budget, plan's first candidate is the published 47B class (98 layers: 45 M, 48 -, 5 *; FFN x 30/32),
    as at full scale; with the params budget alone the class is reachable but not first."""
    dry = _dry()
    cfg = dry.scaled_config(scale)
    assert cfg.num_layers == 118 and dry.counts(cfg.pattern) == {"M": 54, "-": 54, "*": 10}
    assert cfg.pattern == dry.reference("nemotron-h-56b").pattern
    b = dry.scaled_budget(cfg, scale)
    d = plan(cfg, params=b["params"], memory_gb=b["memory_gb"], top=3, verbose=False, **b["plan_options"])
    first = d["candidates"][0]
    assert first["layers_removed"] == dry.CLASS_47B and first["num_layers"] == 98
    assert dry.counts(first["pattern"]) == {"M": 45, "-": 48, "*": 5}
    assert first["widths"]["ffn_size"] * 32 == cfg.mlp.intermediate_size * 30
    alone = plan(cfg, params=b["params"], top=100, verbose=False,
                 **{**b["plan_options"], "seq_len": 4096})["candidates"]
    ranks = [c["rank"] for c in alone if c["layers_removed"] == dry.CLASS_47B
             and c["widths"]["ffn_size"] * 32 == cfg.mlp.intermediate_size * 30]
    assert len(ranks) == 1 and ranks[0] > 1


def test_dry_run_smoke(tmp_path, data):
    """Search -> prune -> export on the 118-layer pattern at tiny widths (cached random scores: scoring
    118 layers is tests/test_score.py's business and slow here); transformers loads the result."""
    from transformers import AutoModelForCausalLM

    dry = _dry()
    cfg = dry.scaled_config(128).replace(vocab_size=2048)
    src = make_checkpoint(tmp_path / "src", cfg, std=0.02)
    b = dry.scaled_budget(cfg, 128)
    scores = random_scores(tmp_path / "scores", cfg)
    d = plan(cfg, params=b["params"], memory_gb=b["memory_gb"], top=2, scores=scores, verbose=False,
             **b["plan_options"])
    out = tmp_path / "out"
    rep = search_job(src, out, data, params=b["params"], memory_gb=b["memory_gb"], plan_options=b["plan_options"], top=2,
                 candidates=1, scores=scores, **{**KW, "eval_tokens": 128})
    rows = rep["candidates"]
    # plan's shapes with the same scores: its best two by estimated loss (depth aside)
    assert [r["params"] for r in rows] == [c["params"] for c in d["candidates"]]
    assert [r["estimate"] for r in rows] == [c["estimate"] for c in d["candidates"]]
    pick = next(r for r in rows if r["chosen"])
    s = load_scores(tmp_path / "scores")[0]["loss_increase"].tolist()
    for ch, c in (("mamba", "M"), ("mlp", "-"), ("attention", "*")):  # the least important layers of each type
        of_type = sorted((i for i, x in enumerate(cfg.pattern) if x == c), key=lambda i: (s[i], i))
        n = pick["layers_removed"].get(ch, 0)
        assert sorted(i for i in pick["drop_layers"] if cfg.pattern[i] == c) == sorted(of_type[:n])
    assert pick["loss"] == min(r["loss"] for r in rows)
    got = load_config(out)
    assert got.pattern == pick["pattern"] and 94 <= got.num_layers < 118 and got.count("*") == 5
    assert count_params(got)["total"] == pick["params"] <= b["params"]
    hf = AutoModelForCausalLM.from_pretrained(out).float().eval()
    ids = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, load_model(out)(ids), atol=2e-4, rtol=1e-4)
