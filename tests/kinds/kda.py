"""KDA: a dropped head writes nothing through o_proj (its o_proj columns zero). Every other part of a head is its
own (its q, k, v rows and convs, its decay and beta, its gated norm over its own channels; the low-rank
f_a / g_a projections are shared and stay), so the kept heads compute what the sliced model computes."""
import torch

AXES = {"kda_heads"}
FP64 = True  # the per-head gated norm rescales the rule's small outputs: compared in float64


def outputs(m):
    return [m.o_proj]


def mask(cfg, m, keep, p):
    if p + "kda_heads" not in keep:
        return
    h, d = cfg.kda.kda_num_heads, cfg.kda.kda_head_dim
    kept = torch.zeros(h, d)
    kept[keep[p + "kda_heads"]] = 1
    m.o_proj.weight[:, kept.reshape(-1) == 0] = 0
