"""`remodel hybridize` takes distill's training options (issue 57): every TrainConfig flag train / distill expose
(pipelines.training.train_config, generated: one definition each) and --tokens reach the trainer, seen in the run's
files; under `torchrun` rank 0 alone converts and writes OUT.init (and measures --select kl), then every rank runs
both stages through the trainer, equal to one process: per-step losses within 1e-5, the same tensors.

This file is also the torchrun worker: `torchrun --nproc-per-node 2 tests/test_hybridize_cli_train.py DIR ARGV...`
runs cli.main(ARGV) on each rank, logging each rank's save of a converted model to DIR/saves.txt.
"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]


def worker(d: Path, argv: list) -> int:
    """One torchrun rank: cli.main(argv), the conversion's save logged (its rank) in d/saves.txt."""
    import torch
    torch.set_num_threads(1)
    from remodel import cli
    from remodel.pipelines.commands import hybridize as H
    save = H.write_hybrid

    def logged(*a, **kw):
        with open(d / "saves.txt", "a") as f:
            f.write(f"{os.environ.get('RANK')}\n")
        return save(*a, **kw)
    H.write_hybrid = logged  # in this worker only
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(worker(Path(sys.argv[1]), sys.argv[2:]))


import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from remodel.cli import main  # noqa: E402
from remodel.models.config import ModelConfig  # noqa: E402
from remodel.models.model import HybridLM, init_weights  # noqa: E402
from remodel.pipelines.commands.hybridize import hybridize  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus  # noqa: E402
from tests.conftest import write_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return _source(tmp_path_factory.mktemp("hybcli"))


@pytest.fixture(scope="module")
def src_mp(tmp_path_factory):
    """The torchrun tests' own copy (a fixture shared with a serial test would make every user serial)."""
    return _source(tmp_path_factory.mktemp("hybcli_mp"))


def _source(d: Path) -> Path:
    """A tiny Llama-like source (4 attention layers) with confident predictions (logits std ~3: the hybrid's KL
    is far above rounding noise), and training / held-out text."""
    with gzip.open(embedded_corpus()[0], "rt", encoding="utf-8") as f:
        lines = [x for x in f.read().splitlines() if x.strip()]
    (d / "train.txt").write_text("\n".join(lines[:400]) + "\n")
    (d / "eval.txt").write_text("\n".join(lines[400:500]) + "\n")
    cfg = ModelConfig(vocab_size=2048, hidden_size=32, pattern="*-" * 4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, intermediate_size=64, mlp_act="silu", mlp_gated=True, rope_theta=10000.0)
    model = init_weights(HybridLM(cfg), seed=2)
    with torch.no_grad():
        model.norm_f.weight.fill_(30.0)  # the KL of the initialised hybrid ~0.03 (at 1: ~4e-5, rounding's scale)
    write_checkpoint(model, d / "src")
    return d


def _report(out: Path) -> dict:
    return json.loads((out / "remodel_report.json").read_text())


def test_tokens_and_train_flags_reach_the_trainer(src, tmp_path, capsys):
    """--tokens 300 at 4 x 32 tokens a step is 3 steps; --warmup 2 halves step 1's lr; --eval-data /
    --eval-tokens evaluate 64 held-out tokens before and after; --checkpoint-every 2 --keep-last 0 keeps
    steps 2 and 3 in OUT.run/; --hidden-loss-weight adds the hidden term."""
    torch.set_num_threads(1)
    out = tmp_path / "out"
    argv = ["hybridize", str(src / "src"), str(out), "--keep-layers", "1", "--data", str(src / "train.txt"),
            "--tokens", "300", "--seq-len", "32", "--batch", "4", "--lr", "1e-3", "--warmup", "2", "--eval-data",
            str(src / "eval.txt"), "--eval-tokens", "64", "--checkpoint-every", "2", "--keep-last", "0",
            "--hidden-loss-weight", "0.5", "--log-every", "0"]
    assert main(argv) == 0, capsys.readouterr().err
    rep = _report(out)
    assert rep["steps"] == 3 and rep["tokens"] == 3 * 4 * 32
    lrs = [h["lr"] for h in rep["history"]]
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3), lrs
    assert all(h["hidden"] > 0 for h in rep["history"]), rep["history"]
    assert {k: rep["eval"][k]["tokens"] for k in ("before", "after")} == {"before": 64, "after": 64}
    assert rep["eval"]["after"]["loss"] != rep["eval"]["before"]["loss"]
    assert sorted(p.name for p in (tmp_path / "out.run").glob("step-*")) == ["step-000002", "step-000003"]


def test_bad_training_flags_fail_in_one_line_before_any_work(src, tmp_path, capsys):
    base = ["hybridize", str(src / "src"), str(tmp_path / "out"), "--keep-layers", "1", "--data", str(src / "train.txt")]
    for extra, words in ((["--steps", "2", "--tokens", "300"], ("--steps", "--tokens")),
                         (["--steps", "2", "--warmup", "-1"], ("--warmup",)),
                         (["--tokens", "0"], ("--tokens",)),
                         (["--steps", "2", "--tp", "2"], ("torchrun",))):
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and all(w in err for w in words), (extra, err)
        assert not list(tmp_path.iterdir()), extra
    with pytest.raises(Exception, match="steps"):  # the Python API's train dict cannot set hybridize's own
        hybridize(src / "src", tmp_path / "out", keep_layers=[1], data=str(src / "train.txt"), steps=1,
                  train=dict(steps=3))
    assert not list(tmp_path.iterdir())


def _launch(d: Path, argv: list, **env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(HERE), str(d),
           *argv]
    path = os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path, **env}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.multiprocess
