"""Outputs of an FP8 block-quantized source keep its format (models/fp8.py Fp8Output, models.checkpoint.QUANTIZERS):
a weight the command did not change is its stored float8 bytes and float32 block scales copied (renamed where an
expert or layer was renumbered), a changed one is re-quantized in the source's blocks as transformers' Fp8Quantize
does, config.json keeps quantization_config; `--dtype` writes plain weights. transformers loads each output and its
dequantized logits equal those of the same pruning written plain, exactly where nothing was re-quantized and within
the measured FP8 rounding where something was."""
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from remodel import cli
from remodel.models.fp8 import quantize
from remodel.pipelines.data.data import embedded_corpus
from tests.conftest import cli_pair
from tests.quantized import dequantized_copy, fp8_copy

BLOCK = (16, 16)  # ragged on the tiny model: kv_b_proj 44 rows, q_b_proj 10 columns, the experts whole blocks
WHOLE = (128, 128)  # as released: every tiny weight one block, which transformers' FP8 loader takes
QUANT = {"modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]}  # kept verbatim in every output
# Re-quantizing an expert FFN cut (--expert-ffn-size 8 of 16, inside the 16 x 16 blocks; e4m3 keeps 3 mantissa
# bits: a weight moves by up to 2**-4 of itself) moved the tiny model's float32 logits (std 0.86) by a mean |diff|
# of 0.0125 .. 0.0218 over 6 token draws (seeds 0-5), against 0.070 .. 0.137 for FP8's own rounding of the source
# (the FP8 checkpoint vs its float32 original, same draws). The max |diff| is no bound: a moved hidden state flips a
# top-k routing choice (0.10 .. 1.39 requantized, 2.1 .. 4.0 for the source's own rounding). Bound: ~2x the largest
# measured mean, under FP8's own.
REQUANT_MEAN_LOGITS = 0.04


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(our model, its transformers-saved checkpoint) of the tiny deepseek_v3 the FP8 copies are made of."""
    _, ours, d = cli_pair("deepseek_v3", "q_lora_grouped", tmp_path_factory.mktemp("fp8_out"))
    return ours, d


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def logits(path, vocab, block=WHOLE, seed=0) -> torch.Tensor:
    """transformers' float32 logits of checkpoint `path`: loaded as it is (CPU: FP8 dequantized on load), or for
    ragged blocks (which its loader's Fp8Dequantize cannot take) its copy dequantized by transformers' function."""
    from transformers import AutoModelForCausalLM
    if block != WHOLE and "quantization_config" in json.loads((path / "config.json").read_text()):
        dq = path.with_name(path.name + ".dq")
        if not dq.exists():
            dequantized_copy(path, dq, block)
        path = dq
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return hf(x).logits


@pytest.fixture(scope="module")
def fp8(source, tmp_path_factory):
    """({block: FP8 checkpoint}, scores) of the tiny deepseek_v3 in blocks 16 x 16 and 128 x 128 (one set of
    scores: same model shape)."""
    _, d = source
    root = tmp_path_factory.mktemp("fp8_out")
    for b in (BLOCK, WHOLE):
        fp8_copy(d, root / f"fp8_{b[0]}", b, **QUANT)
    assert cli.main(["score", str(root / "fp8_16"), "--data", str(embedded_corpus()[1]), "--out", str(root / "s"),
                     "--samples", "4", "--seq-len", "16", "--no-loss-increase"]) == 0
    return {BLOCK: root / "fp8_16", WHOLE: root / "fp8_128"}, root / "s"


@pytest.mark.parametrize("shape", [(256, 384), (2, 128, 256), (200, 130), (5, 7)])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantize_is_transformers_fp8quantize_bit_for_bit(shape, ue8m0):
    """Whole blocks: transformers' Fp8Quantize, bit for bit. Ragged edges (which it passes through unquantized):
    its quantization of the weight zero-padded to whole blocks, cut back."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    block = (128, 128)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * torch.logspace(-3, 1, shape[-1])
    w[..., :3, :5] = 0  # an all-zero corner (a whole zero block at the small shape): scale 1
    rows, cols = -(-shape[-2] // 128) * 128, -(-shape[-1] // 128) * 128
    pad = torch.zeros(*shape[:-2], rows, cols)
    pad[..., :shape[-2], :shape[-1]] = w
    cfg = SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=list(block),
                                                              scale_fmt="ue8m0" if ue8m0 else None))
    ref = Fp8Quantize(cfg)._quantize_one("x.weight", pad)
    q, s = quantize(w, block, ue8m0)
    assert same_bytes(q, ref["x.weight"][..., :shape[-2], :shape[-1]].contiguous())
    assert torch.equal(s, ref["x.weight_scale_inv"].float())


def test_convert_keeps_the_fp8_bytes_and_dtype_writes_plain(fp8, tmp_path):
    """convert with the default dtype: every tensor (float8 weights, scales, plain ones) byte-identical to the
    input's, quantization_config as the source's; --dtype float32: plain weights, no quantization_config."""
    src = fp8[0][BLOCK]
    assert cli.main(["convert", str(src), str(tmp_path / "c")]) == 0
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "c" / "model.safetensors")
    assert a.keys() == b.keys() and sum(t.dtype == torch.float8_e4m3fn for t in a.values()) > 20
    assert all(same_bytes(a[k], b[k]) for k in a)
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["quantization_config"] == json.loads((src / "config.json").read_text())["quantization_config"]
    assert cli.main(["convert", str(src), str(tmp_path / "p"), "--dtype", "float32"]) == 0
    plain = load_file(tmp_path / "p" / "model.safetensors")
    assert {t.dtype for t in plain.values()} == {torch.float32} and not any("_scale_inv" in k for k in plain)
    assert "quantization_config" not in json.loads((tmp_path / "p" / "config.json").read_text())


