"""train_only: only the named parameters train (hybridize's stage one fits the new mixers alone); the rest is
frozen byte for byte, a prefix naming nothing is refused before any work."""
import gzip

import pytest
import torch
from safetensors.torch import load_file

from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.model import HybridLM, init_weights
from remodel.pipelines.data.data import embedded_corpus
from remodel.pipelines.training.train import train
from tests.conftest import write_checkpoint


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("train_only")
    with gzip.open(embedded_corpus()[0], "rt", encoding="utf-8") as f:
        lines = [x for x in f.read().splitlines() if x.strip()]
    (d / "train.txt").write_text("\n".join(lines[:600]) + "\n")
    for who, seed in (("student", 0), ("teacher", 1)):
        cfg = ModelConfig(vocab_size=2048, hidden_size=16, pattern="M*-", num_attention_heads=2,
                          num_key_value_heads=1, head_dim=8, intermediate_size=32, mamba_num_heads=4,
                          mamba_head_dim=8, ssm_state_size=8, chunk_size=16)
        write_checkpoint(init_weights(HybridLM(cfg), seed=seed), d / who)
    return d


def _run(work, out, **kw):
    torch.set_num_threads(1)
    args = dict(student_dir=str(work / "student"), teacher_dir=str(work / "teacher"), out=str(out),
                data=str(work / "train.txt"), steps=8, seq_len=32, batch=2, lr=1e-2, warmup=1, kl_weight=0.0,
                lm_loss_weight=0.0, hidden_loss_weight=1.0, checkpoint_every=8, keep_last=1, log_every=0)
    return train(**{**args, **kw})


def test_only_the_named_parameters_train(work, tmp_path):
    rep = _run(work, tmp_path / "out", train_only=["layers.0.mixer."])
    before = load_file(work / "student" / "model.safetensors")
    after = load_file(tmp_path / "out" / "model.safetensors")
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    mixer = {k for k in before if ".layers.0.mixer." in k or k.startswith("layers.0.mixer.")}
    assert mixer and changed and changed <= mixer, changed - mixer  # the rest bit for bit as loaded
    hidden = [r["hidden"] for r in rep["history"]]
    assert hidden[-1] < hidden[0] - 1e-3, hidden  # the trained mixer moves towards the teacher's states


@pytest.mark.parametrize("bad", [["layers.9.mixer."], [], "layers.0.mixer.", ["nope."]])
def test_a_prefix_naming_nothing_is_refused_before_any_work(work, tmp_path, bad):
    with pytest.raises(RemodelError, match="train_only"):
        _run(work, tmp_path / "out", train_only=bad)
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())
