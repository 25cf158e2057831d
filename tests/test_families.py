"""The family conformance suite (transformers' ModelTesterMixin pattern): every registered family
(models.families.FAMILIES) x every check that applies to it, on the tiny models the family names itself
(Family.tiny, in its own module: a new family brings its builder and the suite needs no edit; a family
without one fails test_every_family_has_a_tiny_builder).

Per tiny model (each of a family's cases), with transformers as the oracle: logits (1e-4, fp32) and every
parameter's gradient, left padding, `inspect`'s counts, the in-memory export and `remodel convert` byte
identical, the export loaded back by transformers, eval loss. Per family (its first case): pruned ==
zero-masked on every width axis its kinds prune and all of them at once (tests/masking.py), upcycling into
its default MoE target exactly (or a one-line refusal where it names none), and distillation under DP 2 x
TP 2 equal to one process (one 4-rank torchrun over every family).

This file is also that torchrun worker: `torchrun --nproc-per-node 4 tests/test_families.py DIR FAMILY...`.
"""
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DISTILL = dict(steps=3, seq_len=32, batch=4, lr=1e-4, warmup=1, checkpoint_every=3, keep_last=1, log_every=0,
               hidden_loss_weight=0.5, lm_loss_weight=0.1, grad_accum=2)


def distill_kwargs(d: Path, family: str, out: str) -> dict:
    return dict(student_dir=str(d / f"{family}-student"), teacher_dir=str(d / f"{family}-teacher"),
                out=str(d / f"{family}-{out}"), data=str(d / "train.txt"), **DISTILL)


def no_plot(*a, **kw):
    """In place of metrics.plot_losses here (60% of a tiny run's time; tests/test_train* check the plot)."""


if __name__ == "__main__":  # the torchrun worker: DP 2 x TP 2 distillation of each named family in turn
    import torch
    torch.set_num_threads(1)
    from remodel.pipelines.training import metrics
    from remodel.pipelines.training.train import train
    metrics.plot_losses = no_plot
    for fam in sys.argv[2:]:
        train(**distill_kwargs(Path(sys.argv[1]), fam, "dp2tp2"), tp=2)
    sys.exit(0)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from remodel import cli  # noqa: E402
from remodel.models.families import FAMILIES  # noqa: E402
from remodel.models.hf import config_from_hf  # noqa: E402
from remodel.models.kinds import used  # noqa: E402
from remodel.models.load import load_model, save_model  # noqa: E402
from tests.conftest import assert_left_padding, assert_same_tensors, hf_pair, prune_axes  # noqa: E402
from tests.masking import masked_reference  # noqa: E402

B, L = 2, 37
# a family nesting another's text model beside a tower it carries through (Family.nested: Qwen3.5 as released)
# runs its text family's suite; its own CLI flow is tests/test_qwen35_vision.py
SUITE = {f: fam for f, fam in FAMILIES.items() if not fam.nested}
CASES = [(f, c) for f, fam in SUITE.items() for c in fam.tiny]
MAIN = {f: next(iter(fam.tiny)) for f, fam in SUITE.items() if fam.tiny}


def tiny_config(family: str, case: str | None = None):
    """Our ModelConfig of a family's tiny case (its first by default), without building a model."""
    return config_from_hf({"model_type": family, **FAMILIES[family].tiny[case or MAIN[family]]})


def dense_case(family: str) -> str | None:
    """The family's first tiny case without routed experts (an upcycling source), if any."""
    return next((c for c in FAMILIES[family].tiny if not tiny_config(family, c).moe.n_routed_experts), None)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def build(family, case, root):
    """-> (transformers model, our model, checkpoint dir), built once per case (tests/conftest.hf_pair)."""
    return hf_pair(family, root, f"{family}-{case}", len(case), **FAMILIES[family].tiny[case])


def ids(V, seed=0, n=B):
    return torch.randint(0, V, (n, L), generator=torch.Generator().manual_seed(seed))


def test_every_family_has_a_tiny_builder():
    missing = [name for name, f in FAMILIES.items() if not f.tiny]
    assert not missing, f"families without a tiny builder (Family.tiny in their module): {', '.join(missing)}"


# ---- per tiny model -------------------------------------------------------------------------------

