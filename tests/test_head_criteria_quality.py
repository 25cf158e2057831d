"""The default head ranking (`activation_measured`: activation, GDN key-head groups by their measured cost over
the loss batches) against magnitude and 5 random seeds on the Gated DeltaNet heads of a Qwen3.5-shaped model
trained in the test (issue 55; bench/RESULTS.md "Head criteria: Gated DeltaNet"): 3 GDN + 1 attention layers, 4 key
x 8 value heads, hidden 96, STEPS steps, 4,096 calibration tokens. Held-out loss, measured here (nats): value heads
-50%: default 4.7813, magnitude 4.7874, best seed 4.8227; key groups -50%: default 4.7793, magnitude 4.8126, best
seed 4.8339, activation alone 4.7914; key groups -25%: default 4.7617, best seed 4.7678, magnitude 4.7592 (the one
cell magnitude wins on every small model tried, by 0.0004-0.0034: on the bench's hidden-128 model the default is
below it by 0.0154). The margins asserted are about half the measured ones."""
import pytest
import torch

from remodel.compress.baselines import weight_scores
from remodel.compress.head_loo import measured_scores
from remodel.compress.importance import score_model
from remodel.compress.prune import plan_keep, prune_model
from remodel.models.hf import config_from_hf
from remodel.models.model import HybridLM, init_weights
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path, load_texts, pack
from remodel.pipelines.training.evaluate import evaluate
from tests.conftest import train_lm

HF = dict(model_type="qwen3_5_text", vocab_size=2048, hidden_size=96, intermediate_size=192, num_hidden_layers=4,
          num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=4,
          linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
          layer_types=["linear_attention"] * 3 + ["full_attention"])
STEPS, BATCH, SEQ = 300, 8, 64
MARGIN = {"value -50%": (0.003, 0.02), "key -50%": (0.015, 0.02), "key -25%": (-0.01, 0.003)}  # vs magnitude, seeds
MEASURED = 0.005  # the measured key groups below activation alone at key -50% (measured 0.0121)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def trained():
    """(model trained STEPS steps on the train split, calibration blocks, held-out blocks)."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(embedded_tokenizer_path()))
    train, valid = embedded_corpus()
    blocks = pack(load_texts(train), tok, SEQ, max_tokens=(STEPS * BATCH + 64) * SEQ)
    model = init_weights(HybridLM(config_from_hf(HF)), std=0.02, seed=0)
    return train_lm(model, blocks, STEPS, BATCH), blocks[STEPS * BATCH:], pack(load_texts(valid), tok, SEQ, max_tokens=16384)


def test_default_beats_magnitude_and_random_on_gdn_heads(trained):
    model, calib, held_out = trained
    cfg, batches = model.cfg, list(calib.split(16))
    with torch.no_grad():
        act, _ = score_model(model, batches, loss_increase=False)
        default = measured_scores(model, act, batches)
    mag = weight_scores(cfg, "magnitude", model.state_dict().items())
    seeds = [weight_scores(cfg, "random", seed=s) for s in range(5)]

    def loss(scores, t):
        return evaluate(prune_model(model, plan_keep(cfg, scores, t)), held_out, seq_len=SEQ, batch=16)["loss"]

    cuts = {"value -50%": {"linear_value_heads": 4}, "key -50%": {"linear_key_heads": 2},
            "key -25%": {"linear_key_heads": 3}}
    for cut, t in cuts.items():
        d, (to_mag, to_seeds) = loss(default, t), MARGIN[cut]
        assert d < loss(mag, t) - to_mag, cut
        assert d < min(loss(s, t) for s in seeds) - to_seeds, cut
    key = cuts["key -50%"]
    assert loss(default, key) < loss(act, key) - MEASURED
