"""FP8 block-quantized checkpoints (models/fp8.py), as DeepSeek-V3 / Kimi-K2 / GLM-4.5-FP8 / MiniMax-M2 ship them:
float8_e4m3fn weights beside float32 `weight_scale_inv` block scales. A transformers-saved tiny deepseek_v3 is quantized
here (per-expert weights, the attention's and MLPs' projections; embeddings, norms, the router and lm_head plain, as
released). The dequantization equals transformers' bit for bit (its load-time Fp8Dequantize where it applies, its
ragged-edge dequantization elsewhere), transformers loads the FP8 checkpoint with our weights and logits, inspect
counts it as transformers does, score / convert / prune on it write exactly what they write for its dequantized
copy, and every malformed FP8 checkpoint is refused in one line with nothing written."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from remodel import cli
from remodel.models.checkpoint import CheckpointReader
from remodel.models.errors import RemodelError
from remodel.models.families import FAMILIES
from remodel.models.fp8 import dequantize
from remodel.pipelines.data.data import embedded_corpus
from tests.conftest import cli_pair
from tests.quantized import dequantized_copy, fp8_copy, quantize, quantized

FAMILY, CASE = "deepseek_v3", "q_lora_grouped"
@pytest.fixture(scope="module")
def source(tmp_path_factory):
    _, ours, d = cli_pair(FAMILY, CASE, tmp_path_factory.mktemp("fp8"))
    return ours, d


# ---- the arithmetic ------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(256, 384), (2, 128, 256), (200, 130), (3, 129, 257), (5, 7)])
def test_dequantize_is_transformers_bit_for_bit(shape):
    """Whole blocks: transformers' load-time Fp8Dequantize in float32 and bfloat16. Ragged edges (which that op
    cannot take: it derives the block from the scale grid) against transformers' block-size dequantization, the
    float32 product, then one rounding to bfloat16."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight
    block = (128, 128)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * torch.logspace(-3, 1, shape[-1])
    q, s = quantize(w, block)
    exact = _dequantize_fp8_weight(q, s, list(block), torch.float32)
    assert torch.equal(dequantize(q, s, block, torch.float32), exact)
    assert torch.equal(dequantize(q, s, block, torch.bfloat16), exact.to(torch.bfloat16))
    if all(n % b == 0 for n, b in zip(shape[-2:], block)):
        op = Fp8Dequantize(None)
        for dt in (torch.float32, torch.bfloat16):
            assert torch.equal(dequantize(q, s, block, dt), op._dequantize_one(q, s, output_dtype=dt))
    assert (dequantize(q, s, block, torch.float32) - w).abs().max() <= w.abs().max() / 8  # e4m3: 3 mantissa bits


# ---- a whole checkpoint ----------------------------------------------------------------------------------

