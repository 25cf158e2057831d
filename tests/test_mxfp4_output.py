"""Outputs of an MXFP4 source (gpt-oss's released experts) keep its format (models/mxfp4.py Mxfp4Output): experts a
command did not change are their stored blocks and scales, byte for byte (pruned experts: the kept ones stacked);
a tensor with a changed expert is re-quantized; config.json keeps quantization_config; --dtype writes plain.
transformers loads each output (CPU: it dequantizes MXFP4 on load) with the logits of the same pruning written
plain: exactly for expert pruning (nothing re-quantized)."""
import json

import pytest
import torch
from safetensors.torch import load_file

from remodel import cli
from remodel.models.errors import RemodelError
from remodel.models.regions import RegionReader
from tests.conftest import hf_pair
from remodel.models.families import FAMILIES
from tests.quantized import to_mxfp4

FAMILY = "gpt_oss"
TINY = {**FAMILIES[FAMILY].tiny["yarn"], "intermediate_size": 32}  # MXFP4: 32-value blocks

TINY32 = {**TINY, "hidden_size": 64}  # gate_up_proj's blocks run along hidden: two 32-value blocks, cut to one
# --hidden-size 32 re-quantizes every expert (FP4 e2m1: 1 mantissa bit): the float32 logits (std ~0.83) moved by a
# mean |diff| of 0.0039 .. 0.0105 over 6 token draws (seeds 0-5; max |diff| 0.026 .. 0.086). Bound: ~2.4x the most.
REQUANT_MEAN_LOGITS = 0.025


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    """(MXFP4 checkpoint, its scores) of a tiny gpt-oss."""
    root = tmp_path_factory.mktemp("mxfp4_out")
    _, _, d = hf_pair(FAMILY, root, "model", 7, **TINY32)
    to_mxfp4(d, root / "mxfp4")
    assert cli.main(["score", str(root / "mxfp4"), "--out", str(root / "s"), "--method", "magnitude"]) == 0
    return root / "mxfp4", root / "s"


def same_bytes(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def logits(path, seed=1) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return hf(x).logits


def test_convert_keeps_the_mxfp4_bytes(mx, tmp_path):
    src, _ = mx
    assert cli.main(["convert", str(src), str(tmp_path / "c")]) == 0
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "c" / "model.safetensors")
    assert a.keys() == b.keys() and sum(k.endswith("_blocks") for k in a) == 4
    assert all(same_bytes(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"] == json.loads(
        (src / "config.json").read_text())["quantization_config"]


def test_expert_pruning_copies_the_kept_experts_blocks_and_scales(mx, tmp_path):
    """prune --experts 3 of 4: each layer's blocks and scales are the kept experts' stored ones stacked; transformers
    loads it with exactly the logits of the same pruning written plain."""
    src, scores = mx
    for out, more in (("q", []), ("p", ["--dtype", "float32"])):
        assert cli.main(["prune", str(src), str(tmp_path / out), "--scores", str(scores), "--experts", "3", *more]) == 0
    rep = json.loads((tmp_path / "q" / "remodel_report.json").read_text())
    kept = [v["indices"] for k, v in sorted(rep["kept"].items(), key=lambda kv: int(kv[0].split(".")[1]))
            if k.endswith(".experts")]
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "q" / "model.safetensors")
    assert len(kept) == 2 and all(len(k) == 3 for k in kept)
    for j, idx in enumerate(kept):
        for n in ("gate_up_proj", "down_proj"):
            for part in ("_blocks", "_scales"):
                k = f"model.layers.{j}.mlp.experts.{n}{part}"
                assert same_bytes(b[k], a[k][idx].contiguous()), k
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    assert torch.equal(logits(tmp_path / "q"), logits(tmp_path / "p"))


def test_a_hidden_cut_requantizes_and_sharded_loading_refuses(mx, tmp_path):
    """prune --hidden-size 32 of 64 cuts every expert: re-quantized (MXFP4 in the output, the logits those of the
    plain pruning within MXFP4's rounding); a width not a multiple of 32 along the blocks is refused in one line
    naming --dtype, nothing written; sharded loading refuses the quantized output naming the fix."""
    src, scores = mx
    for out, more in (("q", []), ("p", ["--dtype", "float32"])):
        assert cli.main(["prune", str(src), str(tmp_path / out), "--scores", str(scores), "--hidden-size", "32",
                         *more]) == 0
    b = load_file(tmp_path / "q" / "model.safetensors")
    assert b["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape[-2:] == (1, 16)
    diff = (logits(tmp_path / "q") - logits(tmp_path / "p")).abs()
    assert 0 < diff.mean().item() <= REQUANT_MEAN_LOGITS
    assert cli.main(["prune", str(src), str(tmp_path / "bad"), "--scores", str(scores), "--hidden-size", "48"]) == 2
    assert not (tmp_path / "bad").exists()
    with pytest.raises(RemodelError) as e:
        RegionReader(tmp_path / "q").read("layers.1.mixer.experts.down_proj", [None, None, None])
    assert "MXFP4" in str(e.value) and "--dtype" in str(e.value)
