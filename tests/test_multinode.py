"""Multi-node launch as far as one machine can test it (issue 59, item 7): `remodel distill` started by two
torchrun agents as two "nodes" on localhost (--nnodes 2 --node-rank 0/1, one process each, c10d rendezvous, gloo),
i.e. data parallel 2 across nodes, equals one process: every step's loss terms and gradient norm within 1e-5
(relative) and the final weights within 1e-5 of each tensor's largest value (the tolerances of
tests/test_train_parallel.py, at its lr 1e-4). Rank 0 (node 0) writes OUT; the two agents share this disk as
nodes share a file system. README "Multi-node" gives the same command for real hosts (and SLURM)."""
import gzip
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from remodel.models.config import ModelConfig
from remodel.models.model import HybridLM, init_weights
from remodel.pipelines.data.data import embedded_corpus
from tests.conftest import write_checkpoint

REPO = Path(__file__).resolve().parents[1]
ARGS = ["--steps", "3", "--seq-len", "32", "--batch", "4", "--lr", "1e-4", "--warmup", "1", "--log-every", "0",
        "--hidden-loss-weight", "0.5", "--lm-loss-weight", "0.1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("multinode")
    with gzip.open(embedded_corpus()[0], "rt", encoding="utf-8") as f:
        lines = [x for x in f.read().splitlines() if x.strip()]
    (d / "train.txt").write_text("\n".join(lines[:400]) + "\n")
    for name, H, seed in (("student", 16, 0), ("teacher", 24, 1)):
        cfg = ModelConfig(vocab_size=2048, hidden_size=H, pattern="M*-", tie_word_embeddings=True,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=2 * H,
                          mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, chunk_size=16)
        model = init_weights(HybridLM(cfg), seed=seed)
        if name == "teacher":  # confident predictions (a KL far from 0), as tests/test_train_parallel.py's
            with torch.no_grad():
                model.embeddings.weight.mul_(10.0)
                model.norm_f.weight.fill_(1.0)
        write_checkpoint(model, d / name)
    return d


def _distill(d: Path, out: str) -> list[str]:
    return [str(REPO / "cli.py"), "distill", "--teacher", str(d / "teacher"), "--student", str(d / "student"),
            str(d / out), "--data", str(d / "train.txt"), *ARGS]


def _env() -> dict:
    path = os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}


def two_nodes(d: Path, timeout=300):
    """Two torchrun agents, node ranks 0 and 1, meeting at a c10d rendezvous on localhost."""
    port = _free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
               "--rdzv-id", "remodel-test", *_distill(d, "two_nodes")]
        log = open(d / f"node{node}.log", "w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO))
    t = time.time()
    try:
        rcs = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    print(f"\ntwo nodes: {time.time() - t:.1f} s, rc {rcs}")
    return rcs, "".join((d / f"node{n}.log").read_text()[-3000:] for n in (0, 1))


@pytest.mark.multiprocess
def test_two_nodes_equal_one_process(work):
    rcs, log = two_nodes(work)
    assert rcs == [0, 0], log
    one = subprocess.run([sys.executable, *_distill(work, "one")], capture_output=True, text=True, env=_env(),
                         cwd=REPO, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    rep = json.loads((work / "two_nodes" / "remodel_report.json").read_text())
    ref = json.loads((work / "one" / "remodel_report.json").read_text())
    p = rep["parallel"]
    assert (p["world"], p["dp"], p["tp"], p["backend"]) == (2, 2, 1, "gloo")
    assert rep["tokens"] == ref["tokens"] == 3 * 4 * 32 and min(r["kl"] for r in ref["history"]) > 0.1
    for got, want in zip(rep["history"], ref["history"], strict=True):
        for k in ("loss", "kl", "lm", "hidden", "grad_norm"):
            assert abs(got[k] - want[k]) <= 1e-5 * abs(want[k]), (k, got, want)
    w, w_ref = load_file(work / "two_nodes" / "model.safetensors"), load_file(work / "one" / "model.safetensors")
    w0 = load_file(work / "student" / "model.safetensors")
    assert w.keys() == w_ref.keys()
    worst = max(float((w[k].double() - w_ref[k].double()).abs().max() / w_ref[k].double().abs().max()) for k in w)
    moved = max(float((w_ref[k] - w0[k]).abs().max() / w_ref[k].abs().max()) for k in w0)
    assert worst <= 1e-5 and moved > 100 * 1e-5, (worst, moved)
