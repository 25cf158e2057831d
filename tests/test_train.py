"""Losses against independent float64 formulas; the trainer's resume exactness (SIGKILL, and a kill while
a checkpoint is being written), the frozen teacher, and distillation beating LM-only training."""
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.model import HybridLM, init_weights
from remodel.pipelines.training import losses as L
from remodel.pipelines.training import train as T
from remodel.pipelines.training import train_state as S
from remodel.pipelines.training import trainer as TR
from remodel.pipelines.training.dcp_storage import read_metadata as read_dcp_metadata
from remodel.pipelines.training.evaluate import evaluate
from tests.conftest import corpus_split, write_checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """2 threads on a shared 2-core machine can be 100x slower than 1 (OpenMP spinning); 1 thread in the
    test process and in its subprocesses also makes runs bit-comparable."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- losses against independent computations ---------------------------------------------------

def _f64_kl(s, t, T=1.0):
    p = torch.softmax(t.double() / T, -1)
    return (p * (torch.log_softmax(t.double() / T, -1) - torch.log_softmax(s.double() / T, -1))).sum(-1)


def test_kl_div_matches_torch_and_float64():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 5, 50, generator=g) * 3, torch.randn(3, 5, 50, generator=g) * 3
    mask = torch.rand(3, 5, generator=g) > 0.3
    for T_ in (1.0, 2.0):
        ref = F.kl_div(F.log_softmax(s / T_, -1), F.log_softmax(t / T_, -1), log_target=True,
                       reduction="none").sum(-1)
        assert torch.allclose(L.kl_div(s, t, T_), ref.mean(), atol=1e-6)
        want = _f64_kl(s, t, T_)[mask].mean()
        assert abs(L.kl_div(s, t, T_, mask=mask).item() - want.item()) < 1e-6
    assert L.kl_div(t, t).abs().item() < 1e-6
    t2 = t.clone()
    t2[..., :10] = float("-inf")  # teacher gives zero probability: no nan, same as the finite formula
    got = L.kl_div(s, t2)
    p = torch.softmax(t2.double(), -1)[..., 10:]
    want = (p * (p.log() - torch.log_softmax(s.double(), -1)[..., 10:])).sum(-1).mean()
    assert torch.isfinite(got) and abs(got.item() - want.item()) < 1e-6
    s.requires_grad_(True)
    L.kl_div(s, t2).backward()
    assert torch.isfinite(s.grad).all()


def test_topk_kl_buckets():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(4, 6, 30, generator=g) * 2, torch.randn(4, 6, 30, generator=g) * 2
    assert abs(L.topk_kl(s, t, 30, 1.5).item() - L.kl_div(s, t, 1.5).item()) < 1e-6  # k = V: plain KL
    k, T_ = 5, 1.5
    total = 0.0
    for st, tt in zip(s.double().reshape(-1, 30) / T_, t.double().reshape(-1, 30) / T_):
        idx = sorted(range(30), key=lambda i: -tt[i].item())[:k]
        rest = [i for i in range(30) if i not in idx]
        p, q = torch.softmax(tt, 0), torch.softmax(st, 0)
        pb = torch.cat([p[idx], p[rest].sum()[None]])
        qb = torch.cat([q[idx], q[rest].sum()[None]])
        total += (pb * (pb / qb).log()).sum().item()
    want = total / 24
    got = L.topk_kl(s, t, k, T_).item()
    assert abs(got - want) < 1e-6 and 0 < got < L.kl_div(s, t, T_).item()  # bucketing loses information


def test_lm_loss_masks_and_ignore_index():
    g = torch.Generator().manual_seed(2)
    logits, labels = torch.randn(2, 7, 11, generator=g), torch.randint(0, 11, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 4:] = False
    labels2 = labels.clone()
    labels2[0, 0] = -100
    lp = torch.log_softmax(logits.double(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    keep = mask.clone()
    keep[0, 0] = False
    want = -(lp[keep]).mean().item()
    assert abs(L.lm_loss(logits, labels2, mask).item() - want) < 1e-6
    assert abs(L.lm_loss(logits, labels).item() - F.cross_entropy(logits.view(-1, 11), labels.view(-1)).item()) < 1e-6


def test_hidden_cosine_loss_with_projection():
    g = torch.Generator().manual_seed(3)
    ss = [torch.randn(2, 5, 8, generator=g) for _ in range(3)]
    ts = [torch.randn(2, 5, 12, generator=g) for _ in range(4)]
    lmap = [(1, 1), (2, 3)]
    projs = torch.nn.ModuleList(torch.nn.Linear(8, 12, bias=False) for _ in lmap)
    got = L.hidden_cosine_loss(ss, ts, lmap, projs).item()
    want = 0.0
    for (i, j), pr in zip(lmap, projs):
        a = ss[i].double() @ pr.weight.double().T
        b = ts[j].double()
        cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
        want += (1 - cos).mean().item() / len(lmap)
    assert abs(got - want) < 1e-6
    same = [t.clone() for t in ts]
    assert L.hidden_cosine_loss(same, ts, [(0, 0), (3, 3)]).abs().item() < 1e-6
    assert abs(L.hidden_cosine_loss([-t for t in ts], ts, [(2, 2)]).item() - 2.0) < 1e-6


def test_load_balancing_and_z_loss():
    g = torch.Generator().manual_seed(4)
    E, k = 8, 2
    layers = [torch.randn(40, E, generator=g) * 2 for _ in range(3)]
    for kind in ("softmax", "sigmoid"):
        want = 0.0
        for lg in layers:
            lg = lg.double()
            counts = torch.zeros(E, dtype=torch.float64)
            for row in lg:
                for e in row.topk(k).indices:
                    counts[e] += 1
            probs = lg.softmax(-1) if kind == "softmax" else lg.sigmoid() / lg.sigmoid().sum(-1, keepdim=True)
            want += E * (counts / (40 * k) * probs.mean(0)).sum().item() / len(layers)
        assert abs(L.load_balancing_loss(layers, k, E, kind).item() - want) < 1e-6
    # perfectly balanced (uniform probabilities, every expert chosen equally often) -> 1
    flat = torch.zeros(E, E)
    assert abs(L.load_balancing_loss([flat], k, E, "softmax").item() - 1.0) < 1e-6
    # collapsed onto experts 0 and 1 -> about E / 2
    collapsed = torch.full((10, E), -30.0)
    collapsed[:, :2] = 0.0
    assert abs(L.load_balancing_loss([collapsed], k, E, "softmax").item() - E / 2) < 1e-3
    want_z = sum(torch.logsumexp(lg.double(), -1).pow(2).mean().item() for lg in layers) / 3
    assert abs(L.z_loss(layers).item() - want_z) < 1e-5


def test_lr_schedule():
    lrs = [TR.lr_at(s, 100, 1e-3, 1e-4, 10) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))  # warm-up rises
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # cosine falls
    assert lrs[55] == pytest.approx(0.55e-3, rel=1e-6)  # half-way: mean of lr and min_lr
    assert TR.lr_at(100, 100, 1e-3, 1e-4, 10) == pytest.approx(1e-4)


# ---- tiny models and data ---------------------------------------------------------------------

def tiny(path, H, pattern, seed):
    cfg = ModelConfig(vocab_size=2048, hidden_size=H, pattern=pattern, tie_word_embeddings=True,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=2 * H,
                      mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, chunk_size=16,
                      n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=H)
    return write_checkpoint(init_weights(HybridLM(cfg), seed=seed), path)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    corpus_split(d)
    tiny(d / "student", 16, "M*-E", seed=0)
    tiny(d / "teacher", 24, "M*-E", seed=1)
    return d


def kwargs(work, out, **kw):
    base = dict(student_dir=str(work / "student"), teacher_dir=str(work / "teacher"), out=str(out),
                data=str(work / "train.txt"), steps=6, seq_len=32, batch=2, grad_accum=2, lr=3e-3, warmup=2,
                hidden_loss_weight=0.5, lm_loss_weight=0.1, checkpoint_every=2, keep_last=2, log_every=0)
    base.update(kw)
    return base


SCRIPT = r"""
import json, os, sys, time
import torch
torch.set_num_threads(1)
from remodel.pipelines.training import train as T
from remodel.pipelines.training import train_state as S
kw, mode = json.loads(sys.argv[1]), sys.argv[2]
if mode == "stall_after_4":  # a slow process: the SIGKILL lands after the step-4 checkpoint, before step 5 ends
    write = S._write
    def slow(run_dir, step, *a, **k):
        r = write(run_dir, step, *a, **k)
        if step == 4:
            time.sleep(600)
        return r
    S._write = slow