def test_transformers_loads_the_fp8_checkpoint_with_our_weights_and_logits(source, tmp_path):
    """transformers (CPU: it dequantizes on load) and our reader give every weight bit for bit, and the model the
    same logits (blocks [128, 128] as released: every tiny weight is one ragged block)."""
    from transformers import AutoModelForCausalLM

    from remodel.models.load import load_model
    ours, d = source
    fp8_copy(d, tmp_path / "fp8", (128, 128))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    state = hf.state_dict()
    with CheckpointReader(tmp_path / "fp8") as r:
        names = [k for k in r.keys() if quantized(k, r.get(k)) and k in state]
        assert len(names) > 20 and "quantization_config" not in r.config
        for k in names:
            assert r.dtype(k) == torch.float32 and torch.equal(r.get(k), state[k]), k
    x = torch.randint(0, ours.cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = load_model(tmp_path / "fp8")(x), hf(x).logits
    assert (a - b).abs().max().item() <= 1e-4
    assert (a - ours(x)).abs().max().item() > 1e-4  # quantized: not the fp32 source's logits


def test_inspect_counts_an_fp8_checkpoint_as_transformers_does(source, tmp_path):
    from transformers import AutoModelForCausalLM

    from remodel.pipelines.commands.inspection import inspect
    _, d = source
    fp8_copy(d, tmp_path / "fp8", (16, 16))
    got = inspect(tmp_path / "fp8")
    hf = AutoModelForCausalLM.from_pretrained(d)  # the dequantized model's parameters (ragged 16-blocks: our copy)
    assert got["params"]["total"] == sum(p.numel() for p in hf.parameters())
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    ck = got["checkpoint"]
    assert ck["tensor_bytes"] == sum(t.nbytes for t in stored.values()) and not ck["config_mismatches"]
    assert ck["dtype_bytes"]["float8_e4m3fn"] == sum(t.nbytes for t in stored.values() if t.element_size() == 1)
    assert ck["tensors"] == len([k for k in stored if not k.endswith("_scale_inv")])


def test_score_convert_prune_on_fp8_equal_its_dequantized_copy(source, tmp_path):
    """Ragged 16 x 16 blocks (kv_b_proj 44 rows, q_b_proj 10 columns ...): score, convert and prune (experts, MLA
    heads, latent rank, value head size) on the FP8 checkpoint write byte for byte what they write for its copy
    dequantized by transformers' function; with --dtype the outputs are plain (no quantization_config, no float8;
    without it they keep the source's format: tests/test_fp8_output.py)."""
    _, d = source
    fp8_copy(d, tmp_path / "fp8", (16, 16))
    dequantized_copy(tmp_path / "fp8", tmp_path / "plain", (16, 16))
    data = str(embedded_corpus()[1])
    for src in ("fp8", "plain"):
        s = tmp_path / src
        assert cli.main(["score", str(s), "--data", data, "--out", str(tmp_path / f"{src}.s"), "--samples", "4",
                         "--seq-len", "16", "--no-loss-increase"]) == 0
        assert cli.main(["convert", str(s), str(tmp_path / f"{src}.c"), "--dtype", "float32"]) == 0
        assert cli.main(["prune", str(s), str(tmp_path / f"{src}.p"), "--scores", str(tmp_path / f"{src}.s"),
                         "--experts", "6", "--mla-heads", "3", "--kv-lora-rank", "8", "--v-head-dim", "4",
                         "--dtype", "float32"]) == 0
    assert load_file(tmp_path / "fp8.s" / "scores.safetensors").keys()
    for out in ("s/scores.safetensors", "c/model.safetensors", "c/config.json", "p/model.safetensors", "p/config.json"):
        a, b = (tmp_path / f"{src}.{out}" for src in ("fp8", "plain"))
        assert a.read_bytes() == b.read_bytes(), out
    cfg = json.loads((tmp_path / "fp8.p" / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["n_routed_experts"] == 6
    assert {t.dtype for t in load_file(tmp_path / "fp8.p" / "model.safetensors").values()} == {torch.float32}


# ---- refusals -------------------------------------------------------------------------------------------

def _scale(k):
    return k + "_scale_inv"


BAD = {
    "no quantization_config": (lambda t, k: t, lambda c: c.pop("quantization_config"), "quant_method 'fp8'"),
    "scale grid": (lambda t, k: t.update({_scale(k): t[_scale(k)][:1].contiguous()}), None, "needs float32 scales"),
    "scale dtype": (lambda t, k: t.update({_scale(k): t[_scale(k)].bfloat16()}), None, "needs float32 scales"),
    "scale missing": (lambda t, k: t.pop(_scale(k)), None, "missing"),
    "orphan scale": (lambda t, k: t.update({k: t[k].float()}), None, "scales no float8_e4m3fn weight"),
    "e5m2 weight": (lambda t, k: t.update({k: t[k].float().to(torch.float8_e5m2)}), None, "float8_e4m3fn"),
    "block size": (None, lambda c: c["quantization_config"].update(weight_block_size=[16]), "weight_block_size"),
    "fmt": (None, lambda c: c["quantization_config"].update(fmt="e5m2"), "fmt"),
    "static activations": (None, lambda c: c["quantization_config"].update(activation_scheme="static"),
                           "activation_scheme"),
    "nan scale": (lambda t, k: t[_scale(k)].fill_(float("nan")), None, "non-finite block scales"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_fp8_is_refused_in_one_line_with_nothing_written(source, tmp_path, case):
    """Each malformed FP8 checkpoint: the reader (or convert, for values only a read sees) names the problem in
    one line, and convert writes nothing."""
    _, d = source
    fp8_copy(d, tmp_path / "fp8", (16, 16))
    edit_tensors, edit_config, words = BAD[case]
    f, c = tmp_path / "fp8" / "model.safetensors", tmp_path / "fp8" / "config.json"
    if edit_tensors:
        t = load_file(f)
        edit_tensors(t, "model.layers.1.self_attn.kv_b_proj.weight")
        save_file(t, f)
    if edit_config:
        cfg = json.loads(c.read_text())
        edit_config(cfg)
        c.write_text(json.dumps(cfg))
    with pytest.raises(RemodelError) as e:
        from remodel.pipelines.commands.convert import convert
        convert(tmp_path / "fp8", tmp_path / "out")
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()
