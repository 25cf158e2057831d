"""Named axes: for every parameter, which axis each of its dimensions runs over.

One table (`tensor_axes`) says e.g. that `layers.3.mixer.in_proj.weight` is ('mamba_in_proj', 'hidden').
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
  layers                      [L']          kept layers (depth pruning)
  mtp.layers.{j}.<axis>                     the MTP blocks' own units, keyed like the trunk's (never dropped)

Composite axes are derived from those: 'attn_q' rows (heads x head_dim), 'mamba_inner' (heads x
head_dim channels), 'mamba_conv' (x by inner, B|C whole), 'mamba_in_proj' (z, x by inner, B|C whole,
dt by heads). `dim_indices` turns a keep dict into one index per tensor dimension: None (keep all),
a 1-D index (index_select), or a 2-D [rows, k] index that selects per row of dimension 0 (gather).
Fixed axes ('vocab', 'attn_kv', 'head_dim', 'conv_kernel', 'one') are never pruned.
"""
from __future__ import annotations

import torch

from models.config import ModelConfig
from models.hf import our_shapes

PRIMARY = ("ffn", "attn_heads", "mamba_heads", "mamba_head_dim", "experts", "expert_ffn", "shared_ffn", "latent")
FIXED = ("vocab", "attn_kv", "head_dim", "conv_kernel", "one")


def layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("layers.") else None


def block_of(name: str) -> str | None:
    """The block a parameter belongs to, as keep keys name it: 'layers.3' (trunk), 'mtp.layers.1' (MTP)."""
    if name.startswith("layers."):
        return name.split(".", 2)[0] + "." + name.split(".")[1]
    if name.startswith("mtp.layers."):
        return ".".join(name.split(".")[:3])
    return None


def _mlp(m: str, ax: str, gated: bool, bias: bool) -> dict:
    t = {m + "up_proj.weight": (ax, "hidden"), m + "down_proj.weight": ("hidden", ax)}
    if gated:
        t[m + "gate_proj.weight"] = (ax, "hidden")
    if bias:
        t[m + "up_proj.bias"] = (ax,)
        t[m + "down_proj.bias"] = ("hidden",)
        if gated:
            t[m + "gate_proj.bias"] = (ax,)
    return t


def tensor_axes(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """{our parameter name: axis name per dimension}, covering exactly `our_shapes(cfg)`."""
    t = {"embeddings.weight": ("vocab", "hidden"), "norm_f.weight": ("hidden",), "lm_head.weight": ("vocab", "hidden")}
    lt = "latent" if cfg.moe_latent_size else "hidden"  # what the experts read and write
    blocks = [(f"layers.{i}.", c) for i, c in enumerate(cfg.pattern)]
    blocks += [(f"mtp.layers.{j}.", c) for j, c in enumerate(cfg.mtp_full_pattern)]  # MTP: the trunk's axes
    for p, c in blocks:
        m = p + "mixer."
        t[p + "norm.weight"] = ("hidden",)
        if p.startswith("mtp."):  # a step's fusion [embedding | hidden] -> hidden, and its norms
            t.update({p + "enorm.weight": ("hidden",), p + "hnorm.weight": ("hidden",),
                      p + "eh_proj.weight": ("hidden", "mtp_eh_in"), p + "final_layernorm.weight": ("hidden",)})
        if c == "M":
            t.update({m + "in_proj.weight": ("mamba_in_proj", "hidden"), m + "in_proj.bias": ("mamba_in_proj",),
                      m + "conv1d.weight": ("mamba_conv", "one", "conv_kernel"), m + "conv1d.bias": ("mamba_conv",),
                      m + "dt_bias": ("mamba_heads",), m + "A_log": ("mamba_heads",), m + "D": ("mamba_heads",),
                      m + "norm.weight": ("mamba_inner",), m + "out_proj.weight": ("hidden", "mamba_inner"),
                      m + "out_proj.bias": ("hidden",)})
        elif c == "*":
            for n, ax in (("q_proj", "attn_q"), ("k_proj", "attn_kv"), ("v_proj", "attn_kv")):
                t[m + n + ".weight"], t[m + n + ".bias"] = (ax, "hidden"), (ax,)
            t.update({m + "o_proj.weight": ("hidden", "attn_q"), m + "o_proj.bias": ("hidden",),
                      m + "q_norm.weight": ("head_dim",), m + "k_norm.weight": ("head_dim",)})
        elif c == "-":
            t.update(_mlp(m, "ffn", cfg.mlp_gated, cfg.mlp_bias))
        else:
            t.update({m + "gate.weight": ("experts", "hidden"), m + "gate.e_score_correction_bias": ("experts",),
                      m + "experts.up_proj": ("experts", "expert_ffn", lt),
                      m + "experts.gate_proj": ("experts", "expert_ffn", lt),
                      m + "experts.down_proj": ("experts", lt, "expert_ffn"),
                      m + "shared_expert_gate.weight": ("one", "hidden"),
                      m + "fc1_latent_proj.weight": ("latent", "hidden"), m + "fc2_latent_proj.weight": ("hidden", "latent")})
            t.update(_mlp(m + "shared_experts.", "shared_ffn", cfg.mlp_gated, False))
    shapes = our_shapes(cfg)
    out = {n: t[n] for n in shapes}  # KeyError here = a parameter this table forgot
    for n, s in shapes.items():
        assert len(out[n]) == len(s), f"axes of {n}: {out[n]} vs shape {s}"
    return out


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
    if axis == "attn_q":
        heads, d = k("attn_heads"), cfg.head_dim
        return None if heads is None else (heads[:, None] * d + torch.arange(d)).reshape(-1)
    Im, GN, nh, hd = cfg.mamba_inner, cfg.n_groups * cfg.ssm_state_size, cfg.mamba_num_heads, cfg.mamba_head_dim
    heads, chans = k("mamba_heads"), k("mamba_head_dim")
    if heads is None and chans is None:
        return None
    heads = torch.arange(nh) if heads is None else heads
    inner = (heads[:, None] * hd + (torch.arange(hd) if chans is None else chans)).reshape(-1)
    if axis == "mamba_heads":
        return heads
    if axis == "mamba_inner":
        return inner
    bc = torch.arange(2 * GN)
    if axis == "mamba_conv":  # x | B | C
        return torch.cat([inner, Im + bc])
    if axis == "mamba_in_proj":  # z | x | B | C | dt
        return torch.cat([inner, Im + inner, 2 * Im + bc, 2 * Im + 2 * GN + heads])
    raise KeyError(f"unknown axis {axis!r}")


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
