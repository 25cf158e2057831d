"""Issue 57's acceptance on a Qwen3 source through the CLI: a Qwen3 (per-head q/k norms) trained here and saved
by transformers, `remodel hybridize --mixer gdn --keep-attention 1` writes a qwen3_5_text model transformers loads
with exactly one attention layer, and after the same distillation steps --init attention ends below --init random
on held-out text."""
from __future__ import annotations

import json

import pytest

from remodel.cli import main
from remodel.models.config import ModelConfig
from remodel.models.model import HybridLM, init_weights
from remodel.pipelines.data.data import embedded_tokenizer_path
from remodel.pipelines.training import train as T
from remodel.pipelines.training.evaluate import evaluate
from tests.conftest import corpus_split, loaded_as, write_checkpoint


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A 4-layer Qwen3 (hidden 32, 4 query / 2 KV heads of 8, q/k norms) trained here 300 steps on the embedded
    corpus, then loaded and saved again by transformers (the checkpoint a user brings)."""
    d = tmp_path_factory.mktemp("hybq3")
    corpus_split(d)
    cfg = ModelConfig(vocab_size=2048, hidden_size=32, pattern="*-" * 4, tie_word_embeddings=True,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                      mlp_act="silu", mlp_gated=True, rope_theta=10000.0, qk_norm=True)
    write_checkpoint(init_weights(HybridLM(cfg), seed=3), d / "src")
    T.train(str(d / "src"), str(d / "trained"), data=str(d / "train.txt"), steps=300, seq_len=32, batch=8, warmup=5,
            lr=2e-2, log_every=0, checkpoint_every=1000)
    hf = loaded_as(d / "trained", "Qwen3ForCausalLM")
    hf.save_pretrained(str(d / "user"))
    for f in embedded_tokenizer_path().iterdir():
        (d / "user" / f.name).write_bytes(f.read_bytes())
    return d


def test_qwen3_gdn_attention_init_beats_random_through_the_cli(qwen3):
    """--mixer gdn, one attention layer of four kept, 40 distillation steps per arm through `remodel hybridize`.
    Measured (2-core VM, 2026-12-06) on the disjoint held-out split (tests/conftest.py corpus_split): source 5.508,
    attention 5.5454 vs random 5.6222 (0.0769); before, with the held-out lines also trained on (source 5.399): --seed 0 attention 5.4249 vs random 5.4954 (margin 0.0705);
    --seed 1 attention 5.4293 vs random 5.4952 (0.0660). The assertion asks under a third of the smaller. The kept
    layer is the evenly spaced one (--select even): with the default --select kl both inits ended level (attention
    5.4034, random 5.4024): kl keeps the layer this small source leans on, and the layers it replaces cost little
    whichever way they start."""
    d = qwen3

    def distilled(init):
        out = d / f"gdn_{init}"
        main(["hybridize", str(d / "user"), str(out), "--mixer", "gdn", "--keep-attention", "1", "--select", "even",
              "--init", init, "--data", str(d / "train.txt"), "--steps", "40", "--seq-len", "32", "--batch", "8", "--lr", "5e-3",
              "--seed", "0"])
        hf = loaded_as(out, "Qwen3_5ForCausalLM")
        kinds = json.loads((out / "config.json").read_text())["layer_types"]
        assert kinds.count("full_attention") == 1 and len(hf.model.layers) == 4
        return evaluate(out, d / "valid.txt", seq_len=32, batch=16, max_tokens=4096)["loss"]

    src = evaluate(d / "user", d / "valid.txt", seq_len=32, batch=16, max_tokens=4096)["loss"]
    att, rnd = distilled("attention"), distilled("random")
    print(f"Qwen3 source {src:.4f}; GDN after 40 steps: attention {att:.4f}, random {rnd:.4f}, margin {rnd - att:.4f}")
    assert rnd - att > 0.02
