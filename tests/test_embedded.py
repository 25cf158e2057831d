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

from models.checkpoint import CheckpointReader
from models.load import load_config, load_model
from pipelines.data import embedded_corpus, load_texts, pack

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
    heads_per_group, rem = divmod(cfg.mamba_num_heads, cfg.n_groups)
    assert heads_per_group >= 4 and heads_per_group % 4 == 0 and rem == 0  # 25% / 50% head pruning stays integral
    assert cfg.intermediate_size % 4 == 0 and cfg.hidden_size % 4 == 0
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
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
