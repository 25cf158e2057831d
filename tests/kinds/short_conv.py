"""Gated short convolution (LFM2): a dropped channel of y = C * conv(B * x) writes nothing through out_proj."""
from tests.kinds import dropped

AXES = {"sc_inner"}


def outputs(m):
    return [m.out_proj]


def mask(cfg, m, keep, p):
    if p + "sc_inner" in keep:
        m.out_proj.weight[:, dropped(keep[p + "sc_inner"], m.out_proj.weight.shape[1])] = 0
