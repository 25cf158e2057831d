"""Multi-head latent attention: a dropped head's values write nothing through o_proj."""
from tests.kinds import dropped

AXES = {"mla_heads"}


def outputs(m):
    return [m.o_proj]


def mask(cfg, m, keep, p):
    if p + "mla_heads" in keep:
        vd = cfg.mla.v_head_dim
        for h in dropped(keep[p + "mla_heads"], cfg.mla.mla_num_heads):
            m.o_proj.weight[:, h * vd:(h + 1) * vd] = 0
