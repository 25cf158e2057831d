"""Data-free baseline SCORES (same names, shapes and files as compress/importance.py) for comparing
activation importance against: weight magnitude and seeded random.

Magnitude: every unit scores the L2 norm of the linear weights (and biases) that belong to it, fp32:

  hidden           sqrt(sum over every tensor touching residual channel c of its squared entries on c):
                   embedding column, output rows of every writer (out_proj, o_proj, down_proj, experts'
                   down, fc2_latent_proj and their biases), input columns of every reader (in_proj, q/k/v,
                   up/gate, router, shared expert, fc1_latent_proj, lm_head) each multiplied by the gain
                   of the RMSNorm in front of it (layers.i.norm / norm_f), since gamma * W is the weight
                   the channel actually meets. Tied embeddings count as writer and (through norm_f) reader.
  layers.i.ffn     up (and gate) row + down column (+ up/gate bias)                       [F]
  layers.i.attn    q_proj row + o_proj column per (head, channel) (+ q bias)              [nq, head_dim]
  layers.i.mamba_x in_proj z row + x row + out_proj column per inner channel, plus the head's dt row
                   spread evenly over its hd channels (the L2 over a head is then the norm of all of
                   that head's in_proj rows and out_proj columns); conv, gated norm, A/D/dt_bias are
                   not weights of a projection and are left out                            [nh, hd]
  layers.i.experts the norm of the expert's up/gate/down weights                          [E]
  layers.i.expert_ffn / shared_ffn  like ffn, per expert / for the shared expert
  layers.i.latent  LatentMoE: fc1_latent_proj row + fc2_latent_proj column + every expert's up/gate
                   column and down row on that latent channel                             [Lt]
  block_importance Frobenius norm of the block's output projection(s) (out_proj, o_proj, down_proj,
                   experts' and shared expert's down, fc2_latent_proj): how much the block can write
                   into the residual stream per unit of its (normalised) input. No loss_increase is
                   written, so depth pruning ranks by this.

Random: uniform [0, 1) from torch.Generator(seed), one tensor per name of the activation contract
(block_importance and loss_increase included). Both need no data and no forward pass; magnitude reads
each tensor once (streams from a checkpoint with iter_our_tensors).
"""
from __future__ import annotations

from typing import Iterable

import torch

from remodel.models.config import ModelConfig
from remodel.models.kinds import KINDS, layer_kinds
from remodel.models.layout import axis_size
from remodel.models.norm import scale_of
from remodel.models.spec import sq

from .axes import layer_of, tensor_axes

# activation_measured (the default): activation, each kind's measured_units ranked by their LOO cost over the loss
# batches (compress/head_loo.measured_scores); loo: compress/head_loo.py; activation_in: activation with each
# kind's in_sites() -- these need data, magnitude and random do not
METHODS = ("activation_measured", "activation", "magnitude", "random", "loo", "activation_in")
DATA_METHODS = ("activation_measured", "activation", "loo", "activation_in")
WRITERS = ("out_proj.weight", "o_proj.weight", "down_proj.weight", "experts.down_proj", "fc2_latent_proj.weight")


def score_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """{name: shape} of every tensor an activation scoring run writes for this config."""
    s = {"hidden": (cfg.hidden_size,), "block_importance": (cfg.num_layers,), "loss_increase": (cfg.num_layers,)}
    for i, k in enumerate(layer_kinds(cfg)):
        for name, axes in k.scored.items():  # per kind: the score tensors an activation run writes
            shape = tuple(axis_size(cfg, a) for a in axes)
            if all(shape):  # no shared expert / latent: not written
                s[f"layers.{i}.{name}"] = shape
    return s