def _grads_as_ours(hf, root, name):
    """transformers' gradients in our layout: written as a checkpoint in place of the weights (its own
    save_pretrained undoes its in-memory renaming and fusing), loaded by remodel (the family's key map)."""
    import copy
    g = copy.deepcopy(hf)
    grads = dict(hf.named_parameters())
    with torch.no_grad():
        for n, p in g.named_parameters():
            p.copy_(torch.zeros_like(p) if grads[n].grad is None else grads[n].grad)
    g.save_pretrained(root / f"{name}-grads")
    return dict(load_model(root / f"{name}-grads").named_parameters())


@pytest.mark.parametrize("family,case", CASES)
def test_logits_and_gradients(family, case, root):
    hf, ours, _ = build(family, case, root)
    V = ours.cfg.vocab_size
    x, labels = ids(V, 0), ids(V, 1)
    pad = hf.config.get_text_config().pad_token_id
    if pad is not None:  # the pad id in the input: transformers freezes its row where it builds padding_idx
        x[:, ::5] = pad % V
    for m in (hf, ours):
        m.zero_grad(set_to_none=True)
    ref, out = hf(x).logits, ours(x)
    assert out.shape == ref.shape == (B, L, V)
    assert (out - ref).abs().max().item() <= min(1e-4, 1e-5 * max(1.0, ref.abs().max().item()))
    assert ref.std().item() > 0.3  # not a comparison of near-constant outputs
    F.cross_entropy(ref.reshape(-1, V), labels.reshape(-1)).backward()
    F.cross_entropy(out.reshape(-1, V), labels.reshape(-1)).backward()
    want, got = _grads_as_ours(hf, root, f"{family}-{case}"), dict(ours.named_parameters())
    assert want.keys() == got.keys()  # every parameter, experts included
    for n, p in got.items():  # the embedding's pad row too (ModelConfig.padding_idx)
        g, g_ref = p.grad, want[n]
        err, scale = (g - g_ref).abs().max().item(), g_ref.abs().max().item()
        assert err <= 1e-5 + 1e-4 * scale, f"{n}: grad diff {err:.2e} (scale {scale:.2e})"
    nonzero = sum(1 for p in got.values() if p.grad.abs().max() > 0)
    assert nonzero >= len(got) - (ours.cfg.moe.n_routed_experts or 0)  # gradients actually flow


