"""MLP (and its post-norm variant): a dropped FFN neuron writes nothing through down_proj."""
from tests.kinds import dropped

AXES = {"ffn"}


def outputs(m):
    return [m.down_proj]


def mask(cfg, m, keep, p):
    if p + "ffn" in keep:
        m.down_proj.weight[:, dropped(keep[p + "ffn"], cfg.mlp.intermediate_size)] = 0
