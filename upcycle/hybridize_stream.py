"""The hybrid written straight from the source checkpoint (issue 57), a layer at a time: each source layer's
tensors read through the checkpoint reader, converted by the same HybridLayers that hybridize_model uses
(so the tensors are those of the in-memory conversion), written by the streamed HF writer. Peak memory is
about one source layer and its hybrid, not the model.
"""
from __future__ import annotations

from pathlib import Path

import torch

from remodel.models.checkpoint import CheckpointReader
from remodel.models.hf import config_to_hf, our_shapes
from remodel.models.layout import layer_of
from remodel.models.load import iter_hf_tensors, iter_our_tensors, source_plan, write_hf

from .hybridize import HybridLayers


def _groups(cfg) -> dict:
    """{layer_of group: our tensor names of the source in it}."""
    out = {}
    for name in our_shapes(cfg):
        out.setdefault(layer_of(name), set()).add(name)
    return out


class _Layers:
    """get(our name of the hybrid) -> tensor, converting a source group when one of its tensors is first asked
    for and dropping each tensor once given (weight_table asks layer by layer; a layer asked again is rebuilt)."""

    def __init__(self, reader: CheckpointReader, conv: HybridLayers):
        self.reader, self.conv, self.names = reader, conv, _groups(conv.src_cfg)
        self.held = {}  # group -> {name: tensor} not yet given: the rest (None) and the current layer at most

    def _read(self, group) -> dict:
        """The source's tensors of `group`, float32 as load_model holds them."""
        it = iter_our_tensors(self.reader, self.conv.src_cfg, names=self.names.get(group, set()))
        return {k: v.float() if v.is_floating_point() else v for k, v in it}

    @torch.no_grad()
    def get(self, name: str) -> torch.Tensor:
        group = layer_of(name)
        if group not in self.held:
            self.held = {g: v for g, v in self.held.items() if g is None}  # the previous layer: done
            self.held[group] = self.conv.convert(group, self._read(group))
        t = self.held[group].pop(name, None)
        if t is None:
            raise self.conv.missing(name)
        return t


def write_hybrid(model_dir, out, conv: HybridLayers, family: str, dtype: torch.dtype | None = None,
                 overwrite: bool = False, max_shard_bytes: int = 2 * 1024**3) -> Path:
    """The hybrid of checkpoint `model_dir` as `conv` converts it, written to `out` in `family` (atomically, as
    save_model writes, in `dtype` where given), streamed: every source shape is checked before anything is read."""
    with CheckpointReader(model_dir) as reader:
        source_plan(reader, conv.src_cfg)  # checks every shape against the config, reads nothing
        layers = _Layers(reader, conv)
        tensors = iter_hf_tensors(layers.get, conv.new_cfg, family, dtype, source=model_dir)
        return write_hf(out, tensors, config_to_hf(conv.new_cfg, family), dtype, model_dir, overwrite, [model_dir],
                        max_shard_bytes)
