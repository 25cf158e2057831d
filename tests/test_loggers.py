"""TensorBoard (--log-dir) and W&B (--wandb-project) logging of train / distill (issue 59, item 7): what reaches
the writer equals the run's own history and evaluations; a missing package is one line naming the flag, before
anything is written. The packages are optional (not installed here): fakes in sys.modules record the calls."""
import gzip
import json
import sys
import types

import pytest

from remodel import cli
from remodel.models.config import ModelConfig
from remodel.models.model import HybridLM, init_weights
from remodel.pipelines.data.data import embedded_corpus
from remodel.pipelines.training.train import train
from tests.conftest import write_checkpoint


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("loggers")
    with gzip.open(embedded_corpus()[0], "rt", encoding="utf-8") as f:
        lines = [x for x in f.read().splitlines() if x.strip()]
    (d / "train.txt").write_text("\n".join(lines[:400]) + "\n")
    (d / "valid.txt").write_text("\n".join(lines[-100:]) + "\n")
    for name, H, seed in (("student", 16, 0), ("teacher", 24, 1)):
        cfg = ModelConfig(vocab_size=2048, hidden_size=H, pattern="M*-", tie_word_embeddings=True,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=2 * H,
                          mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, chunk_size=16)
        write_checkpoint(init_weights(HybridLM(cfg), seed=seed), d / name)
    return d


def kwargs(work, out, **kw):
    return {**dict(student_dir=str(work / "student"), teacher_dir=str(work / "teacher"), out=str(out),
                   data=str(work / "train.txt"), steps=4, seq_len=32, batch=2, lr=3e-3, warmup=1, log_every=0,
                   eval_data=str(work / "valid.txt"), eval_tokens=256), **kw}


class FakeWriter:
    made = []

    def __init__(self, log_dir):
        self.log_dir, self.scalars, self.closed = log_dir, [], 0
        FakeWriter.made.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed += 1


def test_tensorboard_gets_the_history(work, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    FakeWriter.made = []
    rep = train(**kwargs(work, tmp_path / "out", log_dir=str(tmp_path / "tb")))
    (w,) = FakeWriter.made
    assert w.log_dir == str(tmp_path / "tb") and w.closed == 1
    got = {(tag, step): v for tag, v, step in w.scalars}
    hist = rep["history"]
    assert [s for t, s in got if t == "train/loss"] == [1, 2, 3, 4]
    for r in hist:
        for k in ("loss", "kl", "lr", "grad_norm", "tokens_per_s"):
            assert got[(f"train/{k}", r["step"])] == pytest.approx(r[k], rel=1e-12), (k, r["step"])
    assert got[("eval/loss", 0)] == pytest.approx(rep["eval"]["before"]["loss"], rel=1e-12)
    assert got[("eval/ppl", 4)] == pytest.approx(rep["eval"]["after"]["ppl"], rel=1e-12)


def test_wandb_gets_the_history_from_the_cli(work, tmp_path, monkeypatch, capsys):
    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", dict(values), step))

        def finish(self):
            calls.append(("finish",))

    def init(project, config, name):
        calls.append(("init", project, config, name))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    out = tmp_path / "out"
    assert cli.main(["distill", "--teacher", str(work / "teacher"), "--student", str(work / "student"), str(out),
                     "--data", str(work / "train.txt"), "--steps", "3", "--seq-len", "32", "--batch", "2",
                     "--log-every", "0", "--wandb-project", "remodel-test"]) == 0
    capsys.readouterr()
    rep = json.loads((out / "remodel_report.json").read_text())
    assert calls[0][:2] == ("init", "remodel-test") and calls[0][2]["steps"] == 3 and calls[0][3] == "out"
    logs = [c for c in calls if c[0] == "log"]
    assert [c[2] for c in logs] == [1, 2, 3] and calls[-1] == ("finish",)
    for c, r in zip(logs, rep["history"]):
        assert c[1]["train/loss"] == pytest.approx(r["loss"], rel=1e-12) and c[1]["train/lr"] == r["lr"]


@pytest.mark.parametrize("flag, module", [("--log-dir", "torch.utils.tensorboard"), ("--wandb-project", "wandb")])
def test_missing_package_is_one_line(work, tmp_path, monkeypatch, capsys, flag, module):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as when the package is not installed
    out = tmp_path / "out"
    assert cli.main(["distill", "--teacher", str(work / "teacher"), "--student", str(work / "student"), str(out),
                     "--data", str(work / "train.txt"), "--steps", "2", flag, str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and flag in err and "pip install" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_real_tensorboard_event_file(work, tmp_path):
    pytest.importorskip("tensorboard")
    train(**kwargs(work, tmp_path / "out", log_dir=str(tmp_path / "tb"), eval_data=None))
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
