"""The kept attention layers of a hybrid (upcycle.hybridize) in a target family whose attention differs from the
source's (issue 57): Qwen3.5 / Qwen3-Next attention has a sigmoid output gate and per-head q/k RMS norms, and every
RMSNorm there is zero-centred. The family's own check decides: the fewest of those changes that it holds are made.

- zero-centred norms: every RMSNorm weight w becomes w - 1 (scale 1 + (w - 1)): exact.
- output gate: each head's gate rows are zero, so sigmoid(0) = 1/2, and o_proj is doubled: exact.
- an o_proj bias where the family ties it to the q/k/v biases (qwen2's): zero, exact.
- q/k norm on a source without one: RMSNorm over a head is not an identity (it removes each token's query and key
  length). Its weight is set to the head's expected RMS, estimated from the weights alone: with the layer's input
  RMS-normed (unit mean square, times the input norm's scale s), E q_j^2 ~ sum_i W_ji^2 s_i^2, averaged over the
  rows. Scores then match the source's on average; the per-token deviation remains (tests/test_hybridize_gdn.py
  measures it) for stage one (attention transfer) to fit.
"""
from __future__ import annotations

from itertools import combinations

import torch

from remodel.models.families import FAMILIES
from remodel.models.norm import RMSNorm, scale_of

CHANGES = ({"norm_offset": 1.0}, {"attention.attn_output_gate": True}, {"attention.qk_norm": True},
           {"attention.attention_out_bias": True})


def family_fit(cfg, family: str):
    """`cfg` with the fewest CHANGES that `family` holds; where none does, the set that leaves the fewest problems
    (the family's check then refuses it with the reasons the changes cannot remove: a tower, a mixer)."""
    f, best = FAMILIES[family], None
    for n in range(len(CHANGES) + 1):
        for picked in combinations(CHANGES, n):
            new = cfg.replace(**{k: v for c in picked for k, v in c.items()})
            problems = []
            f.check(new, lambda ok, why: ok or problems.append(why))
            if not problems:
                return new
            if best is None or len(problems) < best[0]:
                best = (len(problems), new)
    return best[1]


def shifted_norms(src, offset: float) -> set:
    """The names of src's trunk RMSNorm weights (block, final, q/k) in src's norm offset when that is not
    `offset` (the hybrid's): those shift_norms re-expresses. `src` may be on the meta device."""
    return {f"{name}.weight" for name, mod in src.named_modules()
            if isinstance(mod, RMSNorm) and mod.offset == src.cfg.norm_offset != offset}


@torch.no_grad()
def shift_norms(state: dict, names: set, src_offset: float, offset: float) -> dict:
    """`state` (the source's, whole or a part) with each of the RMSNorm weights `names` it holds (shifted_norms)
    re-expressed from src_offset to `offset`: the same scale."""
    out = dict(state)
    for k in names & state.keys():
        w = state[k]
        out[k] = (scale_of(w, src_offset).float() - offset).to(w.dtype)
    return out


def expected_rms(w: torch.Tensor, s: torch.Tensor) -> float:
    """sqrt(mean_j sum_i W_ji^2 s_i^2): a projection's output RMS on an RMS-normed input scaled by s."""
    return (w.double().pow(2) * s.double().pow(2)).sum(1).mean().sqrt().item()


@torch.no_grad()
def kept_attention(mix: dict, src_cfg, new_cfg, in_scale: torch.Tensor) -> dict:
    """One kept attention layer's tensors `mix` (source form) in new_cfg's attention: the output gate and q/k norms
    it adds (module docstring). in_scale: the layer's input norm scale (the data-free RMS estimate)."""
    a, b, out = src_cfg.attention, new_cfg.attention, dict(mix)
    d = b.head_dim
    if b.attn_output_gate and not a.attn_output_gate:
        for leaf in ("weight", "bias"):
            if f"q_proj.{leaf}" in mix:
                q = mix[f"q_proj.{leaf}"].unflatten(0, (-1, d))
                out[f"q_proj.{leaf}"] = torch.cat([q, torch.zeros_like(q)], dim=1).flatten(0, 1)
        out["o_proj.weight"] = mix["o_proj.weight"] * 2
    if b.qk_norm and not a.qk_norm:
        for x in "qk":
            w = mix[f"{x}_proj.weight"]
            out[f"{x}_norm.weight"] = torch.full((d,), expected_rms(w, in_scale) - new_cfg.norm_offset, dtype=w.dtype)
    if b.attention_out_bias and not a.attention_out_bias:
        out["o_proj.bias"] = torch.zeros(mix["o_proj.weight"].shape[0], dtype=mix["o_proj.weight"].dtype)
    return out
