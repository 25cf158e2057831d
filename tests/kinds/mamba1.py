"""Mamba-1: a dropped inner channel adds nothing to dt / B / C (x_proj's column) and writes nothing
through out_proj."""
from tests.kinds import dropped

AXES = {"m1_inner"}


def outputs(m):
    return [m.out_proj]


def mask(cfg, m, keep, p):
    if p + "m1_inner" in keep:
        gone = dropped(keep[p + "m1_inner"], m.out_proj.weight.shape[1])
        m.x_proj.weight[:, gone], m.out_proj.weight[:, gone] = 0, 0
