"""FP8 block-quantized checkpoints (DeepSeek-V3 / Kimi-K2, GLM-4.5-FP8, MiniMax-M2 releases), read as plain weights.

Such a checkpoint's config.json holds quantization_config {quant_method: fp8, fmt: e4m3, weight_block_size:
[bm, bn], activation_scheme: dynamic}. Each quantized weight W [..., rows, cols] is stored as float8_e4m3fn beside
W_scale_inv (float32 [..., ceil(rows / bm), ceil(cols / bn)], one scale per block; the last row / column of blocks
is ragged where a width is not a multiple of the block). `fp8_views`, one of models.checkpoint.DEQUANTIZERS, checks
all of that from the safetensors headers (no data read) and presents each pair as one weight under W's name:
`dequantize` (fp8 -> float32, times its block's scale, cast once to the checkpoint's dtype): transformers'
Fp8Dequantize arithmetic, bit for bit (tests/test_fp8_checkpoint.py). Scales are checked finite as they are read.
Outputs keep the format (`fp8_output`, one of models.checkpoint.QUANTIZERS): a weight a command did not change is
its stored bytes and scales copied, a changed one re-quantized by `quantize` (transformers' Fp8Quantize, ragged
edges zero-padded as DeepSeek's blocks are); tests/test_fp8_output.py.
"""
from __future__ import annotations

import hashlib
import re
from typing import Callable, NamedTuple

import torch

from .errors import RemodelError

SCALE = "_scale_inv"
FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MAX_BLOCK = 1 << 20


class Dequantized(NamedTuple):
    """A weight a quantized checkpoint stores as several tensors: their names (`parts`), its shape and dtype once
    read, and read(*parts) -> the weight (models.checkpoint.CheckpointReader.get)."""
    parts: tuple
    shape: tuple
    dtype: torch.dtype
    read: Callable


def scale_name(weight: str) -> str:
    """transformers' name of a weight's block scales: 'x.weight' -> 'x.weight_scale_inv', 'x.gate_up_proj' ->
    'x.gate_up_proj_scale_inv'."""
    return weight + SCALE


def grid(shape, block) -> tuple:
    """The scale tensor's shape for a weight of `shape`: one per block of its last two dims, edges ragged."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block, dtype: torch.dtype) -> torch.Tensor:
    """q (float8) times its block's scale, in float32, cast once to `dtype`; the scales of ragged edge blocks are
    cut to the weight's size."""
    rows, cols = q.shape[-2:]
    s = scale_inv.float().repeat_interleave(block[0], -2)[..., :rows, :]
    s = s.repeat_interleave(block[1], -1)[..., :cols]
    return q.float().mul_(s).to(dtype)


