"""gpt-oss by the CLI and its MXFP4 checkpoints (issue 56; the family suite runs its tiny cases: test_families).

A tiny gpt_oss saved by transformers goes through inspect, score, prune on every width at once and by decoder
layer (the pruned config's layer_types follow the kept layers), eval; transformers reloads the pruned checkpoint
with the in-memory pruning's logits. MXFP4: our dequantization equals transformers' convert_moe_packed_tensors
bit for bit; a checkpoint rewritten to the released layout (experts as *_blocks / *_scales, quantization_config
mxfp4) loads with exactly those weights and transformers' logits on them, converts to plain weights, and a bad
pair (dtype, shape, an overflowing scale) is refused in one line."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from remodel import cli
from remodel.compress.prune import plan_keep, prune_model
from remodel.models import mxfp4
from remodel.models.errors import RemodelError
from remodel.models.families import FAMILIES
from remodel.models.load import load_model
from remodel.models.regions import RegionReader
from remodel.pipelines.data.data import embedded_corpus
from tests.quantized import to_mxfp4
from tests.conftest import cli_flags, cli_inspect_and_score, cli_pair, hf_pair, prune_axes, reloaded_equals_in_memory

FAMILY = "gpt_oss"
TINY = {**FAMILIES[FAMILY].tiny["yarn"], "intermediate_size": 32}  # MXFP4: 32-value blocks
EXPERTS = ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return cli_pair(FAMILY, "yarn", tmp_path_factory.mktemp(FAMILY))


def test_cli_inspect_score_prune_every_width_and_depth(pair, tmp_path, capsys):
    _, ours, d = pair
    data = str(embedded_corpus()[1])
    scores = cli_inspect_and_score(d, ours, tmp_path / "s", capsys)
    targets = prune_axes(ours.cfg)
    assert {"experts", "expert_ffn_size", "attn_heads", "hidden_size"} <= set(targets)
    out = tmp_path / "widths"
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s"), *cli_flags(targets)]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert (hf["num_local_experts"], hf["intermediate_size"], hf["num_attention_heads"], hf["hidden_size"]) == (
        targets["experts"], targets["expert_ffn_size"], targets["attn_heads"], targets["hidden_size"])
    reloaded_equals_in_memory(out, prune_model(ours, plan_keep(ours.cfg, scores, targets)))
    assert cli.main(["eval", str(out), "--data", data, "--seq-len", "32", "--max-tokens", "2048"]) == 0
    out = tmp_path / "depth"  # the sliding layer 0 dropped: the full layer stays full
    assert cli.main(["prune", str(d), str(out), "--scores", str(tmp_path / "s"), "--drop-layers", "0"]) == 0
    hf = json.loads((out / "config.json").read_text())
    assert hf["layer_types"] == ["full_attention"] and load_model(out).cfg.pattern == "FE"


def _hf_dequantized(blocks, scales, dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)


def test_dequantize_equals_transformers_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 64, 40, generator=g) * torch.logspace(-6, 6, 40)  # [E, cols, rows], magnitudes far apart
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (3, 40, 2, 16) and scales.shape == (3, 40, 2) and blocks.dtype == scales.dtype == torch.uint8
    scales[0, 0, 0], scales[0, 1, 0] = 0, mxfp4.MAX_SCALE  # the extremes of the range
    for dtype in (torch.bfloat16, torch.float32):
        ours, theirs = mxfp4.dequantize(blocks, scales, dtype), _hf_dequantized(blocks, scales, dtype)
        assert ours.dtype == theirs.dtype == dtype and ours.shape == theirs.shape == w.shape
        assert torch.equal(ours.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           theirs.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    back = mxfp4.dequantize(*mxfp4.quantize(w), torch.float32)
    assert ((back - w).abs() <= w.abs().unflatten(1, (2, 32)).amax(2, keepdim=True).expand(-1, -1, 32, -1)
            .flatten(1, 2) / 3).all()  # within half an FP4 step (<= the block's scale <= its amax / 3): a quantizer


def test_mxfp4_checkpoint_reads_transformers_dequantization(tmp_path):
    hf, _, d = hf_pair(FAMILY, tmp_path, "model", 7, **TINY)
    packed = to_mxfp4(d, tmp_path / "mxfp4")
    ours = load_model(tmp_path / "mxfp4")
    for j in range(2):
        p = f"model.layers.{j}.mlp.experts."
        gate_up, down = (_hf_dequantized(packed[p + n + "_blocks"], packed[p + n + "_scales"], torch.float32)
                         for n in EXPERTS)
        ex = ours.layers[2 * j + 1].mixer.experts
        assert torch.equal(ex.gate_proj, gate_up[..., 0::2].transpose(1, 2)) and torch.equal(
            ex.up_proj, gate_up[..., 1::2].transpose(1, 2)) and torch.equal(ex.down_proj, down.transpose(1, 2))
        with torch.no_grad():
            hf.model.layers[j].mlp.experts.gate_up_proj.copy_(gate_up)
            hf.model.layers[j].mlp.experts.down_proj.copy_(down)
    x = torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max().item() <= 1e-4
    out = tmp_path / "plain"  # --dtype: plain weights, transformers loads it, no quantization_config left
    assert cli.main(["convert", str(tmp_path / "mxfp4"), str(out), "--dtype", "float32"]) == 0
    written = load_file(out / "model.safetensors")
    assert not any(k.endswith(("_blocks", "_scales")) for k in written)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    reloaded_equals_in_memory(out, ours)
    with pytest.raises(RemodelError) as e:  # sharded loading reads regions of plain tensors only: refused, with the fix
        RegionReader(tmp_path / "mxfp4").read("layers.1.mixer.experts.down_proj", [None, None, None])
    assert "MXFP4" in str(e.value) and "remodel convert --dtype" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bad", ["scale_255", "scale_overflow", "dtype", "shape"])
def test_bad_mxfp4_refused_in_one_line(bad, tmp_path):
    _, _, d = hf_pair(FAMILY, tmp_path, "model", 7, **TINY)
    packed = to_mxfp4(d, tmp_path / "q")
    k = "model.layers.0.mlp.experts.down_proj_"
    if bad.startswith("scale"):
        packed[k + "scales"][0, 0, 0] = 255 if bad == "scale_255" else mxfp4.MAX_SCALE + 1
    elif bad == "dtype":
        packed[k + "scales"] = packed[k + "scales"].to(torch.int16)
    else:
        packed[k + "blocks"] = packed[k + "blocks"][..., :8].contiguous()
    save_file(packed, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RemodelError) as e:
        load_model(tmp_path / "q")
    assert "MXFP4" in str(e.value) and "down_proj" in str(e.value) and "\n" not in str(e.value)


def test_slots_carry_each_layers_window():
    """Each attention slot's section holds its own window ('*' the section's, 'F' none), and depth pruning keeps
    them with their layers (the pattern's characters go with the layers)."""
    from remodel.compress.prune import new_config
    from remodel.models.hf import config_from_hf
    cfg = config_from_hf({"model_type": FAMILY, **FAMILIES[FAMILY].tiny["full_first_tied"]})
    assert cfg.pattern == "FE*E*E"
    assert [s.section.sliding_window for s in cfg.slots if s.kind.section_name == "attention"] == [None, 3, 3]
    kept = new_config(cfg, {"layers": torch.tensor([2, 3, 4, 5])})  # the full decoder layer 0 dropped
    assert [s.section.sliding_window for s in kept.slots if s.kind.section_name == "attention"] == [3, 3]
    kept = new_config(cfg, {"layers": torch.tensor([0, 1, 4, 5])})
    assert [s.section.sliding_window for s in kept.slots if s.kind.section_name == "attention"] == [None, 3]
