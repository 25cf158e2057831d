"""Baseline scores (compress/baselines.py) and the quality claim of activation importance.

1. magnitude scores against a direct per-unit computation; streamed from a checkpoint == from a state
   dict; random scores seeded; both go through `score(method=...)` -> `prune` with the expected shapes.
2. On the embedded model (256 x 256 train-split calibration tokens, 16,384 held-out tokens),
   activation scores give a lower held-out perplexity than the best of three random selections for
   FFN -25% / -50%, Mamba heads -25%, hidden -50% and dropping 2 of 8 layers, and than magnitude for
   hidden -50%. Mamba heads -50% is asserted only below the random mean: random seed 0 keeps a better
   pair of layer-0 heads (here 87.57 vs best seed 85.59, mean 91.13), and layer 0 alone decides that
   case (bench/bench_prune_head_swaps.py, bench/RESULTS.md "Pruning quality")."""
from pathlib import Path

import pytest
import torch

from remodel.compress.baselines import magnitude_scores, random_scores, score_shapes
from remodel.compress.importance import score_model
from remodel.compress.prune import plan_keep, prune_model
from remodel.compress.scores import load_scores
from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.load import load_config, load_model, save_model
from remodel.pipelines.commands.prune import prune
from remodel.pipelines.commands.score import score
from tests.conftest import random_model

REPO = Path(__file__).resolve().parents[1]
EMBEDDED = REPO / "data" / "embedded"
CFG = ModelConfig(vocab_size=64, hidden_size=32, pattern="M*-EM-", num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=4, n_groups=2,
                  ssm_state_size=8, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=16, moe_shared_expert_intermediate_size=16)


@pytest.fixture(autouse=True, scope="module")
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


@torch.no_grad()
def make_model(cfg=CFG, seed=0):
    """Norm gains far from 1: they must show in the hidden scores."""
    return random_model(cfg, seed, std=0.2, gain=0.5, noise_seed=seed + 1)


def sq(t):
    return t.double().square().sum()


def test_magnitude_scores_equal_direct_computation():
    m = make_model()
    cfg, W = m.cfg, dict(m.state_dict())
    s = magnitude_scores(cfg, W.items())
    assert {k: tuple(v.shape) for k, v in s.items()} == {k: v for k, v in score_shapes(cfg).items()
                                                        if k != "loss_increase"}
    Im, nh, hd, GN = cfg.mamba_inner, cfg.mamba.mamba_num_heads, cfg.mamba.mamba_head_dim, cfg.mamba.n_groups * cfg.mamba.d_state
    for i, c in enumerate(cfg.pattern):
        p = f"layers.{i}.mixer."
        if c == "-":
            up, down = W[p + "up_proj.weight"], W[p + "down_proj.weight"]
            want = torch.stack([(sq(up[j]) + sq(down[:, j])).sqrt() for j in range(cfg.mlp.intermediate_size)])
            torch.testing.assert_close(s[f"layers.{i}.ffn"].double(), want, rtol=1e-5, atol=0)
        elif c == "M":
            ip, op = W[p + "in_proj.weight"], W[p + "out_proj.weight"]
            for h in range(nh):
                ch = slice(h * hd, (h + 1) * hd)
                want = (sq(ip[ch]) + sq(ip[Im:][ch]) + sq(ip[2 * Im + 2 * GN + h]) + sq(op[:, ch])).sqrt()
                assert abs(s[f"layers.{i}.mamba_x"][h].double().norm() - want) <= 1e-5 * want
        elif c == "*":
            q, o = W[p + "q_proj.weight"], W[p + "o_proj.weight"]
            for h in range(cfg.attention.num_attention_heads):
                ch = slice(h * cfg.attention.head_dim, (h + 1) * cfg.attention.head_dim)
                want = (sq(q[ch]) + sq(o[:, ch])).sqrt()
                assert abs(s[f"layers.{i}.attn"][h].double().norm() - want) <= 1e-5 * want
        else:
            ex = m.layers[i].mixer.experts
            for e in range(cfg.moe.n_routed_experts):
                want = (sq(ex.up_proj[e]) + sq(ex.down_proj[e])).sqrt()
                assert abs(s[f"layers.{i}.experts"][e].double() - want) <= 1e-5 * want
    # hidden channel c: writers' rows, readers' columns times the gain of the norm in front of them
    H = torch.zeros(cfg.hidden_size, dtype=torch.float64)
    H += W["embeddings.weight"].double().square().sum(0)
    H += (W["lm_head.weight"].double() * W["norm_f.weight"].double()).square().sum(0)
    for i, block in enumerate(m.layers):
        g = block.norm.weight.double()
        for name, mod in block.mixer.named_modules():
            if isinstance(mod, torch.nn.Linear):
                if name.endswith(("out_proj", "o_proj", "down_proj")):  # writes to the residual stream
                    H += mod.weight.double().square().sum(1)
                else:
                    H += (mod.weight.double() * g).square().sum(0)
        if block.kind == "E":
            H += (block.mixer.gate.weight.double() * g).square().sum(0)
            H += (block.mixer.experts.up_proj.double() * g).square().sum((0, 1))
            H += block.mixer.experts.down_proj.double().square().sum((0, 2))
    torch.testing.assert_close(s["hidden"].double(), H.sqrt(), rtol=1e-5, atol=0)
    writers = {"M": "out_proj", "*": "o_proj", "-": "down_proj"}
    for i, c in enumerate(cfg.pattern):
        mix = m.layers[i].mixer
        want = (sq(mix.experts.down_proj) + sq(mix.shared_experts.down_proj.weight) if c == "E"
                else sq(getattr(mix, writers[c]).weight)).sqrt()
        assert abs(s["block_importance"][i].double() - want) <= 1e-5 * want


