"""The shipped default checkpoint (data/embedded, made by data/train_embedded.py): loads in our model and
in transformers with the same logits, keeps its recorded held-out perplexity, and has the shape the
pruning experiments rely on."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from remodel.models.checkpoint import CheckpointReader
from remodel.models.load import load_config, load_model
from remodel.pipelines.data.data import embedded_corpus, load_texts, pack

EMBEDDED = Path(__file__).resolve().parents[1] / "data" / "embedded"
VOCAB = 2048


@pytest.fixture(scope="module")
def log():
    return json.loads((EMBEDDED / "train_log.json").read_text())


@pytest.fixture(scope="module")
def ours():
    torch.set_num_threads(2)
    return load_model(EMBEDDED)


@pytest.fixture(scope="module")
def slice_blocks(log):
    """The fixed held-out slice the training script recorded: the first tokens of the packed valid split."""
    tok = AutoTokenizer.from_pretrained(EMBEDDED)  # the tokenizer files shipped beside the weights
    s = log["slice"]
    blocks = pack(load_texts(embedded_corpus()[1]), tok, s["seq_len"], max_tokens=s["tokens"])
    assert blocks.shape == (s["blocks"], s["seq_len"])
    return blocks


def test_checkpoint_shape_suits_pruning(log):
    reader = CheckpointReader(EMBEDDED)
    assert reader.config["model_type"] == "nemotron_h"
    cfg = load_config(EMBEDDED)
    assert set(cfg.pattern) == {"M", "*", "-"} and cfg.vocab_size == VOCAB
    heads_per_group, rem = divmod(cfg.mamba.mamba_num_heads, cfg.mamba.n_groups)
    assert heads_per_group >= 4 and heads_per_group % 4 == 0 and rem == 0  # 25% / 50% head pruning stays integral
    assert cfg.mlp.intermediate_size % 4 == 0 and cfg.hidden_size % 4 == 0
    assert cfg.attention.num_attention_heads % cfg.attention.num_key_value_heads == 0
    assert not cfg.tie_word_embeddings and cfg.extra["eos_token_id"] == 0
    assert {reader.dtype(k) for k in reader.keys()} == {torch.bfloat16}
    n = sum(math.prod(reader.shape(k)) for k in reader.keys())
    assert n == log["params"] and 2e6 < n < 6e6
    assert (EMBEDDED / "model.safetensors").stat().st_size < 12e6
    tok = AutoTokenizer.from_pretrained(EMBEDDED)
    assert len(tok) == VOCAB and tok.eos_token_id == 0


def test_ours_and_transformers_agree(ours, slice_blocks):
    hf = AutoModelForCausalLM.from_pretrained(EMBEDDED, dtype=torch.float32).eval()
    x = slice_blocks[-2:, :128]  # held-out text
    with torch.no_grad():
        a, b = ours(x), hf(input_ids=x).logits
    assert a.shape == b.shape == (2, 128, VOCAB)
    assert (a - b).abs().max().item() < 1e-4
    assert a.std().item() > 1.0  # real, non-degenerate logits


def test_held_out_perplexity_matches_record(ours, slice_blocks, log):
    with torch.no_grad():
        losses = [F.cross_entropy(ours(x)[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
                  for x in slice_blocks.split(16)]
    ppl = math.exp(torch.cat(losses).double().mean().item())
    recorded = log["slice"]["ppl"]
    assert ppl < recorded * 1.05 and ppl > recorded / 1.05  # the log describes these weights
    assert ppl < VOCAB / 20  # far below a uniform model (ppl 2048)
    assert abs(log["valid_loss_transformers"] - log["valid_loss"]) < 1e-3


def test_load_does_not_import_dynamo():
    """Building a Mamba model on the meta device must not touch ops whose meta kernels import
    torch._dynamo (torch.arange did: +1.6 s on every command that loads a model)."""
    code = ("import sys, torch; from models.load import load_model; m = load_model(sys.argv[1]); "
            "assert m.layers[0].mixer.A_log.abs().sum() > 0; print('torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, str(EMBEDDED)], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"


# ---- the embedded MoE (data/embedded_moe, made by data/make_embedded_moe.py) ---------------------------

MOE_LOSS_MAX = 3.87  # measured 3.84458 (data/embedded_moe/train_log.json), 0.025 nats of margin


@pytest.fixture(scope="module")
def moe_log():
    from remodel.pipelines.data.data import embedded_moe_path
    return json.loads((embedded_moe_path() / "train_log.json").read_text())


@pytest.fixture(scope="module")
def moe():
    from remodel.pipelines.data.data import embedded_moe_path
    torch.set_num_threads(2)
    return load_model(embedded_moe_path())


def test_moe_is_the_trained_upcycle_of_the_dense_model(moe_log):
    """Same trunk as data/embedded with every MLP turned into an 8-expert top-4 MoE, bf16, a few MB."""
    from remodel.pipelines.data.data import embedded_moe_path
    path, dense = embedded_moe_path(), load_config(EMBEDDED)
    cfg = load_config(path)
    assert "E" in cfg.pattern and cfg.pattern == dense.pattern.replace("-", "E")
    assert (cfg.moe.n_routed_experts, cfg.moe.num_experts_per_tok) == (8, 4) and cfg.hidden_size == dense.hidden_size
    reader = CheckpointReader(path)
    fp32 = {k for k in reader.keys() if reader.dtype(k) != torch.bfloat16}  # the routers' bias stays fp32
    assert {k.rsplit(".", 1)[-1] for k in fp32} == {"e_score_correction_bias"} and len(fp32) == 3
    from remodel.models.params import count_params
    n = sum(math.prod(reader.shape(k)) for k in reader.keys())
    assert abs(count_params(cfg)["total"] - moe_log["params_total"]) < 2e3 and 4e6 < n < 6e6  # upcycle counts ~1.5k fewer
    assert count_params(cfg)["active"] < 0.75 * count_params(cfg)["total"]
    assert (path / "model.safetensors").stat().st_size < 12e6
    assert moe_log["tokens_trained"] >= 1_000_000


def test_moe_held_out_loss(moe, moe_log):
    """The whole valid split (55,040 tokens): the recorded loss, below the threshold and the dense start."""
    from remodel.pipelines.training.evaluate import evaluate
    blocks = pack(load_texts(embedded_corpus()[1]), AutoTokenizer.from_pretrained(EMBEDDED), 256)
    loss = evaluate(moe, blocks, batch=16)["loss"]
    assert abs(loss - moe_log["valid_loss"]) < 2e-3  # the log describes these weights
    assert loss < MOE_LOSS_MAX
    assert loss < moe_log["valid_loss_at_init"] - 0.02  # training improved on the dense start it upcycled


def test_moe_ours_and_transformers_agree(moe, slice_blocks):
    from remodel.pipelines.data.data import embedded_moe_path
    hf = AutoModelForCausalLM.from_pretrained(embedded_moe_path(), dtype=torch.float32).eval()
    x = slice_blocks[-2:, :128]
    with torch.no_grad():
        a, b = moe(x), hf(input_ids=x).logits
    assert a.shape == b.shape == (2, 128, VOCAB)
    assert (a - b).abs().max().item() < 1e-4
    assert a.std().item() > 1.0