def block_size(q: dict, where) -> tuple:
    """The checked (bm, bn) of an fp8 quantization_config: e4m3 weights, dynamic activations, two block sizes."""
    def bad(what):
        raise RemodelError(f"{where}/config.json: quantization_config {what}")
    if q.get("fmt", "e4m3") != "e4m3":
        bad(f"fmt {q.get('fmt')!r} is not supported (only e4m3, DeepSeek's float8_e4m3fn)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        bad(f"activation_scheme {q.get('activation_scheme')!r} is not supported (only dynamic: no activation scales)")
    if q.get("scale_fmt") not in (None, "ue8m0"):
        bad(f"scale_fmt {q.get('scale_fmt')!r} is not supported (float32 scales, or ue8m0 ones stored as float32)")
    b = q.get("weight_block_size")
    if not (isinstance(b, list) and len(b) == 2 and all(type(x) is int and 0 < x <= MAX_BLOCK for x in b)):
        bad(f"weight_block_size must be two positive integers (e.g. [128, 128]), got {b!r}")
    return tuple(b)


def _dtype(config: dict) -> torch.dtype:
    """The dtype a dequantized weight takes: the checkpoint's own (config dtype / torch_dtype), else bfloat16."""
    d = config.get("dtype") or config.get("torch_dtype")
    return DTYPES.get(d if isinstance(d, str) else "", torch.bfloat16)


def _reader(name: str, block, dtype, where):
    def read(q, s):
        if not bool(torch.isfinite(s).all()):
            raise RemodelError(f"{where}: tensor {scale_name(name)!r} holds non-finite block scales (NaN or inf)")
        w = dequantize(q, s, block, dtype)
        if not bool(torch.isfinite(w).all()):
            raise RemodelError(f"{where}: tensor {name!r} holds non-finite float8 values (NaN)")
        return w
    return read


def fp8_views(config: dict, stored: dict, where) -> dict:
    """{weight name: Dequantized} of an FP8 block-quantized checkpoint whose tensors are `stored` ({name: (dtype,
    shape)}); {} for one without. Refused in one line: float8 tensors or block scales without an fp8
    quantization_config, a float8 weight without its float32 scales of the block grid's shape, a scale without its
    float8 weight."""
    q = config.get("quantization_config")
    fp8 = sorted(k for k, (dt, _) in stored.items() if dt in FLOAT8)
    scales = sorted(k for k in stored if k.endswith(SCALE))
    if not (isinstance(q, dict) and q.get("quant_method") == "fp8"):
        if fp8 or scales:
            raise RemodelError(f"{where}: tensor {(fp8 or scales)[0]!r} is FP8-quantized but config.json has no "
                               "quantization_config with quant_method 'fp8' (a scale per weight block is needed)")
        return {}
    block, dtype, views = block_size(q, where), _dtype(config), {}
    for name in fp8:
        dt, shape = stored[name]
        s = stored.get(scale_name(name))
        if dt != torch.float8_e4m3fn or len(shape) < 2:
            raise RemodelError(f"{where}: tensor {name!r} is {dt} {list(shape)}; FP8 weights must be float8_e4m3fn "
                               "matrices (or stacks of them)")
        if s is None or s[0] != torch.float32 or tuple(s[1]) != grid(shape, block):
            got = "missing" if s is None else f"{s[0]} {list(s[1])}"
            raise RemodelError(f"{where}: tensor {scale_name(name)!r} is {got}; weight {name!r} {list(shape)} needs "
                               f"float32 scales {list(grid(shape, block))} (blocks {list(block)}, weight_block_size)")
        views[name] = Dequantized((name, scale_name(name)), tuple(shape), dtype, _reader(name, block, dtype, where))
    orphans = [k for k in scales if k[:-len(SCALE)] not in views]
    if orphans:
        raise RemodelError(f"{where}: tensor {orphans[0]!r} scales no float8_e4m3fn weight "
                           f"{orphans[0][:-len(SCALE)]!r}")
    return views


FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize(w: torch.Tensor, block, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv) of w [..., rows, cols], one scale per block: transformers'
    Fp8Quantize (scale = 448 / amax, x * scale clamped, scale_inv = 1 / scale; an all-zero block scale 1; ue8m0:
    scale_inv rounded up to a power of two), ragged edge blocks zero-padded (their amax over the real values)."""
    if not bool(torch.isfinite(w).all()):
        raise RemodelError(f"cannot quantize a weight [{', '.join(map(str, w.shape))}] holding NaN / inf to FP8")
    *lead, rows, cols = w.shape
    gr, gc = grid(w.shape, block)[-2:]
    pad = w.new_zeros(*lead, gr * block[0], gc * block[1], dtype=torch.float32)
    pad[..., :rows, :cols] = w
    blocks = pad.view(*lead, gr, block[0], gc, block[1])
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, FP8_MAX / amax.clamp_min(torch.finfo(torch.float32).tiny), 1.0)
    inv = (1.0 / scale).to(torch.float32)
    if ue8m0:
        inv = torch.pow(2.0, torch.ceil(torch.log2(inv.clamp(min=torch.finfo(torch.float32).tiny))))
        scale = 1.0 / inv
    q = (blocks * scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(pad.shape)[..., :rows, :cols].contiguous(), inv.contiguous()


def fingerprint(t: torch.Tensor) -> tuple:
    """A tensor's identity by value: dtype, shape and a 128-bit hash of its bytes."""
    t = t.detach().contiguous()
    return str(t.dtype), tuple(t.shape), hashlib.blake2b(t.reshape(-1).view(torch.uint8).numpy().data,
                                                         digest_size=16).digest()


def pattern(name: str) -> str:
    """A tensor name with its indices (layer, expert) as '#': which weights a format quantizes, whatever a
    command renumbered."""
    return re.sub(r"(?<=\.)\d+(?=\.)", "#", name)


class Fp8Output:
    """Writes a command's output in its FP8 source's format. The reader logs the value of each weight it
    dequantizes (reader.read_log: fingerprint -> name); an output weight of a pattern the source quantizes whose
    value is one logged is that weight unchanged (renamed, maybe: a renumbered layer or expert), written as its
    stored float8 bytes and scales; any other is re-quantized in the source's blocks. Everything else is plain."""

    def __init__(self, reader, qconfig: dict):
        self.reader, self.qconfig = reader, qconfig
        self.block = block_size(qconfig, reader.path)
        self.ue8m0 = qconfig.get("scale_fmt") == "ue8m0"
        self.patterns = {pattern(k) for k, v in reader.views().items() if scale_name(k) in v.parts}
        self.copied, self.quantized = 0, 0
        reader.read_log = {}

    def tensors(self, name: str, t: torch.Tensor) -> list:
        """[(name, tensor)] to store for output weight `name` of value `t`."""
        if pattern(name) not in self.patterns or t.dim() < 2 or not t.is_floating_point():
            return [(name, t)]
        src = self.reader.read_log.get(fingerprint(t))
        if src is not None:
            self.copied += 1
            return [(name + part[len(src):], raw) for part, raw in self.reader.parts(src)]
        self.quantized += 1
        q, s = quantize(t, self.block, self.ue8m0)
        return [(name, q), (scale_name(name), s)]

    def config(self, hf: dict) -> dict:
        """The output's config.json: the source's quantization_config kept when a weight is stored quantized."""
        hf = {k: v for k, v in hf.items() if k != "quantization_config"}
        return {**hf, "quantization_config": self.qconfig} if self.copied + self.quantized else hf


def fp8_output(reader):
    """The Fp8Output of an FP8 block-quantized source (`reader`), None for any other."""
    q = reader.source_config.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "fp8" and reader.views():
        return Fp8Output(reader, q)
    return None
