"""The trainer (pipelines.training.trainer) under tensor/expert/data parallelism end to end against one-process
train() on a tiny Nemotron-H with M, *, -, E layers (MoE with a shared expert): 3 AdamW steps under torchrun
with EP 2 (folded over dp), TP 2 x EP 2 (folded over tp), DP 2 x TP 2 and DP 2 x TP 2 x EP 2; distillation
(KL + CE + hidden-state cosine through projections + MoE load balancing, grad_accum 2) with TP 2 through
cli.main, top-k distillation with TP 2; --fused-loss distillation under TP 2, DP 2 (FSDP) and DP 2 x TP 2,
each equal to one process with --fused-loss and to the logits path; --recompute selective and full under
DP 2 and in one process; exact resume of a TP 2 checkpoint, the same checkpoint continued by one process; a
DP 2 x TP 2 run one of whose ranks is SIGKILLed at step 3, its step-2 checkpoint continued under DP 4 and by
one process; what each rank holds of the student and the teacher (bytes of its local shards, about 1/n);
distillation of tiny Granite 4.0-H (MoE + shared MLP), Falcon-H1 (parallel mixers) and Bamba models, every
multiplier away from 1, under DP 2 x TP 2 equal to one process (kept at their per-tensor 1e-5 weight
tolerance beside the family suite's distillation of every family, tests/test_families.py); a SIGKILLed or
SIGSTOPped rank of `torchrun cli.py distill` ends the job within 60 s.

This file is also the torchrun worker: `torchrun --nproc-per-node N tests/test_train_parallel.py DIR CASE...`
calls pipelines.training.train.train(..., tp=, ep=) once per case (the process group outlives the calls).

Tolerances (fp32, gloo): every per-step loss term and gradient norm relative <= 1e-5 (measured <= 3e-6);
final weights max|w - w_ref| / max|w_ref| per tensor <= 1e-5 (measured <= 2e-6). The reduction order
differs (sharded matmuls, all-reduces), and Adam's m / (sqrt(v) + eps) amplifies that noise on tiny
gradients: the relative error of the 3-step *update* is ~1e-5 whatever the lr, so the weights are compared
at lr 1e-4, where the update itself is ~1e-3..1e-2 of max|w| (asserted) and the noise stays ~1e-6 of it
(at lr 1e-3 the same runs measure up to 1.7e-5). A sharding bug shows up at the scale of the update.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

COMMON = dict(steps=3, seq_len=32, batch=4, lr=1e-4, warmup=1, checkpoint_every=2, keep_last=2, log_every=0)
KD = dict(hidden_loss_weight=0.5, lm_loss_weight=0.1, grad_accum=2)
REFS = {"lm": {}, "kd": KD, "kd_topk": dict(KD, topk=16, hidden_loss_weight=0.0), "kd_fused": dict(KD, fused_loss=True),
        "kd_granite": KD, "kd_falcon": KD, "kd_bamba": KD,
        "kd_bamba_frozen": dict(KD, train_only=["layers.0.mixer.", "layers.1.mixer."])}  # the rest frozen
# the references' student / teacher checkpoints beyond nemotron_h: PREFIX + student / teacher
MODELS = {"kd_granite": "g_", "kd_falcon": "f_", "kd_bamba": "b_", "kd_bamba_frozen": "b_"}
HYBRIDS = {  # family: (reference, our tiny config's fields beyond the common ones), every multiplier away from 1
    "granitemoehybrid": ("kd_granite", dict(pattern="ME*E", n_routed_experts=4, num_experts_per_tok=2,
                                            router="softmax", norm_topk_prob=True, embedding_multiplier=2.0,
                                            residual_multiplier=0.5, attention_scale=0.2, logits_scaling=1.5)),
    "falcon_h1": ("kd_falcon", dict(pattern="P-P-", embedding_multiplier=3.0, lm_head_multiplier=1.5, key_multiplier=0.6,
                                    attention_in_multiplier=1.3, attention_out_multiplier=0.7, ssm_in_multiplier=1.4,
                                    ssm_out_multiplier=0.8, ssm_multipliers=(0.5, 1.5, 0.7, 1.2, 0.9),
                                    mlp_multipliers=(1.6, 0.6), mamba_norm_before_gate=True, rope_theta=1e4)),
    "bamba": ("kd_bamba", dict(pattern="M-*-", partial_rotary_factor=0.5, rope_theta=1e4, time_step_min=0.0)),
}
CASES = {  # name: (processes, tp, ep, reference)
    "lm_ep2": (2, 1, 2, "lm"), "lm_tp2_ep2": (2, 2, 2, "lm"), "kd_tp2": (2, 2, 1, "kd"),
    "kd_topk_tp2": (2, 2, 1, "kd_topk"), "lm_dp2_tp2": (4, 2, 1, "lm"), "kd_dp2_tp2_ep2": (4, 2, 2, "kd"),
    "kd_tp2_fused": (2, 2, 1, "kd_fused"), "kd_dp2_fused": (2, 1, 1, "kd_fused"),
    "kd_dp2_tp2_fused": (4, 2, 1, "kd_fused"), "lm_dp2_selective": (2, 1, 1, "lm"), "lm_dp2_full": (2, 1, 1, "lm"),
    "kd_granite_dp2_tp2": (4, 2, 1, "kd_granite"), "kd_falcon_dp2_tp2": (4, 2, 1, "kd_falcon"),
    "kd_bamba_dp2_tp2": (4, 2, 1, "kd_bamba"), "kd_bamba_frozen_dp2_tp2": (4, 2, 1, "kd_bamba_frozen"),
}
RECOMPUTE = {"lm_dp2_selective": "selective", "lm_dp2_full": "full"}  # --recompute through the trainer
ASYNC = {"kd_dp2_tp2_ep2"}  # checkpoints written on a background thread
EVAL = {"lm_dp2_full"}  # evaluated on held-out text before step 1 (a no-grad FSDP forward) and after the last
LAYOUT = {  # expected (tp, ep, dp, ep folded over)
    "lm_ep2": (1, 2, 2, "dp"), "lm_tp2_ep2": (2, 2, 1, "tp"), "kd_tp2": (2, 1, 1, None),
    "kd_topk_tp2": (2, 1, 1, None), "lm_dp2_tp2": (2, 1, 2, None), "kd_dp2_tp2_ep2": (2, 2, 2, "tp"),
    "kd_tp2_fused": (2, 1, 1, None), "kd_dp2_fused": (1, 1, 2, None),
    "kd_dp2_tp2_fused": (2, 1, 2, None), "lm_dp2_selective": (1, 1, 2, None), "lm_dp2_full": (1, 1, 2, None),
    "kd_granite_dp2_tp2": (2, 1, 2, None), "kd_falcon_dp2_tp2": (2, 1, 2, None), "kd_bamba_dp2_tp2": (2, 1, 2, None),
    "kd_bamba_frozen_dp2_tp2": (2, 1, 2, None),
}
CLI_FLAGS = ["--steps", "3", "--seq-len", "32", "--batch", "4", "--lr", "1e-4", "--warmup", "1", "--checkpoint-every",
             "2", "--grad-accum", "2", "--hidden-loss-weight", "0.5", "--lm-loss-weight", "0.1"]


def kwargs(d: Path, name: str, ref: str, **kw) -> dict:
    m = MODELS.get(ref, "")
    base = dict(student_dir=str(d / f"{m}student"), out=str(d / name), data=str(d / "train.txt"), **COMMON, **REFS[ref])
    if ref != "lm":
        base["teacher_dir"] = str(d / f"{m}teacher")
    return {**base, **kw}


# ---- the torchrun worker ---------------------------------------------------------------------

def worker(d: Path, cases):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from remodel.pipelines.training.train import train
    for name in cases:
        t0 = time.time()
        if name == "kd_tp2":  # through the command line's own function (rank 0 prints the report)
            from remodel import cli
            rc = cli.main(["distill", "--teacher", str(d / "teacher"), "--student", str(d / "student"), str(d / name),
                           "--data", str(d / "train.txt"), *CLI_FLAGS, "--tp", "2"])
            assert rc == 0
        elif name == "lm_dp2_tp2_killed":  # lm_dp2_tp2 whose rank 1 is SIGKILLed as step 3 begins
            from remodel.pipelines.training import trainer as TR
            step = TR._Training.step

            def dying(self, k, *a, **kw):
                if k == 2 and dist.get_rank() == 1:  # 0-based: the third step, after checkpoint 2
                    os.kill(os.getpid(), signal.SIGKILL)
                return step(self, k, *a, **kw)
            TR._Training.step = dying  # in this test worker only
            train(**kwargs(d, name, "lm", tp=2))
        elif name == "lm_dp4_resumed":  # the killed run's step-2 checkpoint (DCP) continued under DP 4
            if dist.get_rank() == 0:
                shutil.copytree(d / "lm_dp2_tp2_killed.run" / "step-000002", d / "lm_dp4_resumed.run" / "step-000002")
            dist.barrier()
            train(**kwargs(d, name, "lm", tp=1, resume=True))
        elif name == "kd_tp2_resumed":  # continue kd_tp2's step-2 checkpoint: must repeat its step 3 exactly
            if dist.get_rank() == 0:
                shutil.copytree(d / "kd_tp2.run" / "step-000002", d / "kd_tp2_resumed.run" / "step-000002")
            dist.barrier()
            train(**kwargs(d, name, "kd", tp=2, resume=True))
        else:
            n, tp, ep, ref = CASES[name]
            train(**kwargs(d, name, ref, tp=tp, ep=ep, async_checkpoint=name in ASYNC,
                           fused_loss=name.endswith("fused"), recompute=RECOMPUTE.get(name, "none"),
                           **(dict(eval_data=str(d / "train.txt"), eval_tokens=64) if name in EVAL else {})))
        if dist.get_rank() == 0:
            print(f"CASE {name} {time.time() - t0:.1f} s", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    worker(Path(sys.argv[1]), sys.argv[2:])
    sys.exit(0)


# ---- the tests -------------------------------------------------------------------------------

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from remodel.models.config import ModelConfig  # noqa: E402
from remodel.models.model import HybridLM, init_weights  # noqa: E402
from remodel.pipelines.training import train as T  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus  # noqa: E402


def _fields(family: str, H: int) -> dict:
    """The tiny config's fields beyond the common ones: nemotron_h's M*-E (MoE with a shared expert), or
    HYBRIDS' (SwiGLU, Mamba width 2H as Granite and Bamba require, the family's own fields)."""
    if family == "nemotron_h":
        return dict(pattern="M*-E", mamba_num_heads=4, n_routed_experts=4, num_experts_per_tok=2)
    return dict(mlp_gated=True, mlp_act="silu", mamba_num_heads=H // 4, **HYBRIDS[family][1])


def tiny(path: Path, family: str, H: int, seed: int, tied: bool, sharpen: float = 1.0):
    """A tiny `family` checkpoint with every width divisible by 2 (Mamba groups, KV heads, FFN, experts,
    vocab), so TP 2 x DP 2 runs compare with one process through the family's layer kinds and multipliers."""
    cfg = ModelConfig(vocab_size=2048, hidden_size=H, tie_word_embeddings=tied, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=2 * H, mamba_head_dim=8, n_groups=2,
                      ssm_state_size=8, chunk_size=16, moe_intermediate_size=H, moe_shared_expert_intermediate_size=H,
                      **_fields(family, H))
    model = init_weights(HybridLM(cfg), seed=seed)
    if sharpen != 1.0:  # a teacher with confident predictions (logits std ~3 instead of ~0.003)
        with torch.no_grad():
            model.embeddings.weight.mul_(sharpen)
            model.norm_f.weight.fill_(1.0)
    from tests.conftest import write_checkpoint  # here: the torchrun workers (this file) never import the test config
    write_checkpoint(model, path, family=family)