def random_scores(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Uniform [0, 1) scores in the shapes an activation run writes, the per-expert contribution, frequency
    and reconstruction and the routed channel scores included (drawn last, in the order those keys came,
    so the other keys keep the draws they had before)."""
    g = torch.Generator().manual_seed(seed)
    out = {k: torch.rand(shape, generator=g) for k, shape in score_shapes(cfg).items()}
    E, F = cfg.moe.n_routed_experts, cfg.moe.moe_intermediate_size
    extra = (("expert_contribution", (E,)), ("expert_frequency", (E,)))
    for keys in (extra, (("expert_reconstruction", (E,)), ("expert_ffn_contribution", (E, F)))):
        for i, kind in enumerate(layer_kinds(cfg)):
            if kind.routed:
                for k, shape in keys:
                    out[f"layers.{i}.{k}"] = torch.rand(shape, generator=g)
    return out


def _hidden_terms(cfg, name, t, axes, i, acc) -> None:
    """What a tensor adds to the hidden channels' score: norm gains, squared input-column sums per
    reading site (layer index or 'f'), squared output rows written to the residual stream."""
    gamma, read = acc["gamma"], acc["read"]
    if name == "norm_f.weight" or name == f"layers.{i}.norm.weight":
        gamma["f" if i is None else i] = scale_of(t, cfg.norm_offset)  # the gain the channel meets
    elif name == "embeddings.weight":
        acc["write"] += sq(t, 1)
        if cfg.tie_word_embeddings:
            _add(read, "f", sq(t, 1))
    elif name == "lm_head.weight":
        _add(read, "f", sq(t, 1))
    elif "hidden" in axes:
        d = axes.index("hidden")
        if d == t.dim() - 1 and t.dim() >= 2:
            _add(read, i, sq(t, d))
        else:
            acc["write"] += sq(t, d)


def _unit_terms(cfg, local, t, i, units) -> None:
    """What a tensor of layer i adds to its units' squared norms (its kind's spec says which)."""
    for site, term in KINDS[cfg.pattern[i]].magnitude(cfg, local, t):
        _add(units, f"layers.{i}.{site}", term)


def _add(d, key, v):
    d[key] = d[key] + v if key in d else v.clone()


@torch.no_grad()
def magnitude_scores(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Weight-magnitude scores from (our_name, tensor) pairs (a state dict's items() or
    models.load.iter_our_tensors); see the module docstring for what each unit's norm covers."""
    table = tensor_axes(cfg)
    units: dict[str, torch.Tensor] = {}
    acc = {"gamma": {}, "read": {}, "write": torch.zeros(cfg.hidden_size)}
    block = torch.zeros(cfg.num_layers, dtype=torch.float64)
    for name, t in tensors:
        t, i = t.detach().float().cpu(), layer_of(name)
        _hidden_terms(cfg, name, t, table[name], i, acc)
        if i is not None:
            local = name.split(".", 3)[-1]  # e.g. 'in_proj.weight', 'experts.up_proj'
            if local.endswith(WRITERS):
                block[i] += t.double().square().sum()
            _unit_terms(cfg, local, t, i, units)
    H = acc["write"].clone()
    for site, r in acc["read"].items():
        g = acc["gamma"].get(site)
        H += r if g is None else r * g.square()
    out = {"hidden": H.sqrt(), "block_importance": block.sqrt().float()}
    want = score_shapes(cfg)
    for k, v in units.items():
        out[k] = v.sqrt().view(want[k])
    want.pop("loss_increase")
    missing = sorted(set(want) - set(out))
    assert not missing, f"magnitude scores missing {missing}: not every tensor was given"
    return {k: out[k].float().contiguous() for k in want}


def weight_scores(cfg: ModelConfig, method: str, tensors=None, seed: int = 0) -> dict[str, torch.Tensor]:
    """'magnitude' (needs `tensors`, (our_name, tensor) pairs) or 'random' scores."""
    if method == "random":
        return random_scores(cfg, seed)
    if method == "magnitude":
        return magnitude_scores(cfg, tensors)
    raise ValueError(f"unknown data-free scoring method {method!r}")
