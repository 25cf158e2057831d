"""Quantized tiny checkpoints in the released layouts, shared by the FP8 and MXFP4 tests (a plain helper module,
not a test module): FP8 blocks as DeepSeek-V3 ships them, MXFP4 experts as gpt-oss does."""
import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from remodel.models import mxfp4
from remodel.models.fp8 import grid

EXPERTS = ("gate_up_proj", "down_proj")  # gpt-oss's expert tensors stored as MXFP4
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def quantize(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scale_inv) of w with one scale per block (amax / 448, edges ragged): a quantizer
    written here, independent of models/fp8.py."""
    *lead, r, c = w.shape
    gr, gc = grid(w.shape, block)[-2:]
    pad = torch.zeros(*lead, gr * block[0], gc * block[1])
    pad[..., :r, :c] = w.float()
    blocks = pad.view(*lead, gr, block[0], gc, block[1])
    amax = blocks.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(pad.shape)[..., :r, :c]
    return q.to(torch.float8_e4m3fn).contiguous(), scale_inv.float()


def quantized(name: str, t: torch.Tensor) -> bool:
    """The tensors a DeepSeek-V3 FP8 release stores quantized: the decoder's projection weights (not the router)."""
    return t.dim() == 2 and name.endswith("proj.weight") and ".layers." in name


def fp8_copy(src, dst, block, **quant) -> None:
    """`src` with its projections quantized in blocks `block` and config.json's quantization_config."""
    shutil.copytree(src, dst)
    out = {}
    for k, t in load_file(src / "model.safetensors").items():
        if quantized(k, t):
            out[k], out[k + "_scale_inv"] = quantize(t, block)
        else:
            out[k] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), **quant}
    (dst / "config.json").write_text(json.dumps(cfg))


def dequantized_copy(src, dst, block) -> None:
    """The plain checkpoint of FP8 `src`, dequantized by transformers' own function, in the config's dtype."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    dtype = getattr(torch, cfg.get("dtype") or "bfloat16")
    tensors = load_file(src / "model.safetensors")
    out = {k: _dequantize_fp8_weight(t, tensors[k + "_scale_inv"], list(block), torch.float32).to(dtype)
           if t.dtype == torch.float8_e4m3fn else t for k, t in tensors.items() if not k.endswith("_scale_inv")}
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))


def to_mxfp4(d, out):
    """Checkpoint d rewritten in the released layout: each expert projection as MXFP4 blocks and scales."""
    out.mkdir()
    tensors, packed = load_file(d / "model.safetensors"), {}
    for k, t in tensors.items():
        if k.rsplit(".", 1)[-1] in EXPERTS:
            packed[k + "_blocks"], packed[k + "_scales"] = mxfp4.quantize(t)
        else:
            packed[k] = t
    save_file(packed, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                      "model.layers.*.mlp.router"]}
    (out / "config.json").write_text(json.dumps(cfg))
    return packed