def launch(d: Path, n: int, cases, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", str(HERE),
           str(d), *cases]
    path = os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    print(f"\ntorchrun x{n} {cases}: {time.time() - t:.1f} s, rc {p.returncode}")
    return p.returncode, p.stdout[-4000:] + p.stderr[-4000:]


def _pids(parent: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(parent)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _local_rank(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for e in env:
        if e.startswith(b"LOCAL_RANK="):
            return int(e[11:])
    return None


def failing_run(d: Path, how: str):
    """`torchrun cli.py distill` on 2 processes; once training runs, rank 1 is SIGKILLed (dead) or
    SIGSTOPped (stalled). -> (torchrun rc, seconds until rank 0 was gone, seconds until torchrun exited, log)"""
    out = d / f"fail_{how}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(REPO / "cli.py"),
           "distill", "--teacher", str(d / "teacher"), "--student", str(d / "student"), str(out), "--data",
           str(d / "train.txt"), "--steps", "100000", "--seq-len", "32", "--batch", "4", "--checkpoint-every",
           "100000", "--tp", "2"]
    path = os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path,
           "REMODEL_DIST_TIMEOUT": "5"}
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    log, started = [], threading.Event()

    def read():
        for chunk in iter(lambda: p.stderr.read(64), ""):
            log.append(chunk)
            if re.search(r"\| *[1-9]\d*/100000 \[", "".join(log[-20:])):
                started.set()
    threading.Thread(target=read, daemon=True).start()
    try:
        assert started.wait(180), "".join(log)[-3000:]
        ranks = {}
        for _ in range(50):
            ranks = {_local_rank(q): q for c in _pids(p.pid) for q in [c] + _pids(c)}
            if 0 in ranks and 1 in ranks:
                break
            time.sleep(0.1)
        t0 = time.time()
        os.kill(ranks[1], signal.SIGKILL if how == "die" else signal.SIGSTOP)
        while Path(f"/proc/{ranks[0]}").exists() and _local_rank(ranks[0]) is not None and time.time() - t0 < 120:
            time.sleep(0.2)
        rank0_gone = time.time() - t0
        if how == "stall":
            os.kill(ranks[1], signal.SIGKILL)  # spare torchrun its 30 s grace period for the stopped rank
        rc = p.wait(timeout=120)
        return rc, rank0_gone, time.time() - t0, "".join(log)[-3000:], out
    finally:
        if p.poll() is None:
            p.kill()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    with __import__("gzip").open(embedded_corpus()[0], "rt", encoding="utf-8") as f:
        lines = [x for x in f.read().splitlines() if x.strip()]
    (d / "train.txt").write_text("\n".join(lines[:400]) + "\n")
    tiny(d / "student", "nemotron_h", 32, seed=0, tied=False)
    tiny(d / "teacher", "nemotron_h", 48, seed=1, tied=True, sharpen=10.0)
    for family, (ref, _) in HYBRIDS.items():
        tiny(d / f"{MODELS[ref]}student", family, 32, seed=2, tied=False)
        tiny(d / f"{MODELS[ref]}teacher", family, 48, seed=3, tied=True, sharpen=10.0)
    res = {}

    def four():  # a rank of DP 2 x TP 2 really killed, then its checkpoint resumed under DP 4 (lm_dp4_resumed)
        return launch(d, 4, ["lm_dp2_tp2_killed"]), launch(d, 4, ["lm_dp2_tp2", "lm_dp4_resumed", "kd_dp2_tp2_ep2",
                                                                  "kd_dp2_tp2_fused"])
    with ThreadPoolExecutor(4) as ex:  # everything at once: the launches spend much of their time waiting
        jobs = {how: ex.submit(failing_run, d, how) for how in ("die", "stall")}
        jobs[2] = ex.submit(launch, d, 2, ["lm_ep2", "lm_tp2_ep2", "kd_tp2", "kd_tp2_resumed", "kd_topk_tp2",
                                          "kd_tp2_fused", "kd_dp2_fused", "lm_dp2_selective", "lm_dp2_full"])
        jobs[4] = ex.submit(four)
        jobs["hybrids"] = ex.submit(launch, d, 4, ["kd_granite_dp2_tp2", "kd_falcon_dp2_tp2", "kd_bamba_dp2_tp2",
                                                             "kd_bamba_frozen_dp2_tp2"])
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:  # the one-process references, meanwhile, and --recompute through the one-process trainer
            res["ref"] = {r: T.train(**kwargs(d, f"ref_{r}", r)) for r in REFS}
            res["recompute"] = {m: T.train(**kwargs(d, f"ref_lm_{m}", "lm", recompute=m)) for m in ("selective", "full")}
        finally:
            torch.set_num_threads(n)
        res.update({k: f.result() for k, f in jobs.items()})
    res["killed"], res[4] = res[4]
    if res[2][0] == 0:  # kd_tp2's (gathered) step-2 checkpoint continued by one process
        shutil.copytree(d / "kd_tp2.run" / "step-000002", d / "kd_1proc.run" / "step-000002")
        res["kd_1proc"] = T.train(**kwargs(d, "kd_1proc", "kd", resume=True))
    if (d / "lm_dp2_tp2_killed.run" / "step-000002").is_dir():  # the killed run's checkpoint, by one process
        shutil.copytree(d / "lm_dp2_tp2_killed.run" / "step-000002", d / "lm_1proc.run" / "step-000002")
        res["lm_1proc"] = T.train(**kwargs(d, "lm_1proc", "lm", resume=True))
    res["dir"] = d
    return res


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def weights_rel(a: dict, b: dict) -> tuple[float, str]:
    assert a.keys() == b.keys()
    worst = {k: float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max()) for k in b}
    k = max(worst, key=worst.get)
    return worst[k], k