@pytest.mark.parametrize("family,case", CASES)
def test_left_padding(family, case, root):
    hf, ours, _ = build(family, case, root)
    x = ids(ours.cfg.vocab_size, 2)
    out = assert_left_padding(hf, ours, x)  # row 1 left-padded by 7 tokens
    if ours.cfg.attention.rope_theta is None and not ours.cfg.attention.partial_rotary_factor < 1:  # no positions: padded = unpadded
        with torch.no_grad():
            unpadded = ours(x[1:, 7:])
        assert (out[1, 7:] - unpadded[0]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family,case", CASES)
def test_export_identical_and_loaded_by_transformers(family, case, root):
    """save_model writes the checkpoint transformers saved, every config field the case set included;
    transformers loads it back with the same logits."""
    hf, ours, d = build(family, case, root)
    out = save_model(ours, root / f"{family}-{case}-out", family=family)
    assert_same_tensors(d, out)
    src, dst = (json.loads((p / "config.json").read_text()) for p in (d, out))
    for k in FAMILIES[family].tiny[case]:
        assert dst.get(k) == src.get(k), k
    back = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(back) is type(hf) and type(hf).__name__ == FAMILIES[family].arch
    x = ids(ours.cfg.vocab_size, 3)
    with torch.no_grad():
        got, want = back(x).logits, hf(x).logits
        # weights equal bit for bit (above), logits to fp32 rounding: BLAS sums of a loaded copy may differ
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()  # (bit-unequal with ATEN_CPU_CAPABILITY=default)


@pytest.mark.parametrize("family,case", CASES)
def test_convert_identical(family, case, root):
    """`remodel convert` (streaming: the family's names to ours and back) writes the checkpoint transformers saved."""
    _, _, d = build(family, case, root)
    out = root / f"{family}-{case}-converted"
    assert cli.main(["convert", str(d), str(out), "--to", family]) == 0
    assert_same_tensors(d, out, case)


@pytest.mark.parametrize("family,case", CASES)
def test_inspect_counts(family, case, root, capsys):
    from remodel.models.params import count_params
    hf, ours, d = build(family, case, root)
    n_hf = sum(p.numel() for p in hf.parameters())
    assert count_params(ours.cfg, family=family)["hf_total"] == n_hf == sum(p.numel() for p in ours.parameters())
    assert cli.main(["inspect", str(d)]) == 0
    shown = capsys.readouterr().out
    assert ours.cfg.pattern in shown and f"{n_hf:,}" in shown
    for k in used(ours.cfg, mtp=False):  # every field its kinds' summaries name (a partial rotary factor, ...)
        for name in k.summary(ours.cfg):
            assert name in shown, (k.name, name)


@pytest.mark.parametrize("family,case", CASES)
def test_eval_loss(family, case, root):
    """`remodel eval`'s loss of the checkpoint is transformers' own mean next-token loss (its labels path)."""
    from remodel.pipelines.training.evaluate import evaluate
    hf, ours, d = build(family, case, root)
    blocks = ids(ours.cfg.vocab_size, 7, n=2 * B)
    with torch.no_grad():
        ref = sum(hf(b, labels=b).loss.item() for b in blocks.split(B)) / math.ceil(len(blocks) / B)
    assert abs(evaluate(d, blocks, batch=B)["loss"] - ref) <= 5e-5


# ---- per family: pruning ------------------------------------------------------------------------

PRUNE_CASES = [(f, a) for f in MAIN for a in [*prune_axes(tiny_config(f)), "all"]]


@pytest.mark.parametrize("family,axis", PRUNE_CASES)
def test_pruned_equals_masked(family, axis, root):
    """Width pruning (random scores: the test is about the slicing) gives the logits of the unpruned model
    with the dropped units zero-masked (tests/masking.py, each kind's tests/kinds/ module), on every axis alone
    and on all at once. A model with Gated DeltaNet layers (FP64 in its masking module) is compared in float64
    (within 1e-10): its per-head gated norm rescales the rule's small outputs, so fp32 rounding alone moves
    these tiny random models' logits by ~2e-5 (fp32 vs fp64, unpruned)."""
    import copy

    from remodel.compress.baselines import random_scores
    from remodel.compress.prune import plan_keep, prune_model
    from tests.kinds import masking
    _, model, _ = build(family, MAIN[family], root)
    cfg = model.cfg
    fp64 = any(getattr(masking(k), "FP64", False) for k in used(cfg))  # a kind's masking module asks for it
    model = copy.deepcopy(model).double() if fp64 else model
    axes = prune_axes(cfg)
    targets = axes if axis == "all" else {axis: axes[axis]}
    keep = plan_keep(cfg, random_scores(cfg, seed=PRUNE_CASES.index((family, axis))), targets)
    pruned = prune_model(model, keep)
    x = ids(cfg.vocab_size, 1)
    with torch.no_grad():
        a, b, full = pruned(x), masked_reference(model, keep)(x), model(x)
    diff, moved = (a - b).abs().max().item(), (a - full).abs().max().item()
    print(f"{family} {axis}: pruned vs masked {diff:.2e}, pruned vs unpruned {moved:.2e}, |logits| {full.abs().max():.2f}")
    assert diff <= (1e-10 if fp64 else 1e-5)
    assert moved > 1e-2  # the pruning did change the model: the comparison is not vacuous


# ---- per family: upcycling ----------------------------------------------------------------------

UPCYCLE = [f for f in MAIN if dense_case(f)]
UPCYCLE_FLAGS = ["--experts", "4", "--granularity", "1", "--top-k", "2"]


@pytest.mark.parametrize("family", UPCYCLE)
def test_upcycle_exact_or_refused(family, root, capsys):
    """A dense tiny model upcycles (--exact, the family's default router and target, with or without a
    shared expert: whichever the target holds; the other is refused in one line, nothing written) into an
    MoE that transformers loads with the dense model's logits; a family that names no target refuses in one
    line before anything is written."""
    from remodel.models.errors import RemodelError
    f, case = FAMILIES[family], dense_case(family)
    hf, ours, d = build(family, case, root)
    done = []
    for shared in (0, 16):
        out = root / f"{family}-upcycled-{shared}"
        capsys.readouterr()
        if cli.main(["upcycle", str(d), str(out), *UPCYCLE_FLAGS, "--shared-expert-size", str(shared), "--exact"]):
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and not out.exists(), err
        else:
            done.append(shared)
    try:
        to = f.upcycle_into(ours.cfg, f.upcycle_router(), done[-1] if done else 0)
    except RemodelError:  # a family that names no target: both refused
        assert not done and "upcycling target" in err, err
        return
    assert done, f"{family} names the target {to} but upcycles into it neither with nor without a shared expert"
    out = root / f"{family}-upcycled-{done[-1]}"
    moe = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(moe).__name__ == FAMILIES[to].arch and FAMILIES[to].moe
    got = config_from_hf(json.loads((out / "config.json").read_text())).moe
    assert (got.n_routed_experts, got.moe_shared_expert_intermediate_size or 0) == (4, done[-1])  # as asked
    x = ids(ours.cfg.vocab_size, 4)
    with torch.no_grad():
        want, got = hf(x).logits, moe(x).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    rep = json.loads((out / "remodel_report.json").read_text())
    assert (rep["from"], rep["to"]) == (family, to) and rep["exact_expected"]
    assert rep["deviation"]["max_abs_logit_diff"] <= 1e-5 * want.abs().max()


# ---- per family: distillation under DP 2 x TP 2 (one 4-rank launch for every family) ----------

def _write_pair(d: Path, family: str):
    """A student and a confident teacher of the family's first tiny case with the embedded tokenizer's
    vocabulary (every width there divides by 2: Mamba groups, KV heads, FFN, experts)."""
    from remodel.models.model import HybridLM, init_weights
    from tests.conftest import write_checkpoint
    cfg = tiny_config(family).replace(vocab_size=2048, extra={})
    for who, seed in (("student", 2), ("teacher", 3)):
        # a tied teacher where the family holds one (nemotron_h, kimi_linear: lm_head written as a copy, read tied)
        tie = who == "teacher" and FAMILIES[family].holds(cfg.replace(tie_word_embeddings=True))
        model = init_weights(HybridLM(cfg.replace(tie_word_embeddings=tie)), seed=seed)
        if who == "teacher":  # confident predictions: logits std ~3 (instead of ~0.003), whatever the multipliers
            with torch.no_grad():
                model.norm_f.weight.fill_(1.0)
                w = model.embeddings.weight if tie else model.lm_head.weight  # untied: the head sets the scale
                w.mul_(3.0 / model(torch.arange(64)[None]).std().item())
        write_checkpoint(model, d / f"{family}-{who}", family=family)


def _launch(d: Path, families) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(HERE), str(d),
           *families]
    path = os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    print(f"\ntorchrun x4 {families}: {time.time() - t:.1f} s, rc {p.returncode}")
    return p.returncode, p.stdout[-4000:] + p.stderr[-4000:]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """Every family distilled under DP 2 x TP 2 (one torchrun) and, meanwhile, in one process."""
    from remodel.pipelines.data.data import embedded_corpus
    from remodel.pipelines.training import metrics
    from remodel.pipelines.training.train import train
    d = tmp_path_factory.mktemp("distill")
    with __import__("gzip").open(embedded_corpus()[0], "rt", encoding="utf-8") as f:
        lines = [x for x in f.read().splitlines() if x.strip()]
    (d / "train.txt").write_text("\n".join(lines[:400]) + "\n")
    for family in MAIN:
        _write_pair(d, family)
    n = torch.get_num_threads()
    with ThreadPoolExecutor(1) as ex, pytest.MonkeyPatch.context() as mp:
        job = ex.submit(_launch, d, list(MAIN))
        torch.set_num_threads(1)
        mp.setattr(metrics, "plot_losses", no_plot)
        try:
            refs = {family: train(**distill_kwargs(d, family, "ref")) for family in MAIN}
        finally:
            torch.set_num_threads(n)
        return d, job.result(), refs


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize("family", list(MAIN))
def test_distill_dp2_tp2_equals_one_process(family, distilled):
    """3 AdamW steps of distillation (KL + CE + hidden cosine + MoE load balancing, grad_accum 2) under
    DP 2 x TP 2: every per-step loss term and gradient norm, and the final weights, equal one process's
    (relative 1e-5; lr 1e-4 so that the 3-step update is far above that: tests/test_train_parallel.py)."""
    d, (rc, log), refs = distilled
    assert rc == 0, log
    rep = json.loads((d / f"{family}-dp2tp2" / "remodel_report.json").read_text())
    want = refs[family]
    p = rep["parallel"]
    assert (p["tp"], p["ep"], p["dp"], p["world"]) == (2, 1, 2, 4) and p["teacher"] == {"tp": 2, "ep": 1}
    assert [r["step"] for r in rep["history"]] == [1, 2, 3] and rep["tokens"] == want["tokens"] == 3 * 4 * 32 * 2
    for got, exp in zip(rep["history"], want["history"], strict=True):
        assert {k for k in got if got[k] is not None} == {k for k in exp if exp[k] is not None}
        for k in ("loss", "kl", "lm", "hidden", "lb", "grad_norm"):
            if exp.get(k) is not None:
                assert _rel(got[k], exp[k]) <= 1e-5, (k, got[k], exp[k])
    assert min(r["kl"] for r in rep["history"]) > 0.5  # a confident teacher: KL far from 0
    if tiny_config(family).moe.n_routed_experts:  # the load-balancing term ran over all dp ranks
        assert rep["history"][0]["lb"] > 0.5
    w, w_ref = (load_file(d / f"{family}-{x}" / "model.safetensors") for x in ("dp2tp2", "ref"))
    w0 = load_file(d / f"{family}-student" / "model.safetensors")
    assert w.keys() == w_ref.keys()
    scale = sorted(float(t.abs().max()) for t in w_ref.values())[len(w_ref) // 2]
    for k in w:
        err = (w[k].double() - w_ref[k].double()).abs() / max(float(w_ref[k].abs().max()), scale)
        if k.endswith("k_proj.bias"):  # softmax ignores it: its gradient is 0 in exact arithmetic, its
            continue  # Adam update sign(rounding noise) (DP vs one process: two different noises)
        # isolated elements where Adam's m / sqrt(v) amplifies reduction-order noise: 0.1% of the tensor, and one
        # element of any (a tiny expert's 512 elements would allow none)
        assert err.max() <= 1e-4 and (err > 1e-5).sum() <= max(1, 1e-3 * err.numel()), (k, float(err.max()))
    live = [k for k in w0 if w_ref[k].abs().max() > 0]  # (a sigmoid router's correction bias stays 0: 0 / 0)
    moved = sorted(float((w_ref[k] - w0[k]).abs().max() / w_ref[k].abs().max()) for k in live)[len(live) // 2]
    assert moved > 100 * 1e-5  # the 3 Adam steps moved the median tensor by far more than the tolerance


# ---- per family: one trunk walk (models/trunk.py) behind HybridLM, streaming scoring and the deviation check ----

@pytest.mark.parametrize("family", list(MAIN))
def test_one_trunk_walk_bit_identical(family, root, monkeypatch):
    """HybridLM's final hidden states, streaming scoring's (one layer read at a time) and the upcycle deviation
    check's dense stream (the weights as the writer streams them, beside the upcycled stream) are the same bits."""
    import remodel.compress.streaming as streaming
    import remodel.upcycle.deviation as deviation
    _, ours, d = build(family, MAIN[family], root)
    x, seen = ids(ours.cfg.vocab_size, 9), {}
    monkeypatch.setattr(streaming, "lm_loss_sums", lambda h, *a: (seen.setdefault("stream", h), (h.sum(), 1))[1])
    streaming.score_streaming(d, [x], loss_increase=False)
    with torch.no_grad():
        assert torch.equal(seen["stream"], ours.hidden(x)[0])
    case = dense_case(family)
    if case is None:
        return
    _, dense, d = build(family, case, root)
    compare = deviation.StreamCheck._compare
    monkeypatch.setattr(deviation.StreamCheck, "_compare",
                        lambda self, h, head: seen.update(dev=(h, self.ids)) or compare(self, h, head))
    for shared in ("0", "16"):  # whichever the family's MoE target holds (the other is refused)
        if cli.main(["upcycle", str(d), str(root / f"{family}-walk-{shared}"), *UPCYCLE_FLAGS,
                     "--shared-expert-size", shared, "--exact"]) == 0:
            break
    if "dev" not in seen:
        return  # a family that names no upcycling target
    h, x = seen["dev"]
    with torch.no_grad():
        assert torch.equal(h[:len(x)], dense.hidden(x)[0])
