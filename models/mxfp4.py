"""MXFP4 tensors of a checkpoint (gpt-oss's released experts), read dequantized.

A quantized tensor `X` is stored as `X_blocks` (uint8 [..., rows, G, 16]: two FP4 e2m1 values a byte, the low
nibble first) and `X_scales` (uint8 [..., rows, G]: one e8m0 exponent, biased by 127, per 32 values). Its value is
FP4 * 2**(scale - 127), laid out [..., rows, G * 32] and then, as transformers' convert_moe_packed_tensors
returns it, with its last two dimensions swapped: the tensor `X` a plain checkpoint stores. Every such value is
exact in bfloat16 (3 significant bits, fp32's exponent range), so it is read in bfloat16 and the loader casts it.
Outputs keep the format (`mxfp4_output`, one of models.checkpoint.QUANTIZERS): an expert a command did not change
is its stored blocks and scales copied, a tensor with any changed expert is re-quantized by `quantize`.
"""
from __future__ import annotations

import torch

from .errors import RemodelError
from .fp8 import fingerprint, pattern

FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
READ_DTYPE = torch.bfloat16
MAX_SCALE = 127 + 125  # 6 * 2**(s - 127) stays finite in bf16 / fp32 (max ~2**128)


def packed_shape(reader, name: str) -> tuple | None:
    """The dequantized shape of `name` when the checkpoint stores it as MXFP4 blocks and scales, checked
    (dtypes, shapes) from the header alone; None when it has no such pair."""
    b, s = name + "_blocks", name + "_scales"
    if b not in reader or s not in reader:
        return None
    bs, ss = tuple(reader.shape(b)), tuple(reader.shape(s))
    if reader.dtype(b) != torch.uint8 or reader.dtype(s) != torch.uint8:
        raise RemodelError(f"{reader.path}: MXFP4 {b} / {s} must be uint8, got {reader.dtype(b)} / {reader.dtype(s)}")
    if len(bs) < 3 or bs[-1] != BLOCK // 2 or bs[:-1] != ss:
        raise RemodelError(f"{reader.path}: MXFP4 {b} {list(bs)} and {s} {list(ss)} do not match "
                           f"([..., rows, G, {BLOCK // 2}] blocks, [..., rows, G] scales)")
    return (*bs[:-3], bs[-2] * BLOCK, bs[-3])


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype=READ_DTYPE, where: str = "") -> torch.Tensor:
    """FP4 blocks times their e8m0 scales -> [..., G * 32, rows] in `dtype` (transformers' layout: the rows
    dimension last). A scale that would overflow (or e8m0's NaN, 255) is refused in one line."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise RemodelError(f"{where}MXFP4 blocks {list(blocks.shape)} / scales {list(scales.shape)} are not uint8 "
                           "pairs of one shape")
    top = int(scales.max()) if scales.numel() else 0
    if top > MAX_SCALE:
        raise RemodelError(f"{where}MXFP4 scale exponent {top} is out of range (at most {MAX_SCALE}: "
                           f"values up to 6 * 2**{MAX_SCALE - 127})")
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    out = torch.empty(*blocks.shape[:-1], blocks.shape[-1] * 2, dtype=dtype)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    out = torch.ldexp(out, scales.to(torch.int32)[..., None] - 127).to(dtype)
    return out.flatten(-2).transpose(-2, -1).contiguous()


def shape_and_get(reader, name: str):
    """(shape, read()) of tensor `name` stored as MXFP4, read dequantized in READ_DTYPE; None: not stored so."""
    shape = packed_shape(reader, name)
    if shape is None:
        return None
    def read():
        w = dequantize(reader.get(name + "_blocks"), reader.get(name + "_scales"), where=f"{reader.path}: {name}: ")
        if getattr(reader, "read_log", None) is not None:  # an output in this format asked: log each expert
            reader.read_log.update((fingerprint(w[e]), (name, e)) for e in range(w.shape[0]) if w.dim() == 3)
        return w
    return shape, read


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of w [..., cols, rows] (the dequantized layout) rounded to MXFP4: per 32 values the
    exponent that fits their largest magnitude under 6, each value to its nearest FP4 (ties to the lower code).
    Re-quantizes an output's changed experts; builds tests' checkpoints in the released layout."""
    if w.shape[-2] % BLOCK:
        raise RemodelError(f"cannot write a weight {list(w.shape)} as MXFP4: its size {w.shape[-2]} along the "
                           f"quantized dimension is not a multiple of {BLOCK}; choose one, or pass --dtype bfloat16")
    x = w.transpose(-2, -1).float()  # [..., rows, cols]
    x = x.unflatten(-1, (x.shape[-1] // BLOCK, BLOCK))
    amax = x.abs().amax(-1).clamp_min(2.0 ** -126)
    scale = (torch.ceil(torch.log2(amax / 6.0)) + 127).clamp(0, MAX_SCALE).to(torch.uint8)
    y = x / torch.ldexp(torch.ones(scale.shape), scale.to(torch.int32) - 127)[..., None]
    lut = torch.tensor(FP4_VALUES)
    code = (y[..., None] - lut).abs().argmin(-1).to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4), scale


class Mxfp4Output:
    """Writes a command's output in its MXFP4 source's format: each stacked expert tensor whose every expert is
    one the reader dequantized (reader.read_log, by value) is those experts' stored blocks and scales stacked
    (kept experts: byte for byte); one with any changed expert is re-quantized whole; everything else plain."""

    def __init__(self, reader, qconfig: dict):
        self.reader, self.qconfig, self.written = reader, qconfig, 0
        self.patterns = {pattern(k[:-len("_blocks")]) for k in reader.keys() if k.endswith("_blocks")}
        reader.read_log = {}

    def _stored(self, t: torch.Tensor):
        """(blocks, scales) of t's experts as stored, or None when one is not a logged expert."""
        src = []
        for e in range(t.shape[0]):
            x = t[e].to(READ_DTYPE)
            hit = self.reader.read_log.get(fingerprint(x)) if torch.equal(x.to(t.dtype), t[e]) else None
            if not isinstance(hit, tuple):
                return None
            src.append(hit)
        raw = {n: (self.reader.get(n + "_blocks"), self.reader.get(n + "_scales")) for n in {n for n, _ in src}}
        return (torch.stack([raw[n][0][e] for n, e in src]), torch.stack([raw[n][1][e] for n, e in src]))

    def tensors(self, name: str, t: torch.Tensor) -> list:
        """[(name, tensor)] to store for output tensor `name` of value `t`."""
        if pattern(name) not in self.patterns or t.dim() != 3 or not t.is_floating_point():
            return [(name, t)]
        self.written += 1
        blocks, scales = self._stored(t) or quantize(t)
        return [(name + "_blocks", blocks), (name + "_scales", scales)]

    def config(self, hf: dict) -> dict:
        """config.json: the source's quantization_config kept when a tensor is stored as MXFP4."""
        hf = {k: v for k, v in hf.items() if k != "quantization_config"}
        return {**hf, "quantization_config": self.qconfig} if self.written else hf


def mxfp4_output(reader):
    """The Mxfp4Output of a source storing MXFP4 tensors (quant_method mxfp4), None for any other."""
    q = reader.source_config.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "mxfp4" and any(k.endswith("_blocks") for k in reader.keys()):
        return Mxfp4Output(reader, q)
    return None
