"""The default Mamba-2 head ranking against magnitude on a Nemotron-H-shaped model trained in the test (issue 55;
bench/bench_head_scores.py --model nemotron_h at hidden 64): data/embedded's layout with 3 Mamba layers of 16 heads
(dim 8) in 4 groups, STEPS steps. With half the heads removed the default (out_proj's input x its column norm)
gives a held-out loss below magnitude's by at least MARGIN. Measured here (nats; unpruned 4.9944): default
5.0798, `activation_in` (in_proj's x segment, the former default) 5.0995, magnitude 5.1180, random seeds 0-4
5.1343 5.1126 5.1199 5.2445 5.1340; at -25% 5.0137 / 5.0214 / 5.0278. Not a general claim; the same recipe at -50% (default vs magnitude):
hidden 64 / 150 steps 5.4012 vs 5.4238, hidden 128 / 300 steps 4.9437 vs 4.9514, but hidden 128 / 150 steps
5.2992 vs 5.2268 (the default loses by 0.072): the margin depends on the model."""
import json
from pathlib import Path

import pytest
import torch

from remodel.compress.baselines import weight_scores
from remodel.compress.importance import score_model
from remodel.compress.prune import plan_keep, prune_model
from remodel.models.hf import config_from_hf
from remodel.models.model import HybridLM, init_weights
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path, load_texts, pack
from remodel.pipelines.training.evaluate import evaluate
from tests.conftest import train_lm

EMBEDDED = Path(__file__).resolve().parents[1] / "data" / "embedded"

STEPS, BATCH, SEQ, HIDDEN = 300, 8, 64, 64
MARGIN = 0.02  # nats (measured 0.0382)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def nemotron_h() -> dict:
    """bench_head_scores.scratch_hf("nemotron_h", HIDDEN): data/embedded's config, 3 Mamba layers of 16 heads."""
    base = json.loads((EMBEDDED / "config.json").read_text())
    blocks = ["linear_attention", "mlp"] * 2 + ["full_attention", "mlp", "linear_attention", "mlp"]
    return dict(base, mamba_num_heads=16, n_groups=4, ssm_state_size=16, num_attention_heads=4, num_key_value_heads=2,
                layers_block_type=blocks, hidden_size=HIDDEN, intermediate_size=3 * HIDDEN,
                mamba_head_dim=HIDDEN // 8, head_dim=HIDDEN // 4)


def test_default_beats_magnitude_on_mamba_heads():
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(embedded_tokenizer_path()))
    train, valid = embedded_corpus()
    blocks = pack(load_texts(train), tok, SEQ, max_tokens=(STEPS * BATCH + 64) * SEQ)
    model = init_weights(HybridLM(config_from_hf(nemotron_h())), std=0.02, seed=0)
    cfg = model.cfg
    assert (cfg.pattern.count("M"), cfg.mamba.mamba_num_heads, cfg.mamba.n_groups) == (3, 16, 4)
    train_lm(model, blocks, STEPS, BATCH)
    held_out = pack(load_texts(valid), tok, SEQ, max_tokens=16384)
    with torch.no_grad():
        act, _ = score_model(model, list(blocks[STEPS * BATCH:].split(16)), loss_increase=False)
    mag = weight_scores(cfg, "magnitude", model.state_dict().items())

    def loss(scores):
        kept = plan_keep(cfg, scores, {"mamba_heads": 8})
        return evaluate(prune_model(model, kept), held_out, seq_len=SEQ, batch=16)["loss"]

    a, m = loss(act), loss(mag)
    assert a < m - MARGIN, (a, m)