def _prune(src, scores, out, *flags) -> dict:
    assert cli.main(["prune", str(src), str(out), "--scores", str(scores), *flags]) == 0
    return json.loads((out / "remodel_report.json").read_text())


def _source_name(name: str, experts: list) -> str:
    """The source tensor an output tensor came from: output expert j is kept expert experts[j]."""
    parts = name.split(".")
    if "experts" in parts:
        i = parts.index("experts") + 1
        parts[i] = str(experts[int(parts[i])])
    return ".".join(parts)


@pytest.mark.parametrize("block", [BLOCK, WHOLE])
def test_expert_pruning_copies_every_fp8_weight_and_scale_byte_for_byte(fp8, tmp_path, block):
    """prune --experts 6 of 8: every float8 weight and its scales byte-identical to the source's (the kept
    experts renumbered), the sliced router plain; transformers loads it and its logits equal those of the same
    pruning written plain (--dtype float32) exactly: nothing was re-quantized."""
    src, scores = fp8[0][block], fp8[1]
    rep = _prune(src, scores, tmp_path / "q", "--experts", "6")
    _prune(src, scores, tmp_path / "p", "--experts", "6", "--dtype", "float32")
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "q" / "model.safetensors")
    stored = [k for k, t in b.items() if t.dtype == torch.float8_e4m3fn or k.endswith("_scale_inv")]
    assert len(stored) > 40 and all(k[:-len("_scale_inv")] in b for k in stored if k.endswith("_scale_inv"))
    ours = sorted((k for k in rep["kept"] if k.endswith(".experts")), key=lambda k: int(k.split(".")[1]))
    moe = sorted({int(k.split(".")[2]) for k in b if ".mlp.experts." in k})  # HF layer j <-> our j-th MoE layer
    kept = {layer: rep["kept"][k]["indices"] for layer, k in zip(moe, ours, strict=True)}
    assert all(len(v) == 6 for v in kept.values()) and len(kept) == 2
    for k in stored:
        assert same_bytes(b[k], a[_source_name(k, kept.get(int(k.split(".")[2]), range(8)))]), k
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["n_routed_experts"] == 6 and cfg["quantization_config"]["modules_to_not_convert"] == QUANT[
        "modules_to_not_convert"]
    vocab = cfg["vocab_size"]
    assert torch.equal(logits(tmp_path / "q", vocab, block), logits(tmp_path / "p", vocab))


