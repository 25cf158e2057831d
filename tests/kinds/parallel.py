"""A parallel mixer (Falcon-H1): its attention and its Mamba-2 side by side, each masked as its own kind."""
from tests.kinds import attention, mamba

AXES = attention.AXES | mamba.AXES


def outputs(m):
    return attention.outputs(m.attn) + mamba.outputs(m.mamba)


def mask(cfg, m, keep, p):
    attention.mask(cfg, m.attn, keep, p)
    mamba.mask(cfg, m.mamba, keep, p)