def test_baseline_scores_through_score_and_prune(tmp_path):
    m = make_model()
    src = save_model(m, tmp_path / "src", dtype=torch.float32)
    (src / "tokenizer_config.json").write_text("{}")
    mag = score(src, None, tmp_path / "mag", method="magnitude", progress=False)
    tensors, meta = load_scores(tmp_path / "mag")
    assert meta["method"] == "magnitude" and mag["method"] == "magnitude"
    direct = magnitude_scores(m.cfg, m.state_dict().items())
    assert tensors.keys() == direct.keys()
    for k in direct:  # streamed from the checkpoint == from the state dict
        torch.testing.assert_close(tensors[k], direct[k], rtol=1e-6, atol=0)
    score(src, None, tmp_path / "r1", method="random", seed=1)
    score(src, None, tmp_path / "r1b", method="random", seed=1)
    score(src, None, tmp_path / "r2", method="random", seed=2)
    r1, r1b, r2 = (load_scores(tmp_path / n)[0] for n in ("r1", "r1b", "r2"))
    act, _ = score_model(m, [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))])
    assert {k: v.shape for k, v in r1.items()} == {k: v.shape for k, v in act.items()}  # the activation contract
    assert all(torch.equal(r1[k], r1b[k]) for k in r1) and not torch.equal(r1["hidden"], r2["hidden"])
    assert all(((v >= 0) & (v < 1)).all() for v in r1.values())
    with pytest.raises(RemodelError, match="unknown scoring method"):
        score(src, None, tmp_path / "bad", method="wanda")
    assert not (tmp_path / "bad").exists()

    targets = dict(hidden_size=24, ffn_size=24, mamba_heads=4, attn_heads=2, experts=4, expert_ffn_size=8,
                   shared_expert_size=8)
    for name in ("mag", "r1"):
        prune(src, tmp_path / f"pruned_{name}", tmp_path / name, **targets)
        cfg = load_config(tmp_path / f"pruned_{name}")
        assert (cfg.hidden_size, cfg.mlp.intermediate_size, cfg.mamba.mamba_num_heads, cfg.attention.num_attention_heads,
                cfg.moe.n_routed_experts, cfg.moe.moe_intermediate_size, cfg.moe.moe_shared_expert_intermediate_size,
                cfg.pattern) == (24, 24, 4, 2, 4, 8, 8, CFG.pattern)
        out = load_model(tmp_path / f"pruned_{name}")(torch.randint(0, 64, (1, 12)))
        assert out.shape == (1, 12, 64) and out.isfinite().all()
    # magnitude scores carry no loss_increase: depth pruning drops the smallest output projection
    rep = prune(src, tmp_path / "pruned_depth", tmp_path / "mag", num_layers=5)
    assert rep["depth_metric"] == "block_importance"
    assert rep["dropped_layers"] == [int(load_scores(tmp_path / "mag")[0]["block_importance"].argmin())]


def test_activation_beats_random_on_the_embedded_model():
    from transformers import AutoTokenizer

    from remodel.pipelines.data.data import batches, embedded_corpus, load_texts, pack
    from remodel.pipelines.training.evaluate import evaluate

    train, valid = embedded_corpus()
    tok = AutoTokenizer.from_pretrained(str(EMBEDDED))
    calib = pack(load_texts(train), tok, 256, max_tokens=256 * 256)
    # 16,384 held-out tokens: the smallest margin under the bound is 0.6% (Mamba -25%: 59.23 vs seed 0's 59.57)
    held_out = pack(load_texts(valid), tok, 256, max_tokens=16384)
    model = load_model(EMBEDDED)
    cfg = model.cfg
    act, _ = score_model(model, list(batches(calib, 8)), loss_increase=True, loss_batches=1)
    mag = magnitude_scores(cfg, model.state_dict().items())

    def ppl(scores, targets):
        pruned = prune_model(model, plan_keep(cfg, scores, targets))
        return evaluate(pruned, held_out, seq_len=256, batch=16)["ppl"]

    base = evaluate(model, held_out, seq_len=256, batch=16)["ppl"]
    mamba_half = {"mamba_heads": cfg.mamba.mamba_num_heads // 2}
    for targets in ({"ffn_size": cfg.mlp.intermediate_size * 3 // 4}, {"ffn_size": cfg.mlp.intermediate_size // 2},
                    {"mamba_heads": cfg.mamba.mamba_num_heads * 3 // 4}, mamba_half, {"hidden_size": cfg.hidden_size // 2},
                    {"num_layers": cfg.num_layers - cfg.num_layers // 4}):
        a = ppl(act, targets)
        rnd = [ppl(random_scores(cfg, seed), targets) for seed in range(3)]
        # Mamba heads -50%: below the random mean, not below every seed (seed 0 keeps a better pair of
        # layer-0 heads; layer 0 decides this case, bench/RESULTS.md "Pruning quality"). Measured with the heads
        # read at out_proj's input (issue 55; base 50.90): -25% 59.23 (activation_in, the old site, 58.61;
        # magnitude 58.61; random seeds 0-4 59.57 60.30 59.62 61.88 62.29), -50% 86.996 (activation_in 87.62,
        # magnitude 89.92, random 85.62 94.10 93.79 92.77 101.34)
        bound = sum(rnd) / len(rnd) if targets is mamba_half else min(rnd)
        assert base < a < bound, (targets, base, a, rnd)
        if "hidden_size" in targets:
            assert a < 0.95 * ppl(mag, targets), (targets, a)