def test_torchrun_dp2_equals_one_process_and_converts_once(src_mp, tmp_path):
    """--select kl, stage one and stage two under torchrun (2 processes, --tp 1: data parallel 2) against the
    same command in one process: OUT.init written once (by rank 0) and equal bit for bit, every per-step loss
    term within 1e-5, OUT.transfer's and OUT's tensors within 5e-6 while training moved them by over 1e-4. Stage
    one runs --transfer-target stream here (teacher forcing moves these weights under 1e-4 in 2 steps; its data
    parallel run == one process is tests/test_hybridize_transfer.py's)."""
    torch.set_num_threads(1)
    flags = ["--select", "kl", "--keep-attention", "2", "--samples", "4", "--data", str(src_mp / "train.txt"),
             "--transfer-steps", "2", "--transfer-target", "stream", "--steps", "3", "--seq-len", "32", "--batch", "4",
             "--lr", "1e-4", "--warmup", "1", "--checkpoint-every", "2", "--log-every", "0", "--tp", "1"]
    par, ref = tmp_path / "par", tmp_path / "ref"
    p = _launch(tmp_path, ["hybridize", str(src_mp / "src"), str(par), *flags])
    try:
        assert main(["hybridize", str(src_mp / "src"), str(ref), *flags]) == 0
        stdout, stderr = p.communicate(timeout=400)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, stderr[-4000:]
    assert (tmp_path / "saves.txt").read_text().split() == ["0"]  # converted and written once, by rank 0
    assert stdout.count('"command": "hybridize"') == 1, stdout  # rank 0 alone reports
    for suffix in (".transfer", ""):
        got, want = _report(Path(f"{par}{suffix}")), _report(Path(f"{ref}{suffix}"))
        assert got["parallel"]["dp"] == 2 and len(got["history"]) == len(want["history"]) > 0
        for g, w in zip(got["history"], want["history"]):
            for k in ("loss", "kl", "lm", "hidden", "grad_norm"):
                if w.get(k) is not None:
                    assert _rel(g[k], w[k]) <= 1e-5, (suffix, g["step"], k, g[k], w[k])
    init = load_file(Path(f"{ref}.init") / "model.safetensors")
    assert all(torch.equal(t, init[k]) for k, t in load_file(Path(f"{par}.init") / "model.safetensors").items())
    for suffix in (".transfer", ""):
        got, want = (load_file(Path(f"{d}{suffix}") / "model.safetensors") for d in (par, ref))
        assert got.keys() == want.keys() == init.keys()
        moved = max(float((want[k] - init[k]).abs().max()) for k in want)  # ~lr per Adam step
        worst = max(float((got[k] - want[k]).abs().max()) for k in want)
        print(f"{suffix or 'OUT'}: moved {moved:.3g}, max |parallel - one process| {worst:.3g}")
        assert moved > 1e-4, suffix  # training moved the weights 20x the tolerance: a sharding bug would show
        for k in want:  # measured <= 1.3e-6 (Adam's m / (sqrt(v) + eps) on tiny gradients, tests/test_train_parallel.py)
            assert torch.allclose(got[k], want[k], rtol=1e-5, atol=5e-6), (suffix, k)


@pytest.mark.multiprocess
def test_torchrun_rank0_conversion_error_is_one_line_on_every_rank(src_mp, tmp_path):
    """An input only rank 0's conversion meets (--select kl's --data gives no 32-token block): every rank stops
    with rank 0's error, one `remodel hybridize: error:` line in all, nothing written (the others do not wait)."""
    (tmp_path / "short.txt").write_text("too short\n")
    out = tmp_path / "par"
    p = _launch(tmp_path, ["hybridize", str(src_mp / "src"), str(out), "--select", "kl", "--keep-attention", "1",
                           "--data", str(tmp_path / "short.txt"), "--steps", "2", "--seq-len", "32", "--batch", "4"],
                REMODEL_DIST_WAIT_TIMEOUT="90")
    try:
        _, stderr = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    lines = [x for x in stderr.splitlines() if x.startswith("remodel hybridize")]
    assert p.returncode != 0 and len(lines) == 1, stderr[-3000:]
    assert "error:" in lines[0] and "fewer than one sequence of 32" in lines[0] and "rank 1" not in lines[0], lines
    assert "Timeout" not in stderr and "timed out" not in stderr, stderr[-3000:]
    assert not out.exists() and not Path(f"{out}.init").exists()


def test_resumed_select_kl_goes_on_with_the_measured_layers(src, tmp_path):
    """A --select kl run stopped after its conversion and resumed keeps the layers it measured (read back from
    OUT.init), not the evenly spaced ones: the same attention_kept and stage one's parameters."""
    torch.set_num_threads(1)
    kw = dict(select="kl", keep_attention=1, samples=4, data=str(src / "train.txt"), transfer_steps=1, seq_len=32,
              batch=4, train=dict(log_every=0))
    first = hybridize(src / "src", tmp_path / "out", **kw)
    even = hybridize(src / "src", tmp_path / "even", **dict(kw, select="even"))
    assert first["attention_kept"] != even["attention_kept"]  # else this test could not tell them apart
    for name in ("out", "out.run"):  # as if stopped before stage one ended: OUT.init and no output yet
        __import__("shutil").rmtree(tmp_path / name)
    again = hybridize(src / "src", tmp_path / "out", resume=True, **kw)
    assert again["kl_per_layer"] is None  # not measured again
    assert again["attention_kept"] == first["attention_kept"]
    assert again["transfer_trains"] == first["transfer_trains"]
