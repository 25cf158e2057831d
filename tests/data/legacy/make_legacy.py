"""Writes the files of tests/test_legacy_files.py: what remodel wrote before issue 54's config tree (commit
f2afb30), kept so later code is tested on them. A tiny nemotron_h (Mamba-2, attention, MLP, MoE) at the embedded
tokenizer's vocabulary: `score`, `prune --scores` and a 2-step `distill` with a checkpoint per step. Kept: the
model, the scores, the pruned student with its report, the distill report and the run's first checkpoint (the
tokenizer files are the embedded ones: the test copies them in). Run once: python tests/data/legacy/make_legacy.py"""
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TINY = dict(hybrid_override_pattern="M*M-EM", vocab_size=2048, hidden_size=8, head_dim=4, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=24, mamba_num_heads=8, mamba_head_dim=4, n_groups=2,
            ssm_state_size=8, chunk_size=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
            moe_shared_expert_intermediate_size=12, n_group=2, topk_group=1, routed_scaling_factor=2.5,
            tie_word_embeddings=True)
DISTILL = ["--steps", "2", "--seq-len", "32", "--batch", "2", "--checkpoint-every", "1", "--keep-last", "0",
           "--log-every", "0"]


def main():
    from transformers import AutoConfig, AutoModelForCausalLM

    from remodel import cli
    from remodel.models.config import ModelConfig
    from remodel.models.load import load_config
    from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path
    corpus = str(embedded_corpus()[1])
    w = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("nemotron_h", **TINY)).to(torch.bfloat16).save_pretrained(w / "model")
    for f in embedded_tokenizer_path().iterdir():
        shutil.copy(f, w / "model" / f.name)
    assert cli.main(["score", str(w / "model"), "--data", corpus, "--out", str(w / "scores"), "--samples", "8",
                     "--seq-len", "32"]) == 0
    assert cli.main(["prune", str(w / "model"), str(w / "pruned"), "--scores", str(w / "scores"), "--ffn-size", "16",
                     "--experts", "6"]) == 0
    assert cli.main(["distill", "--teacher", str(w / "model"), "--student", str(w / "pruned"), str(w / "dist"),
                     "--data", corpus, *DISTILL]) == 0
    shutil.rmtree(HERE / "files", ignore_errors=True)
    keep = {"model": ("config.json", "model.safetensors"),
            "scores": ("scores.json", "scores.safetensors", "remodel_report.json"),
            "pruned": ("config.json", "model.safetensors", "remodel_report.json"),
            "dist": ("remodel_report.json",), "dist.run": (".remodel-run",),
            "dist.run/step-000001": ("meta.json", "dcp_metadata.json", "__0_0.distcp")}
    for d, names in keep.items():
        (HERE / "files" / d).mkdir(parents=True)
        for n in names:
            shutil.copy(w / d / n, HERE / "files" / d / n)
    cfg = load_config(w / "model")
    (HERE / "files" / "remodel_config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    shutil.rmtree(w)


if __name__ == "__main__":
    sys.exit(main())
