"""`remodel hybridize --data --steps` (stage two, issue 57): the hybrid distilled from its source by distill's
trainer; attention-initialised Mamba layers end at a lower held-out loss than random ones after the same steps;
stage one (--transfer-steps) alone closes most of the gap, and before stage two it helps.
Held-out text: the last 150 lines of the embedded training corpus, left out of training (tests/conftest.py
corpus_split). Until 2026-12-06 the "valid" lines were also trained on (the corpus has 1130 lines; train took the
first 1500); the figures in the docstrings below are from then unless marked otherwise. Re-measured on the disjoint
split (2-core VM, 2026-12-06, the final code): Mamba-2 attention vs random, means of 3 seeds, 5.7716 vs 5.7845
(0.0129); GDN 5.7717 vs 5.8014 (0.0297); KDA 5.7588 vs 5.8006 (0.0417); stage one 40 steps, layer 5.7791 vs
stream 5.7955 (initialised 6.2093). Every assertion holds on both."""
from __future__ import annotations

import json

import pytest

from remodel.models.config import ModelConfig
from remodel.models.model import HybridLM, init_weights
from remodel.pipelines.commands.hybridize import hybridize
from remodel.pipelines.training import train as T
from remodel.pipelines.training.evaluate import evaluate
from tests.conftest import corpus_split, write_checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4-layer Llama (hidden 32, 4 query / 2 KV heads of 8) trained here for 300 steps on the embedded corpus."""
    d = tmp_path_factory.mktemp("hybq")
    corpus_split(d)
    cfg = ModelConfig(vocab_size=2048, hidden_size=32, pattern="*-" * 4, tie_word_embeddings=True,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, mlp_act="silu", mlp_gated=True,
                      rope_theta=10000.0)
    write_checkpoint(init_weights(HybridLM(cfg), seed=2), d / "src")
    T.train(str(d / "src"), str(d / "trained"), data=str(d / "train.txt"), steps=300, seq_len=32, batch=8, warmup=5,
            lr=2e-2, log_every=0, checkpoint_every=1000)
    return d


def test_attention_init_beats_random_after_the_same_distillation(trained):
    """One attention layer of four kept (Mamba-2 into bamba), 40 distillation steps each (same data order, lr),
    the held-out loss averaged over seeds 0 / 1 / 2 of each init (a single seed is within the seed noise).
    Measured (2-core VM, 2026-12-06; source 5.491; each layer's fresh mixer from its own generator, layer_seed):
    --init random ended at 5.532 / 5.552 / 5.529 (seeds 3 / 4: 5.527 / 5.547), --init attention at
    5.532 / 5.516 / 5.527: means 5.538 and 5.525, a margin of 0.013. MambaInLlama with transformers' own z rows
    and D = 1 instead ended at 5.573 / 5.598 (worse than random: its random gate scrambles what O writes). The
    assertion asks a third of the margin."""
    d = trained

    def distilled(init, seed):
        out = d / f"hyb_{init}{seed}"
        rep = hybridize(d / "trained", out, keep_attention=1, select="even", init=init, seed=seed,
                        data=str(d / "train.txt"), steps=40, seq_len=32, batch=8, lr=5e-3,
                        train=dict(warmup=5, log_every=0, checkpoint_every=1000))
        assert rep["distillation"]["steps"] == 40 and (d / f"hyb_{init}{seed}.init" / "config.json").is_file()
        return evaluate(out, d / "valid.txt", seq_len=32, batch=16, max_tokens=4096)["loss"]

    att, rnd = (sum(distilled(init, seed) for seed in range(3)) / 3 for init in ("attention", "random"))
    print(f"held-out loss after 40 steps (mean of 3 seeds): attention {att:.4f}, random {rnd:.4f}, "
          f"margin {rnd - att:.4f}")
    assert rnd - att > 0.004


def test_stage_one_moves_the_hybrid_towards_the_source(trained):
    """--transfer-target stream. Measured (2-core VM, 2026-12-06; source 5.491, initialised hybrid 6.178): stage one alone, 40 steps, 5.527;
    40 distillation steps alone 5.532; 20 transfer + 40 distillation 5.500. At an equal budget (60 steps)
    distillation alone reached 5.501, transfer 20 + distillation 40 5.500 / 5.495 (seeds 0 / 1): about even.
    The assertions ask half of each measured gap: re-measured on the disjoint held-out split (module docstring)
    initialised 6.209, transfer 40 5.796, distillation 40 5.774, transfer 20 + distillation 40 5.763 (0.011)."""
    d = trained
    kw = dict(keep_attention=1, select="even", data=str(d / "train.txt"), seq_len=32, batch=8, lr=5e-3, transfer_target="stream",
              train=dict(warmup=5, log_every=0, checkpoint_every=1000))

    def loss(p):
        return evaluate(p, d / "valid.txt", seq_len=32, batch=16, max_tokens=4096)["loss"]

    hybridize(d / "trained", d / "t40", transfer_steps=40, **kw)
    init, one = loss(d / "t40.init"), loss(d / "t40")
    hybridize(d / "trained", d / "d40", steps=40, **kw)
    hybridize(d / "trained", d / "t20d40", transfer_steps=20, steps=40, **kw)
    two, both = loss(d / "d40"), loss(d / "t20d40")
    print(f"held-out loss: initialised {init:.4f}, transfer 40 {one:.4f}, distill 40 {two:.4f}, both {both:.4f}")
    assert init - one > 0.3
    assert two - both > 0.005


def _distilled(d, model_type: str, **kw) -> float:
    """Held-out loss of `trained` hybridized with `kw` and distilled 40 steps, checked to be written as model_type."""
    out = d / "_".join(str(v) for v in kw.values())
    hybridize(d / "trained", out, data=str(d / "train.txt"), steps=40, seq_len=32, batch=8, lr=5e-3,
              train=dict(warmup=5, log_every=0, checkpoint_every=1000), **kw)
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type
    return evaluate(out, d / "valid.txt", seq_len=32, batch=16, max_tokens=4096)["loss"]


def test_gdn_attention_init_beats_random_after_the_same_distillation(trained):
    """--mixer gdn, one attention layer of four kept (qwen3_5_text; the kept layer's new q/k norms unfitted), 40
    steps each. Measured (2-core VM, 2026-12-06; source 5.491, both hybrids 6.195 before training): --init random
    ended at 5.566 / 5.586 (seeds 0 / 1), --init attention at 5.514 / 5.512: margins 0.053 / 0.075, random's seeds
    0.020 apart. Alternatives measured on the same runs: transformers' random gate rows (z) 5.516 / 5.521 (silent z
    kept); decays near the linear form (a / b rows zero, A = 1e-3) 5.514 / 5.511 (level: transformers' kept).
    The assertion asks under a third of the smallest margin."""
    d = trained

    att, rnd = (_distilled(d, "qwen3_5_text", mixer="gdn", keep_attention=1, select="even", init=i)
                for i in ("attention", "random"))
    print(f"GDN held-out loss after 40 steps: attention {att:.4f}, random {rnd:.4f}, margin {rnd - att:.4f}")
    assert rnd - att > 0.015


def test_kda_attention_init_beats_random_after_the_same_distillation(trained):
    """--mixer kda, every layer replaced (kimi_linear holds no grouped-query attention), 40 steps each. The figures
    below trained the hybrid untied (its lm_head then a copy of the embedding); it now stays tied as the source (the
    copy written on export only): on the disjoint split, seed 0, attention 5.760 vs random 5.803 (margin 0.043,
    2026-12-06). Measured (2-core VM, 2026-12-06; source 5.491): --init random started at 6.240
    and ended at 5.550 / 5.544 / 5.542 (seeds 0 / 1 / 2), --init attention (transformers' gated norm weight, ones)
    started at 5.697 / 5.667 / 5.766 and ended at 5.500 / 5.501 / 5.511: margins 0.050 / 0.043 / 0.031. With the
    norm's weight zero (a silent start, 6.240) it ended at 5.544 / 5.542 (seeds 0 / 1): margins 0.006 / 0.002;
    zero g_b rows or near-linear decays moved it under 0.001 (upcycle.hybrid_kda). The assertion asks a third of
    the smallest margin."""
    d = trained

    att, rnd = (_distilled(d, "kimi_linear", mixer="kda", keep_attention=0, init=i) for i in ("attention", "random"))
    print(f"KDA held-out loss after 40 steps: attention {att:.4f}, random {rnd:.4f}, margin {rnd - att:.4f}")
    assert rnd - att > 0.01


def test_layer_transfer_against_stream_transfer(trained):
    """Stage one's two targets, 40 steps each (one attention layer of four kept, Mamba-2). Measured (2-core VM,
    2026-12-06; source 5.491, initialised 6.178): layer (teacher forcing, mean squared error of each layer's
    contribution) 5.522 / 5.534 (seeds 0 / 1), stream 5.527 / 5.529. Layer's loss measured otherwise: the squared
    error over the teacher contribution's norm 5.534 / 5.540 (and data-parallel ranks then disagree with one
    process), 1 - cos 5.571 / 5.575 (the norm left free). 20 transfer + 40 distillation steps: layer 5.499 /
    5.505, stream 5.500 / 5.495; 120 transfer steps: layer 5.491, stream 5.490. Gated DeltaNet, 40 steps: layer
    5.540 / 5.551 (1 - cos: 5.692), stream 5.515 / 5.526. Mamba-2's two targets are within the seeds' spread, so
    no margin either way is asserted: layer must take the hybrid most of the way (init - layer > 0.3, measured
    0.66) and stay within 0.03 of stream (measured 0.005 / 0.005; 1 - cos misses it by 0.044)."""
    d = trained
    kw = dict(keep_attention=1, select="even", data=str(d / "train.txt"), seq_len=32, batch=8, lr=5e-3, transfer_steps=40,
              train=dict(warmup=5, log_every=0, checkpoint_every=1000))

    def loss(p):
        return evaluate(p, d / "valid.txt", seq_len=32, batch=16, max_tokens=4096)["loss"]

    rep = hybridize(d / "trained", d / "tl40", **kw)
    hybridize(d / "trained", d / "ts40", transfer_target="stream", **kw)
    init, layer, stream = loss(d / "tl40.init"), loss(d / "tl40"), loss(d / "ts40")
    print(f"held-out loss: initialised {init:.4f}, transfer 40 layer {layer:.4f}, stream {stream:.4f}")
    assert rep["transfer_target"] == "layer"
    assert init - layer > 0.3 and abs(layer - stream) < 0.03