def compare(d: Path, name: str, ref: str):
    rep = json.loads((d / name / "remodel_report.json").read_text())
    want = json.loads((d / f"ref_{ref}" / "remodel_report.json").read_text())
    assert [r["step"] for r in rep["history"]] == [1, 2, 3]
    loss_rel = 0.0
    for got, exp in zip(rep["history"], want["history"]):
        assert {k for k in got if got[k] is not None} == {k for k in exp if exp[k] is not None}
        for k in ("loss", "kl", "lm", "hidden", "lb", "grad_norm"):
            if exp.get(k) is not None:
                loss_rel = max(loss_rel, rel(got[k], exp[k]))
    w, w_ref = load_file(d / name / "model.safetensors"), load_file(d / f"ref_{ref}" / "model.safetensors")
    w0 = load_file(d / f"{MODELS.get(ref, '')}student" / "model.safetensors")
    trained = [k for k in w0 if not torch.equal(w_ref[k], w0[k])]  # all but those train_only froze
    assert [k for k in w0 if not torch.equal(w[k], w0[k])] == trained  # the same frozen, bit for bit
    moved = sorted(float((w_ref[k] - w0[k]).abs().max() / w_ref[k].abs().max()) for k in trained)[len(trained) // 2]
    return rep, want, loss_rel, weights_rel(w, w_ref), moved


def moved_keys(d: Path, name: str, ref: str) -> list:
    w, w0 = (load_file(p / "model.safetensors") for p in (d / name, d / f"{MODELS.get(ref, '')}student"))
    return [k for k in w0 if not torch.equal(w[k], w0[k])]


def _fp32_bytes(model_dir, replicated_by_tp: bool | None = None) -> int:
    """fp32 bytes of a checkpoint's parameters (the routers' correction bias is a buffer); with
    replicated_by_tp, only those tensor parallelism leaves whole: 1-D tensors (counted whole, a bound),
    the router, and the routed experts when no expert parallelism splits them. A tied model's stored lm_head copy
    (families whose transformers class never ties: Family.ties_head) is the embedding, held once: not counted."""
    def whole(k, t):  # nemotron_h's and granitemoehybrid's names of routers and routed experts
        router = k.endswith("gate.weight") or k.endswith("router.layer.weight")
        experts = ".experts." in k or ".block_sparse_moe.input_linear" in k or ".block_sparse_moe.output_linear" in k
        return t.dim() == 1 or router or (replicated_by_tp and experts)
    tied = json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings")  # a tied nemotron_h
    return sum(t.numel() * 4 for k, t in load_file(model_dir / "model.safetensors").items()  # stores lm_head too
               if not k.endswith("e_score_correction_bias") and not (tied and k == "lm_head.weight")
               and (replicated_by_tp is None or whole(k, t)))


def test_launches_succeed(runs):
    for n in (2, 4, "hybrids"):
        rc, log = runs[n]
        assert rc == 0, log


@pytest.mark.parametrize("name", list(CASES))
def test_matches_one_process(runs, name):
    n, tp, ep, ref = CASES[name]
    launched = runs["hybrids" if ref in MODELS else n]
    assert launched[0] == 0, launched[1]
    rep, want, loss_rel, (w_rel, worst), moved = compare(runs["dir"], name, ref)
    print(f"{name}: loss/grad-norm rel {loss_rel:.2e}, weights rel {w_rel:.2e} ({worst}), moved {moved:.2e}")
    p = rep["parallel"]
    assert (p["tp"], p["ep"], p["dp"], p["ep_over"]) == LAYOUT[name] and p["world"] == n
    assert loss_rel <= 1e-5
    assert w_rel <= 1e-5
    assert moved > 100 * 1e-5  # the 3 Adam steps moved the median tensor by far more than the tolerance
    assert rep["tokens"] == want["tokens"] == 3 * 4 * 32 * (2 if ref != "lm" else 1)
    if name in EVAL:  # evaluating first changed nothing (FSDP resharded the root after its no-grad forward)
        assert rep["eval"]["before"]["loss"] > rep["eval"]["after"]["loss"] > 0, rep["eval"]
    if ref != "lm":  # the teacher really taught: a large KL that the student reduced
        assert min(r["kl"] for r in rep["history"]) > 0.5  # a confident teacher: KL far from 0
        assert p["teacher"] == {"tp": tp, "ep": ep}  # the teacher is TP (and EP) sharded too
    for who in ("student", "teacher") if ref != "lm" else ("student",):  # what each rank holds, measured
        model_dir = runs["dir"] / f"{MODELS.get(ref, '')}{who}"
        held, full = p["held_bytes"][who], _fp32_bytes(model_dir)
        whole = _fp32_bytes(model_dir, replicated_by_tp=ep == 1)  # left whole on every tp rank
        bound = (full - whole) / n + whole / (n // tp)  # the rest split over all n ranks (TP / EP x FSDP)
        print(f"{name} {who}: bytes per rank {held}, whole model {full}, bound {bound:.0f}")
        assert len(held) == n and sum(held) >= full  # together the ranks hold all of it
        assert max(held) <= bound + 1024 and max(held) < 0.6 * full  # no rank holds the whole model
        assert p["held_bytes"][f"{who}_end"] == held  # and after the last step and evaluation still no more
    if name.endswith("fused"):  # the fused loss equals the logits path too, whatever the layout
        loss_rel, (w_rel, worst) = compare(runs["dir"], name, "kd")[2:4]
        print(f"{name} vs the unfused one process: loss/grad-norm rel {loss_rel:.2e}, weights rel {w_rel:.2e}")
        assert loss_rel <= 1e-5 and w_rel <= 1e-5, worst
    if "train_only" in REFS[ref]:  # frozen: all but the named mixers, as in one process (test_train_only)
        assert 0 < len(moved_keys(runs["dir"], name, ref)) < len(load_file(runs["dir"] / name / "model.safetensors"))
    if ref not in ("kd_bamba", "kd_falcon", "kd_bamba_frozen"):  # (those have no MoE) the load-balancing term ran over all dp ranks
        assert rep["history"][0]["lb"] > 0.5
    d = runs["dir"] / name
    assert {"config.json", "model.safetensors", "tokenizer.json", "remodel_report.json", "metrics.csv",
            "loss.png"} <= {x.name for x in d.iterdir()}
    assert len((d / "metrics.csv").read_text().splitlines()) == 4


def test_resume_is_exact_and_layout_free(runs):
    d = runs["dir"]
    assert runs[2][0] == 0, runs[2][1]
    full = json.loads((d / "kd_tp2" / "remodel_report.json").read_text())
    resumed = json.loads((d / "kd_tp2_resumed" / "remodel_report.json").read_text())
    assert resumed["resumed_from"].endswith("step-000002")
    assert [r["loss"] for r in resumed["history"]] == [r["loss"] for r in full["history"]]  # bit-identical
    w_full, w_res = load_file(d / "kd_tp2" / "model.safetensors"), load_file(d / "kd_tp2_resumed" / "model.safetensors")
    assert max(float((w_full[k] - w_res[k]).abs().max()) for k in w_full) == 0.0
    # the TP-2 checkpoint (gathered, single-process format) continued by one process ends at the reference
    one = runs["kd_1proc"]
    assert one["resumed_from"].endswith("step-000002") and one["parallel"]["world"] == 1
    ref = runs["ref"]["kd"]
    assert rel(one["history"][-1]["loss"], ref["history"][-1]["loss"]) <= 1e-5
    w_rel, worst = weights_rel(load_file(d / "kd_1proc" / "model.safetensors"),
                               load_file(d / "ref_kd" / "model.safetensors"))
    assert w_rel <= 1e-5, worst


@pytest.mark.parametrize("how", ["die", "stall"])
def test_dead_or_stalled_rank_ends_the_job(runs, how):
    rc, rank0_gone, total, log, out = runs[how]
    print(f"{how}: rc {rc}, rank 0 gone after {rank0_gone:.1f} s, torchrun after {total:.1f} s")
    assert rc != 0, log
    assert rank0_gone < 60, log  # stall: the 5 s collective timeout (REMODEL_DIST_TIMEOUT) fired
    assert not out.exists()


def test_recompute_through_the_trainer_changes_nothing(runs):
    """--recompute selective | full in one process: the same losses as none, to the bit (DP 2: CASES)."""
    ref = [r["loss"] for r in runs["ref"]["lm"]["history"]]
    for mode, rep in runs["recompute"].items():
        assert rep["args"]["recompute"] == mode and [r["loss"] for r in rep["history"]] == ref, mode


def test_dcp_checkpoint_resumes_under_other_layouts(runs):
    """DP 2 x TP 2 wrote step 2 (each rank its own chunks), then one of its ranks was SIGKILLed as step 3
    began; DP 4 and one process continue that checkpoint: every step's loss and the final weights equal
    the uninterrupted one-process run."""
    d = runs["dir"]
    rc, log = runs["killed"]
    assert rc != 0 and "SIGKILL" in log, log  # torchrun saw the rank die
    killed = d / "lm_dp2_tp2_killed.run"
    assert sorted(x.name for x in killed.iterdir() if x.name.startswith("step")) == ["step-000002"]
    assert not (d / "lm_dp2_tp2_killed").exists()  # no OUT from the killed run
    assert runs[4][0] == 0, runs[4][1]
    ref = json.loads((d / "ref_lm" / "remodel_report.json").read_text())
    dp4 = json.loads((d / "lm_dp4_resumed" / "remodel_report.json").read_text())
    assert (dp4["parallel"]["dp"], dp4["parallel"]["tp"]) == (4, 1)
    for rep in (dp4, runs["lm_1proc"]):
        assert rep["resumed_from"].endswith("step-000002")
        for got, want in zip(rep["history"], ref["history"], strict=True):
            assert rel(got["loss"], want["loss"]) <= 1e-5, (got, want)
    for name in ("lm_dp4_resumed", "lm_1proc"):
        w_rel, worst = weights_rel(load_file(d / name / "model.safetensors"), load_file(d / "ref_lm" / "model.safetensors"))
        assert w_rel <= 1e-5, (name, worst)
    # the DP 2 x TP 2 x EP 2 run saved in the background: both checkpoints complete
    from remodel.pipelines.training.train_state import list_checkpoints, read_meta
    cks = list_checkpoints(d / "kd_dp2_tp2_ep2.run")
    assert [read_meta(c)["step"] for c in cks] == [2, 3] and all((c / "dcp_metadata.json").is_file() for c in cks)

