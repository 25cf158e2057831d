"""Figures that reconcile (issue 59 Deliver 3): one distilled model's perplexity from distill's report,
from `remodel eval` run with the command the report names, and from transformers on the same tokens agree;
the teacher's and the student's before-figures likewise; every figure names its tokens."""
import gzip
import json
import math
import shlex

import pytest
import torch

from remodel import cli
from remodel.models.config import ModelConfig
from remodel.models.model import HybridLM, init_weights
from remodel.pipelines.data.data import embedded_corpus
from remodel.pipelines.training import train as T
from tests.conftest import randomise, write_checkpoint

SEQ, EVAL_TOKENS = 32, 1000  # 1000 tokens: 31 blocks of 32 (the remainder dropped, as pack drops it)


def _tiny(path, H, seed):
    """Untied: transformers' NemotronH (5.x) does not tie lm_head to the embeddings (no _tied_weights_keys), so a
    tied checkpoint loads there with a freshly initialised lm_head (logits off by ~1e-2 on these models)."""
    cfg = ModelConfig(vocab_size=2048, hidden_size=H, pattern="M*-E", tie_word_embeddings=False,  # see below
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=2 * H,
                      mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, chunk_size=16,
                      n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=H)
    return write_checkpoint(randomise(init_weights(HybridLM(cfg), seed=seed), seed), path)  # far from uniform


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    d = tmp_path_factory.mktemp("figures")
    with gzip.open(embedded_corpus()[0], "rt", encoding="utf-8") as f:
        lines = [x for x in f.read().splitlines() if x.strip()]
    (d / "train.txt").write_text("\n".join(lines[:400]) + "\n")
    (d / "valid.txt").write_text("\n".join(lines[-120:]) + "\n")
    _tiny(d / "student", 16, seed=0)
    _tiny(d / "teacher", 24, seed=1)
    torch.set_num_threads(1)
    rep = T.train(student_dir=str(d / "student"), teacher_dir=str(d / "teacher"), out=str(d / "out"),
                  data=str(d / "train.txt"), eval_data=str(d / "valid.txt"), eval_tokens=EVAL_TOKENS, steps=3,
                  seq_len=SEQ, batch=2, lr=3e-3, warmup=1, lm_loss_weight=0.1, log_every=0)
    return d, rep