if mode == "die_writing_4":  # dies with the DCP files of step 4 on disk but not its meta.json
    write_meta = S._write_meta
    def die(tmp, meta):
        if meta["step"] == 4:
            os._exit(3)
        write_meta(tmp, meta)
    S._write_meta = die
T.train(**kw)
"""


def spawn(kw, mode, log):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", SCRIPT, json.dumps(kw), mode], cwd=REPO, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def crashed(work):
    """Two runs started together: one SIGKILLed after its step-4 checkpoint, one dying while writing it."""
    torch.set_num_threads(1)
    killed = spawn(kwargs(work, work / "killed"), "stall_after_4", work / "killed.log")
    torn = spawn(kwargs(work, work / "torn"), "die_writing_4", work / "torn.log")
    deadline = time.time() + 240
    while not (work / "killed.run" / "step-000004").is_dir():
        assert killed.poll() is None, (work / "killed.log").read_text()[-3000:]
        assert time.time() < deadline, "no step-4 checkpoint"
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    return killed.wait(), torn.wait(timeout=240)


@pytest.fixture(scope="module")
def reference(work, crashed):
    """The uninterrupted run, in this process (after the crashed ones, which run meanwhile)."""
    torch.set_num_threads(1)
    rep = T.train(**kwargs(work, work / "ref"))
    return rep, load_file(work / "ref" / "model.safetensors")


def _losses(report):
    return [(r["step"], r["loss"]) for r in report["history"]]


def test_resume_after_sigkill_is_exact(work, crashed, reference):
    ref_rep, ref_w = reference
    assert [s for s, _ in _losses(ref_rep)] == [1, 2, 3, 4, 5, 6]
    assert {"kl", "lm", "hidden", "lb"} <= set(ref_rep["history"][0])  # every loss term ran
    out, run = work / "killed", work / "killed.run"
    assert crashed[0] == -signal.SIGKILL
    assert sorted(x.name for x in run.iterdir() if not x.name.startswith(".")) == ["step-000002", "step-000004"]
    assert not out.exists()
    with pytest.raises(RemodelError, match="lr"):  # resuming with another trajectory is refused
        T.train(**kwargs(work, out, resume=True, lr=1e-3))
    with pytest.raises(RemodelError, match="resume"):  # so is starting over on top of it
        T.train(**kwargs(work, out))

    p = spawn(kwargs(work, out, resume=True), "plain", work / "resumed.log")
    assert p.wait(timeout=240) == 0, (work / "resumed.log").read_text()[-3000:]
    rep = json.loads((out / "remodel_report.json").read_text())
    assert rep["resumed_from"].endswith("step-000004")
    got, want = dict(_losses(rep)), dict(_losses(ref_rep))
    for step in range(1, 7):
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])
    assert got[5] == want[5] and got[6] == want[6]
    w = load_file(out / "model.safetensors")
    assert w.keys() == ref_w.keys()
    assert max((w[k] - ref_w[k]).abs().max().item() for k in w) == 0.0
    assert max((w[k] - load_file(work / "student" / "model.safetensors")[k]).abs().max().item() for k in w) > 1e-4


def test_kill_while_writing_a_checkpoint_keeps_the_previous(work, crashed, reference):
    ref_rep, ref_w = reference
    out, run = work / "torn", work / "torn.run"
    assert crashed[1] == 3, (work / "torn.log").read_text()[-3000:]
    names = sorted(x.name for x in run.iterdir())
    assert "step-000002" in names and "step-000004" not in names
    torn = [x for x in run.iterdir() if x.name.startswith(".step-000004")]
    assert len(torn) == 1 and (torn[0] / "dcp_metadata.json").exists() and not (torn[0] / S.META).exists()
    assert S.latest_checkpoint(run).name == "step-000002"

    rep = T.train(**kwargs(work, out, resume=True))
    assert rep["resumed_from"].endswith("step-000002")
    assert not [x for x in run.iterdir() if x.name.startswith(".step")]  # the torn temporary is gone
    assert [x.name for x in S.list_checkpoints(run)] == ["step-000004", "step-000006"]  # keep_last=2
    assert [l for _, l in _losses(rep)] == [l for _, l in _losses(ref_rep)]
    w = load_file(out / "model.safetensors")
    assert max((w[k] - ref_w[k]).abs().max().item() for k in w) == 0.0


def _sha(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_teacher_frozen_and_outputs(work, reference, monkeypatch):
    ref_rep, _ = reference
    before = _sha(work / "teacher" / "model.safetensors")
    loaded = []
    real_load = TR.load_model

    def spy(path, **kw):
        m = real_load(path, **kw)
        loaded.append((Path(path).name, m, {k: v.clone() for k, v in m.state_dict().items()}))
        return m

    monkeypatch.setattr(TR, "load_model", spy)
    out = work / "frozen"
    rep = T.train(**kwargs(work, out, steps=2, grad_accum=1, topk=64))
    (_, student, s0), (tname, teacher, t0) = loaded
    assert tname == "teacher" and not teacher.training and student.training
    assert all(not p.requires_grad and p.grad is None for p in teacher.parameters())
    assert all(torch.equal(v, t0[k]) for k, v in teacher.state_dict().items())
    assert any(not torch.equal(v, s0[k]) for k, v in student.state_dict().items())
    assert _sha(work / "teacher" / "model.safetensors") == before

    ckpt = S.latest_checkpoint(S.run_dir_for(out))
    keys = set(read_dcp_metadata(ckpt).state_dict_metadata)  # the DCP checkpoint's tensors
    assert {k[6:] for k in keys if k.startswith("model.")} == set(student.state_dict())
    n_proj = len(student.layers) if rep["params"]["trainable_extra"] else 0  # one projection per mapped layer
    assert n_proj == 4
    moments = {k[6:].rsplit(".", 1)[0] for k in keys if k.startswith("optim.")}
    assert len(moments) == len(list(student.parameters())) + n_proj
    assert {k.rsplit(".", 1)[1] for k in keys if k.startswith("optim.")} == {"exp_avg", "exp_avg_sq"}
    assert set(k.split(".")[0] for k in keys) == {"model", "proj", "optim", "rng"}
    assert set(S.read_meta(ckpt)["adam_steps"]) == moments
    w = S.read_full(ckpt)  # the checkpoint holds the trained weights, whole
    assert all(torch.equal(w["model." + k], v) for k, v in student.state_dict().items())
    from remodel.pipelines.commands.convert import convert  # `remodel convert OUT.run` streams the newest checkpoint to HF
    convert(S.run_dir_for(out), work / "frozen_converted")
    got, want = load_file(work / "frozen_converted" / "model.safetensors"), load_file(out / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # outputs: HF checkpoint + report + metrics + plot
    assert {"config.json", "model.safetensors", "tokenizer.json", "remodel_report.json", "metrics.csv",
            "loss.png"} <= {x.name for x in out.iterdir()}
    rows = (out / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,loss,kl,lm") and len(rows) == 3
    assert rep["tokens_per_s"] > 0 and 0 < rep["mfu"] < 1
    ev = evaluate(out, work / "valid.txt", seq_len=32, batch=4, max_tokens=2048)
    assert ev["ppl"] == pytest.approx(math.exp(ev["loss"])) and ev["tokens"] == 2048


def test_bad_requests_fail_before_writing(work, tmp_path):
    out = tmp_path / "o"
    cases = [dict(steps=None), dict(tokens=100), dict(seq_len=1), dict(lr=0), dict(topk=0),
             dict(teacher_dir=None, hidden_loss_weight=1.0), dict(data=str(tmp_path / "missing.txt"))]
    for c in cases:
        with pytest.raises(RemodelError):
            T.train(**kwargs(work, out, **c))
    tiny(tmp_path / "other", 16, "M*-E", seed=0)
    cfg = json.loads((tmp_path / "other" / "config.json").read_text())
    cfg["vocab_size"] = 1024
    (tmp_path / "other" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RemodelError, match="vocab"):
        T.train(**kwargs(work, out, teacher_dir=str(tmp_path / "other")))
    with pytest.raises(RemodelError, match="overlaps"):
        T.train(**kwargs(work, work / "student" / "x"))
    assert not out.exists() and not S.run_dir_for(out).exists()


def test_distillation_beats_lm_only_at_equal_tokens(work):
    """A small-scale proxy (~25 s): teacher = a 2-layer-pair tiny model trained LM-only for 300 steps;
    students = three smaller random models (seeds 3-5) given 40 steps either way (same tokens, lr, data
    order). Pure KD ends at a lower held-out loss than LM-only, on average over the seeds. (The real
    experiment is pruned-vs-teacher at scale.)

    The margin comes from measured spread (issue 39): the gap LM-only - KD per student seed 3..8, under
    ATEN_CPU_CAPABILITY=default and avx2 (another CPU's summation order trains another teacher), ranged
    0.047..0.150, mean 0.088, sd 0.03 (an Intel Xeon: 0.049 for seed 3); the mean of three seeds has
    sd ~0.018, so 0.03 is ~3 sd below its mean, while KD replaced by LM-only gives a gap of exactly 0."""
    common = dict(data=str(work / "train.txt"), seq_len=32, batch=8, warmup=5, lr=2e-2, log_every=0,
                  checkpoint_every=1000)
    tiny(work / "big", 48, "*-*-", seed=2)
    T.train(str(work / "big"), str(work / "big_trained"), steps=300, **common)

    def loss(name):
        return evaluate(work / name, work / "valid.txt", seq_len=32, batch=16, max_tokens=4096)["loss"]

    gaps = []
    for seed in (3, 4, 5):
        tiny(work / f"small{seed}", 24, "*-", seed=seed)
        lm = T.train(str(work / f"small{seed}"), str(work / f"lm_only{seed}"), steps=40, **common)
        kd = T.train(str(work / f"small{seed}"), str(work / f"kd{seed}"), teacher_dir=str(work / "big_trained"),
                     steps=40, **common)
        assert kd["tokens"] == lm["tokens"] == 40 * 8 * 32 and kd["args"]["lm_loss_weight"] == 0.0
        ev = {name: loss(f"{name}{seed}") for name in ("lm_only", "kd")}
        assert loss("big_trained") < ev["kd"]
        gaps.append(ev["lm_only"] - ev["kd"])
    print("held-out loss gaps LM-only - KD per seed:", [f"{g:.3f}" for g in gaps])
    assert sum(gaps) / len(gaps) > 0.03


def test_resume_refuses_changed_data_and_trains_on_a_blend(work, tmp_path, capsys):
    """A resume fingerprints the training tokens: editing DATA in place is refused (issue 19 case 8).
    --data also takes a blend 'W1 A W2 B' of text files / token sets, tokenized once into the cache."""
    data = tmp_path / "d.txt"
    data.write_text((work / "train.txt").read_text())
    out = tmp_path / "o"
    kw = kwargs(work, out, data=str(data), steps=2, checkpoint_every=1, teacher_dir=None, hidden_loss_weight=0.0,
                lm_loss_weight=None)
    rep = T.train(**kw)
    assert len(rep["args"]["data_fingerprint"]) == 1
    shutil.rmtree(out)  # keep the checkpoints in o.run/, as after a crash before the export
    data.write_text(data.read_text().replace("LORD", "Lord"))
    with pytest.raises(RemodelError, match="data changed"):
        T.train(**{**kw, "resume": True})
    from remodel import cli  # the same through the command line: one line, exit 2, nothing written
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    rc = cli.main(["train", str(work / "student"), str(out), "--data", str(data), "--steps", "2", "--seq-len", "32",
                   "--batch", "2", "--grad-accum", "2", "--lr", "3e-3", "--warmup", "2", "--checkpoint-every", "1",
                   "--log-every", "0", "--resume"])
    err = [x for x in capsys.readouterr().err.strip().splitlines() if "|" not in x]  # no progress bars
    assert rc == 2 and len(err) == 1 and "data changed" in err[0] and "--data" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    blend = f"0.75 {work / 'train.txt'} 0.25 {work / 'valid.txt'}"
    rep = T.train(**kwargs(work, tmp_path / "b", data=blend, steps=2, teacher_dir=None, hidden_loss_weight=0.0,
                           lm_loss_weight=None))
    assert len(rep["args"]["data_fingerprint"]) == 2 and rep["history"][-1]["loss"] > 0


def test_fused_loss_trains_like_the_unfused(work, tmp_path):
    """--fused-loss (CE and KL in vocabulary chunks from hidden states) gives the same per-step losses and
    weights as the logits path (fp32, distillation with KL + CE + hidden loss + MoE load balancing)."""
    kw = kwargs(work, tmp_path / "a", steps=3, checkpoint_every=3)
    a = T.train(**kw)
    b = T.train(**{**kw, "out": str(tmp_path / "b"), "fused_loss": True})
    for x, y in zip(a["history"], b["history"], strict=True):
        for k in ("loss", "kl", "lm", "hidden", "lb"):
            assert abs(x[k] - y[k]) <= 1e-5 * abs(y[k]) + 1e-7, (k, x[k], y[k])
    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4
    with pytest.raises(RemodelError, match="topk"):
        T.train(**{**kw, "out": str(tmp_path / "c"), "fused_loss": True, "topk": 8})

