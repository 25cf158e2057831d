"""The parallel mixer layer kind ('P', Falcon-H1): attention and Mamba-2 on the same normalised input, their
outputs summed, mamba(x * ssm_in) * ssm_out + attention(x * attention_in) * attention_out (the cfg's
multipliers); its module and its spec (PARALLEL).

The spec is the attention and Mamba specs composed: their parameters, axes, sites and keep rules under the
submodule prefixes `attn.` and `mamba.`, so scoring, pruning (query heads, Mamba heads and head size) and the
layout read it as they read the two kinds.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from .attention import ATTENTION, Attention
from .mamba import MAMBA, Mamba2Mixer
from .section import Section, reals
from .spec import LayerKind, Param

_PARTS = (("attn.", ATTENTION), ("mamba.", MAMBA))  # submodule prefix, its kind


@dataclass(frozen=True)
class ParallelConfig(Section):
    """The parallel mixer's own fields (its attention and Mamba read theirs): the input and output
    multipliers of each branch (Falcon-H1; 1: off)."""
    attention_in_multiplier: float = reals(1.0, gt=0, variant="projections", raw=("attention_in_multiplier",))
    attention_out_multiplier: float = reals(1.0, gt=0, variant="projections", raw=("attention_out_multiplier",))
    ssm_in_multiplier: float = reals(1.0, gt=0, variant="projections", raw=("ssm_in_multiplier",))
    ssm_out_multiplier: float = reals(1.0, gt=0, variant="projections", raw=("ssm_out_multiplier",))


def _scaled(t, m: float):
    return t if m == 1 else t * m


class ParallelMixer(nn.Module):
    """u [b, l, hidden] -> mamba(u) + attention(u), each with its input and output multipliers."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.attn = Attention(cfg, cfg.attention.sliding_window)
        self.mamba = Mamba2Mixer(cfg)

    def forward(self, u, attention_mask=None, position_ids=None):
        cfg = self.cfg
        m = _scaled(self.mamba(_scaled(u, cfg.parallel.ssm_in_multiplier), attention_mask), cfg.parallel.ssm_out_multiplier)
        a = self.attn(_scaled(u, cfg.parallel.attention_in_multiplier), attention_mask, position_ids)
        return m + _scaled(a, cfg.parallel.attention_out_multiplier)


def _part(local: str):
    """(the kind owning a parameter named `local` under the mixer, its name under that kind's module)."""
    for prefix, k in _PARTS:
        if local.startswith(prefix):
            return k, local[len(prefix):]
    return None, local


class ParallelKind(LayerKind):
    def build(self, cfg):
        return ParallelMixer(cfg)

    def validate(self, cfg, need):
        for _, k in _PARTS:
            k.validate(cfg, need)

    def summary(self, cfg):
        return {**ATTENTION.summary(cfg), **MAMBA.summary(cfg)}

    def cache_bytes(self, cfg, w, batch, seq_len, kv_bytes=2, state_bytes=4, conv_bytes=2):
        return {n: v for _, k in _PARTS for n, v in k.cache_bytes(cfg, w, batch, seq_len, kv_bytes, state_bytes,
                                                                 conv_bytes).items()}

    def init_param(self, cfg, local, p, g, std):
        k, leaf = _part(local)
        return k is not None and k.init_param(cfg, leaf, p, g, std)

    def state_rows(self, cfg, w, batch, seq_len, bytes_=(2, 4, 2)):
        """Each part's state under its own row (attention's KV cache, Mamba's state)."""
        rows = {}
        for _, k in _PARTS:
            for row, b in k.state_rows(cfg, w, batch, seq_len, bytes_).items():
                rows[row] = rows.get(row, 0) + b
        return rows

    def buffer_elements(self, cfg, w):
        return sum(k.buffer_elements(cfg, w) for _, k in _PARTS)

    def mixing_flops(self, cfg, seq_len):
        return sum(k.mixing_flops(cfg, seq_len) for _, k in _PARTS)

    def sites(self, cfg):
        return _prefixed(cfg, "sites")

    def in_sites(self, cfg):
        return _prefixed(cfg, "in_sites")

    def keep(self, cfg, score, t, p):
        return {key: v for _, k in _PARTS for key, v in k.keep(cfg, score, t, p).items()}

    def magnitude(self, cfg, local, t):
        k, leaf = _part(local)
        return [] if k is None else k.magnitude(cfg, leaf, t)

    def check_tp(self, cfg, tp, need):
        for _, k in _PARTS:
            k.check_tp(cfg, tp, need)


def _merged(attr: str):
    """One spec field of the two kinds merged (dicts updated, tuples joined, module paths prefixed)."""
    vals = [(p, getattr(k, attr)) for p, k in _PARTS]
    if attr == "tp_plan":  # module paths prefixed ('' : the part's own module)
        return {(p + x).rstrip("."): w for p, d in vals for x, w in d.items()}
    if isinstance(vals[0][1], dict):
        return {key: v for _, d in vals for key, v in d.items()}
    return tuple(dict.fromkeys(x for _, xs in vals for x in xs))


PARALLEL = ParallelKind(
    "P", "parallel",
    tuple(Param(p + q.leaf, q.axes, q.when) for p, k in _PARTS for q in k.params),
    **{a: _merged(a) for a in ("units", "sizes", "segments", "products", "scored", "widths", "fixed", "tp_axes",
                               "inputs", "tp_plan")},
    color="tab:cyan", config=ParallelConfig, reads=tuple(k.section_name for _, k in _PARTS))


def _prefixed(cfg, which: str) -> tuple:
    """Every part's Sites (its `which` method), module and weight named from the parallel mixer."""
    return tuple(replace(s, module=p + s.module, norm_of=s.norm_of and p + s.norm_of)
                 for p, k in _PARTS for s in getattr(k, which)(cfg))