def _hf_ppl(model_dir, blocks) -> float:
    """transformers' own next-token loss on `blocks` (labels = inputs, shifted inside), as a perplexity."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return math.exp(hf(blocks, labels=blocks).loss.item())


def test_distill_report_eval_and_transformers_agree(distilled, capsys):
    from transformers import AutoTokenizer

    from remodel.pipelines.data.data import load_texts, pack
    d, rep = distilled
    held = rep["held_out"]
    assert held["data"] == str(d / "valid.txt") and held["seq_len"] == SEQ
    assert (held["sequences"], held["tokens"]) == (EVAL_TOKENS // SEQ, EVAL_TOKENS // SEQ * SEQ)
    ev = rep["eval"]
    assert set(ev) == {"teacher", "before", "after"}
    for fig in ev.values():  # each figure names its tokens, the same ones
        assert (fig["tokens"], fig["sequences"], fig["seq_len"]) == (held["tokens"], held["sequences"], SEQ)
        assert fig["predicted_tokens"] == held["sequences"] * (SEQ - 1)
    # the eval command the report names, run as a user would
    argv = shlex.split(held["eval_command"])
    assert argv[:3] == ["remodel", "eval", str(d / "out")]
    capsys.readouterr()
    assert cli.main(argv[1:]) == 0
    out = capsys.readouterr()
    got = json.loads(out.out)
    assert (got["tokens"], got["seq_len"], got["data"]) == (held["tokens"], SEQ, held["data"])
    assert f"on {held['tokens']:,} tokens ({held['sequences']} x {SEQ}" in out.err
    # transformers on those tokens (packed from the text by transformers' own tokenizer)
    blocks = pack(load_texts(d / "valid.txt"), AutoTokenizer.from_pretrained(d / "out"), SEQ, max_tokens=EVAL_TOKENS)
    assert blocks.numel() == held["tokens"]
    hf_after, hf_before, hf_teacher = (_hf_ppl(d / x, blocks) for x in ("out", "student", "teacher"))
    assert got["ppl"] == pytest.approx(ev["after"]["ppl"], rel=1e-4)
    assert hf_after == pytest.approx(ev["after"]["ppl"], rel=1e-4)
    assert hf_before == pytest.approx(ev["before"]["ppl"], rel=1e-4)
    assert hf_teacher == pytest.approx(ev["teacher"]["ppl"], rel=1e-4)
    assert abs(ev["after"]["loss"] - ev["before"]["loss"]) > 0.01  # training moved it: three models, not one


def test_report_names_the_loss_terms(distilled):
    _, rep = distilled
    last, row = rep["last_step_losses"], rep["history"][-1]
    assert "final_loss" not in rep and set(last) >= {"total", "kl", "lm"}
    assert (last["total"], last["kl"], last["lm"]) == (row["loss"], row["kl"], row["lm"])
    a = rep["args"]  # total = the weighted sum of the named terms
    want = a["kl_weight"] * last["kl"] + a["lm_loss_weight"] * last["lm"] + a["lb_coeff"] * last.get("lb", 0) \
        + a["z_coeff"] * last.get("z", 0) + a["hidden_loss_weight"] * last.get("hidden", 0)
    assert last["total"] == pytest.approx(want, rel=1e-5)
    assert set(last) <= set(rep["loss_terms"])
    from remodel.pipelines.commands.summary import summary
    line = summary(rep)
    assert f"teacher {rep['eval']['teacher']['ppl']:.4g}" in line and f"on {rep['held_out']['tokens']:,} tokens" in line


def test_memory_estimate_matches_what_the_ranks_hold(distilled):
    """The report's train-memory estimate (compress.train_memory, the one plan --train-memory-gb filters by)
    against the parameter bytes the trainer measured on its rank: fp32 student weights and teacher."""
    _, rep = distilled
    est, held = rep["memory"]["estimate_per_rank"], rep["parallel"]["held_bytes"]
    assert est["student_weight_bytes"] == held["student"][0] and est["state"] == 4 * held["student"][0]
    assert est["teacher"] == held["teacher"][0]
    assert est["setup"]["seq_len"] == SEQ and est["setup"]["recompute"] == "none" and est["activations"] > 0


@pytest.mark.serial
def test_two_ranks_give_the_same_held_out_figures(distilled):
    """`torchrun cli.py distill` on 2 data-parallel ranks (FSDP student and teacher, each evaluated with its
    own loss after a no-grad sharded forward): teacher, before and after equal the one-process report's."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    d, rep = distilled
    repo = Path(__file__).resolve().parents[1]
    out = d / "dp2"
    a = rep["args"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(repo / "cli.py"),
           "distill", "--teacher", str(d / "teacher"), "--student", str(d / "student"), str(out), "--data",
           str(d / "train.txt"), "--eval-data", str(d / "valid.txt"), "--eval-tokens", str(EVAL_TOKENS),
           "--seq-len", str(SEQ), "--batch", "2", "--steps", "3", "--lr", str(a["lr"]), "--warmup", "1",
           "--lm-loss-weight", "0.1"]
    path = os.pathsep.join([str(repo)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=repo, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    two = json.loads((out / "remodel_report.json").read_text())
    assert two["parallel"]["dp"] == 2 and two["held_out"]["tokens"] == rep["held_out"]["tokens"]
    for k in ("teacher", "before", "after"):
        assert two["eval"][k]["ppl"] == pytest.approx(rep["eval"][k]["ppl"], rel=1e-5), k
    est, held = two["memory"]["estimate_per_rank"], two["parallel"]["held_bytes"]
    assert est["setup"]["dp"] == 2 and est["student_weight_bytes"] == pytest.approx(held["student"][0], rel=0.01)