def test_a_depth_cut_copies_the_renumbered_layers_byte_for_byte(fp8, tmp_path):
    """prune --drop-layers 0 (the dense first layer): output layer i is source layer i + 1 (an MoE layer now at an
    index whose source layer was dense), every float8 weight and scale byte-identical to it; transformers loads the
    FP8 output and its logits equal the plain pruning's exactly."""
    src, scores = fp8[0][WHOLE], fp8[1]
    _prune(src, scores, tmp_path / "q", "--drop-layers", "0")
    _prune(src, scores, tmp_path / "p", "--drop-layers", "0", "--dtype", "float32")
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "q" / "model.safetensors")
    stored = [k for k, t in b.items() if t.dtype == torch.float8_e4m3fn or k.endswith("_scale_inv")]
    assert len(stored) > 40 and "model.layers.0.mlp.experts.0.up_proj.weight" in stored
    for k in stored:
        i = k.split(".")[2]
        assert same_bytes(b[k], a[k.replace(f"layers.{i}.", f"layers.{int(i) + 1}.", 1)]), k
    vocab = json.loads((tmp_path / "q" / "config.json").read_text())["vocab_size"]
    assert torch.equal(logits(tmp_path / "q", vocab), logits(tmp_path / "p", vocab))
    from remodel.models.errors import RemodelError
    from remodel.models.regions import RegionReader
    with pytest.raises(RemodelError) as e:  # sharded loading reads plain regions: refused, naming the fix
        RegionReader(tmp_path / "q").read("layers.0.mixer.kv_b_proj.weight", [None, None])
    assert "FP8" in str(e.value) and "--dtype" in str(e.value) and "\n" not in str(e.value)


def test_a_cut_inside_the_blocks_requantizes_the_cut_weights(fp8, tmp_path):
    """prune --expert-ffn-size 8 of 16 (inside the 16 x 16 blocks): the routed experts' weights are re-quantized
    (each within e4m3's rounding of the plain pruning's weight), the rest copied byte for byte; transformers
    loads it and its logits are the plain pruning's within REQUANT_MEAN_LOGITS (mean |diff|)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    src, scores = fp8[0][BLOCK], fp8[1]
    _prune(src, scores, tmp_path / "q", "--expert-ffn-size", "8")
    _prune(src, scores, tmp_path / "p", "--expert-ffn-size", "8", "--dtype", "float32")
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "q" / "model.safetensors")
    plain = load_file(tmp_path / "p" / "model.safetensors")
    cut = [k for k, t in b.items() if t.dtype == torch.float8_e4m3fn and ".mlp.experts." in k]
    kept = [k for k, t in b.items() if t.dtype == torch.float8_e4m3fn and ".mlp.experts." not in k]
    assert len(cut) == 2 * 8 * 3 and len(kept) > 10
    assert all(same_bytes(b[k], a[k]) and same_bytes(b[k + "_scale_inv"], a[k + "_scale_inv"]) for k in kept)
    for k in cut:
        assert 8 in b[k].shape
        w = _dequantize_fp8_weight(b[k], b[k + "_scale_inv"], list(BLOCK), torch.float32)
        ref = plain[k]
        assert ((w - ref).abs() <= ref.abs() * 2.0**-4 + ref.abs().max() * 2.0**-18).all(), k
    vocab = json.loads((tmp_path / "q" / "config.json").read_text())["vocab_size"]
    diff = (logits(tmp_path / "q", vocab, BLOCK) - logits(tmp_path / "p", vocab)).abs().mean().item()
    assert 0 < diff <= REQUANT_MEAN_LOGITS


def test_plan_reports_the_fp8_sources_stored_bytes(fp8, capsys):
    """plan on the FP8 checkpoint reports (and prints) the bytes its files store: float8 weights, float32 scales and
    the plain tensors, as inspect's tensor_bytes."""
    from remodel.pipelines.commands.inspection import fmt_bytes, inspect
    src = fp8[0][BLOCK]
    stored = sum(t.nbytes for t in load_file(src / "model.safetensors").values())
    assert cli.main(["plan", str(src), "--params", "150000"]) == 0
    assert f"(stored: {fmt_bytes(stored)})" in capsys.readouterr().out
    from remodel.pipelines.commands.plan import plan
    assert plan(src, params=150000, verbose=False)["source_stored_bytes"] == stored
    assert inspect(src)["checkpoint"]["tensor_bytes"] == stored
