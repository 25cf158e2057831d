"""Named axes: for every parameter, which axis each of its dimensions runs over.

The table (models.layout.param_axes) says e.g. that `layers.3.mixer.in_proj.weight` is ('mamba_in_proj', 'hidden').
A *keep* dict holds the units kept on the primary axes, as sorted LongTensors of original indices
(a missing key keeps everything):

  hidden                      [H']          one set for the whole residual stream
  layers.{i}.ffn              [F']          '-' layers
  layers.{i}.attn_heads       [nq']         '*' layers (query heads; K/V heads are never pruned)
  layers.{i}.mamba_heads      [nh']         'M' layers
  layers.{i}.mamba_head_dim   [hd']         'M' layers (channels within a head, shared by all heads)
  layers.{i}.experts          [E']          'E' layers
  layers.{i}.expert_ffn       [E' or E, Fm'] per kept expert (rows in kept-expert order) its own neurons
  layers.{i}.shared_ffn       [S']          'E' layers with a shared expert
  layers.{i}.latent           [Lt']         'E' layers of a LatentMoE (fc1/fc2_latent_proj and the experts)
  layers.{i}.sc_inner         [H']          'C' layers: the short conv's channels, as many as `hidden` keeps
                                            (a kind's hidden_units: its keep picks them by its own score)
  layers                      [L']          kept layers (depth pruning)
  mtp.layers.{j}.<axis>                     the MTP blocks' own units, keyed like the trunk's (never dropped)

Composite axes are derived from those as the kinds' specs say: products such as 'attn_q' rows (heads x
head_dim) and 'mamba_inner' (heads x head_dim channels), and concatenated axes (segments), each segment
by its own axis. `dim_indices` turns a keep dict into one index per tensor dimension: None (keep all),
a 1-D index (index_select), or a 2-D [rows, k] index that selects per row of dimension 0 (gather).
Fixed axes (models.layout.FIXED_AXES) are never pruned.
"""
from __future__ import annotations

import torch

from remodel.models.config import ModelConfig
from remodel.models.layout import FIXED_AXES, axis_size, layer_of, param_axes, product, segments
from remodel.models.kinds import UNITS

PRIMARY, FIXED = UNITS, FIXED_AXES  # models.layout: the keep-dict units, the axes never pruned


def block_of(name: str) -> str | None:
    """The block a parameter belongs to, as keep keys name it: 'layers.3' (trunk), 'mtp.layers.1' (MTP)."""
    if name.startswith("layers."):
        return name.split(".", 2)[0] + "." + name.split(".")[1]
    if name.startswith("mtp.layers."):
        return ".".join(name.split(".")[:3])
    return None


def tensor_axes(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """{our parameter name: axis name per dimension} (models.layout.param_axes)."""
    return param_axes(cfg)


def axis_index(cfg: ModelConfig, keep: dict, axis: str, layer: int | str | None) -> torch.Tensor | None:
    """Index (original positions, in order) of the kept units of `axis` in `layer` (a trunk index or a
    block name such as 'mtp.layers.1'); None = all."""
    if axis in FIXED:
        return None
    if axis == "hidden":
        return keep.get("hidden")
    if axis == "mtp_eh_in":  # eh_proj reads [embedding | hidden]: the hidden channels kept in both halves
        h = keep.get("hidden")
        return None if h is None else torch.cat([h, cfg.hidden_size + h])
    block = layer if isinstance(layer, str) else f"layers.{layer}"
    k = lambda a: keep.get(f"{block}.{a}")  # noqa: E731
    if axis in PRIMARY:
        return k(axis)
    parts = segments(axis)
    if parts:  # concatenated axes: each segment's kept units, at its offset
        idx = [axis_index(cfg, keep, sub, layer) for _, sub in parts]
        if all(p is None for p in idx):
            return None
        sizes = [axis_size(cfg, sub) for _, sub in parts]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        return torch.cat([o + (torch.arange(n) if p is None else p) for p, n, o in zip(idx, sizes, offsets)])
    if product(axis) is None:
        raise KeyError(f"unknown axis {axis!r}")
    outer, inner = product(axis)  # e.g. heads x channels: every kept channel of every kept head
    o = k(outer)  # the inner axis a unit, or concatenated segments ('mla_kv_head': k no-RoPE | v) each its own
    i = k(inner) if inner in PRIMARY else axis_index(cfg, keep, inner, layer) if segments(inner) else None
    if o is None and i is None:
        return None
    n = axis_size(cfg, inner)
    o = torch.arange(axis_size(cfg, outer)) if o is None else o
    return (o[:, None] * n + (torch.arange(n) if i is None else i)).reshape(-1)


def dim_indices(cfg: ModelConfig, keep: dict, name: str, table: dict | None = None) -> list:
    """One index (or None) per dimension of our parameter `name`."""
    axes = (table or tensor_axes(cfg))[name]
    return [axis_index(cfg, keep, a, block_of(name)) for a in axes]


def select(t: torch.Tensor, idxs: list) -> torch.Tensor:
    """Apply `dim_indices`: 1-D -> index_select; 2-D [rows, k] -> per-row gather (rows = dim 0)."""
    for d, idx in enumerate(idxs):
        if idx is None:
            continue
        idx = idx.to(t.device)
        if idx.dim() == 1:
            t = t.index_select(d, idx)
        else:
            assert d > 0 and idx.shape[0] == t.shape[0], (d, tuple(idx.shape), tuple(t.shape))
            view = [idx.shape[0]] + [1] * (t.dim() - 1)
            view[d] = idx.shape[1]
            shape = list(t.shape)
            shape[d] = idx.shape[1]
            t = t.gather(d, idx.view(view).expand(shape))
    return t
