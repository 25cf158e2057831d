"""The gated short convolution layer kind ('C'): LFM2's `Lfm2ShortConv`; its config section, module and spec
(SHORT_CONV).

in_proj (hidden -> 3 x inner, segments B | C | x in that order) -> y = C * causal_depthwise_conv(B * x) (kernel
short_conv_kernel, no activation) -> out_proj (inner -> hidden). Padded positions' inputs are zeroed (transformers'
apply_mask_to_padding_states). Every channel is its own: channel c of y reads channel c of B, C and x only, so the
inner channels prune (and split over tensor-parallel ranks) one by one. In LFM2's format the inner count equals
hidden_size: hidden pruning keeps as many inner channels, chosen by this kind's own score (out_proj's input;
LayerKind.hidden_units). Pure PyTorch on every device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .section import Section, ints, plain
from .spec import LayerKind, Param, Site, sq, top


@dataclass(frozen=True)
class ShortConvConfig(Section):
    """The short convolution's fields: its kernel (LFM2's conv_L_cache) and whether in_proj, the conv and
    out_proj have biases (LFM2's conv_bias)."""
    short_conv_kernel: int = ints(3, 1, 1024, raw={"conv_L_cache": 1})
    short_conv_bias: bool = plain(False, "biases of in_proj, the conv and out_proj")


def causal_depthwise_conv(x, weight, bias):
    """x [b, l, c] -> [b, l, c]: channel c convolved with weight[c, 0, :] over the current and earlier steps."""
    k = weight.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (k - 1, 0)), weight, bias, groups=weight.shape[0])
    return y.transpose(1, 2)


class ShortConv(nn.Module):
    """u [b, l, hidden] -> [b, l, hidden]; attention_mask [b, l] (0: padding) zeroes padded inputs. The channel
    count comes from the weights (a tensor-parallel rank holds a slice of every segment)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        H, n, bias = cfg.hidden_size, SHORT_CONV.axis_size(cfg, "sc_inner"), cfg.short_conv.short_conv_bias
        self.in_proj = nn.Linear(H, 3 * n, bias=bias)
        self.conv = nn.Conv1d(n, n, cfg.short_conv.short_conv_kernel, groups=n, bias=bias)
        self.out_proj = nn.Linear(n, H, bias=bias)

    def forward(self, u, attention_mask=None):
        if attention_mask is not None:
            u = u * attention_mask[:, :, None].to(u.dtype)
        b, c, x = self.in_proj(u).chunk(3, dim=-1)
        y = c * causal_depthwise_conv(b * x, self.conv.weight, self.conv.bias)
        return self.out_proj(y)


class ShortConvKind(LayerKind):
    def build(self, cfg):
        return ShortConv(cfg)

    def init_param(self, cfg, local, p, g, std):
        """As transformers' generic _init_weights (LFM2 has no own): the conv is an nn.Conv1d, drawn normal(std)."""
        if local == "conv.weight":
            p.normal_(0.0, std, generator=g)
            return True
        return False

    def summary(self, cfg):
        return {"short_conv_kernel": cfg.short_conv.short_conv_kernel, "short_conv_bias": cfg.short_conv.short_conv_bias}

    state_row = "conv state"

    def cache_bytes(self, cfg, w, batch, seq_len, kv_bytes=2, state_bytes=4, conv_bytes=2):
        """The conv state: the last short_conv_kernel columns of B * x per inner channel (transformers keeps
        conv_L_cache of them)."""
        return {"short_conv_state": batch * self.axis_size(cfg, "sc_inner", w) * cfg.short_conv.short_conv_kernel
                * conv_bytes}

    def mixing_flops(self, cfg, seq_len):
        """Per token: the depthwise conv (a multiply-add per kernel tap and channel) and the two gates."""
        n = self.axis_size(cfg, "sc_inner")
        return 2 * n * cfg.short_conv.short_conv_kernel + 2 * n

    def sites(self, cfg):
        return (Site("sc_inner", "out_proj", "input", None, "out_proj.weight"),)

    def keep(self, cfg, score, t, p):
        """Hidden pruning keeps as many inner channels (LFM2's inner count is hidden_size), by out_proj's input."""
        if "hidden_size" not in t:
            return {}
        n = self.axis_size(cfg, "sc_inner")
        return {p + "sc_inner": top(score(p + "sc_inner", (n,), "--hidden-size"), t["hidden_size"])}

    def magnitude(self, cfg, local, t):
        """in_proj rows (each segment's channel c adds to channel c), the conv's channels, out_proj columns."""
        if local in ("in_proj.weight", "in_proj.bias"):
            return [("sc_inner", sum(sq(t, 0).chunk(3)))]
        if local in ("conv.weight", "conv.bias"):
            return [("sc_inner", sq(t, 0))]
        if local == "out_proj.weight":
            return [("sc_inner", sq(t, 1))]
        return []

    def check_tp(self, cfg, tp, need):
        n = self.axis_size(cfg, "sc_inner")
        need(n % tp == 0, f"tensor parallelism: the short conv's {n} channels are not divisible by tp={tp}")


SHORT_CONV = ShortConvKind(
    "C", "short_conv",
    (Param("in_proj.weight", ("sc_in_proj", "hidden")), Param("in_proj.bias", ("sc_in_proj",), ("short_conv_bias",)),
     Param("conv.weight", ("sc_inner", "one", "sc_kernel")), Param("conv.bias", ("sc_inner",), ("short_conv_bias",)),
     Param("out_proj.weight", ("hidden", "sc_inner")), Param("out_proj.bias", ("hidden",), ("short_conv_bias",))),
    sizes={"sc_inner": lambda cfg, w: w["hidden_size"], "sc_kernel": lambda cfg, w: cfg.short_conv.short_conv_kernel},
    segments={"sc_in_proj": (("B", "sc_inner"), ("C", "sc_inner"), ("x", "sc_inner"))},
    scored={"sc_inner": ("sc_inner",)},
    hidden_units=("sc_inner",),
    fixed=("sc_kernel",),
    tp_axes=("sc_in_proj", "sc_inner"), inputs=("attention_mask",), color="tab:olive",
    tp_plan={"in_proj": "shard_entry", "conv": "shard", "out_proj": "rowwise"},
    config=ShortConvConfig)
