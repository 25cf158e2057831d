"""`remodel hybridize --transfer-steps` (stage one, issue 57): the new mixers alone are fitted to the source's
residual stream after every layer, everything else frozen bit for bit; stage two then distils the result."""
from __future__ import annotations

import gzip

import pytest
import torch
from safetensors.torch import load_file

from remodel.cli import main
from remodel.models.config import ModelConfig
from remodel.models.model import HybridLM, init_weights
from remodel.pipelines.commands.hybridize import hybridize
from remodel.pipelines.data.data import embedded_corpus
from tests.conftest import write_checkpoint


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybt")
    with gzip.open(embedded_corpus()[0], "rt", encoding="utf-8") as f:
        lines = [x for x in f.read().splitlines() if x.strip()]
    (d / "train.txt").write_text("\n".join(lines[:400]) + "\n")
    cfg = ModelConfig(vocab_size=2048, hidden_size=32, pattern="*-" * 4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, intermediate_size=64, mlp_act="silu", mlp_gated=True, rope_theta=10000.0)
    write_checkpoint(init_weights(HybridLM(cfg), seed=2), d / "src")
    return d


def _tensors(d):
    return load_file(d / "model.safetensors")


def test_stage_one_trains_the_new_mixers_alone_then_stage_two_everything(src, tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "out"
    rep = hybridize(src / "src", out, keep_layers=[1], data=str(src / "train.txt"), transfer_steps=6, steps=2,
                    seq_len=32, batch=4, lr=1e-2, train=dict(warmup=1, log_every=0, checkpoint_every=100))
    assert rep["transfer"]["steps"] == 6 and rep["distillation"]["steps"] == 2
    init, one, two = (_tensors(p) for p in (tmp_path / "out.init", tmp_path / "out.transfer", out))
    new = {k for k in init if any(f"layers.{i}.mamba." in k for i in (0, 2, 3))}  # bamba's names of our mixers
    assert len(new) >= 3 * 4
    moved = {k for k in init if not torch.equal(init[k], one[k])}
    assert moved and moved <= new, sorted(moved - new)  # stage one: the kept attention, MLPs, norms as they were
    assert {k for k in init if not torch.equal(one[k], two[k])} - new  # stage two trains the rest too


def test_a_non_empty_transfer_folder_is_refused(src, tmp_path, capsys):
    mine = tmp_path / "out.transfer" / "notes.txt"
    mine.parent.mkdir()
    mine.write_text("a user's file")
    argv = ["hybridize", str(src / "src"), str(tmp_path / "out"), "--keep-layers", "1", "--data",
            str(src / "train.txt"), "--transfer-steps", "2", "--steps", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "out.transfer" in err and "--resume" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.transfer"] and mine.read_text() == "a user's file"


def test_transfer_steps_need_data(src, tmp_path, capsys):
    assert main(["hybridize", str(src / "src"), str(tmp_path / "out"), "--keep-layers", "1",
                 "--transfer-steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--transfer-steps" in err and "--data" in err, err
    assert not list(tmp_path.iterdir())


def test_stage_one_fits_the_q_k_norms_a_gated_deltanet_target_adds(src, tmp_path):
    """Into qwen3_5_text a Llama's kept attention gains q/k norms (not an identity): stage one trains them with
    the new mixers, nothing else; the report names what it trained."""
    torch.set_num_threads(1)
    out = tmp_path / "out"
    rep = hybridize(src / "src", out, mixer="gdn", keep_layers=[1], data=str(src / "train.txt"), transfer_steps=4,
                    seq_len=32, batch=4, lr=1e-2, train=dict(warmup=1, log_every=0, checkpoint_every=100))
    assert rep["to"] == "qwen3_5_text" and "layers.2.mixer.q_norm." in rep["transfer_trains"]
    init, one = _tensors(tmp_path / "out.init"), _tensors(out)
    moved = {k for k in init if not torch.equal(init[k], one[k])}
    kept = {k for k in moved if ".layers.1." in k}
    assert kept and all(k.endswith(("q_norm.weight", "k_norm.weight")) for k in kept), sorted(kept)
    assert all(".layers.1." in k or "linear_attn" in k for k in moved), sorted(moved)
