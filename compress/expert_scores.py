"""Which per-expert score ranks the routed experts of every MoE layer (`layers.i.experts`, what
plan_keep reads for --experts), chosen from what a calibration run recorded (compress/importance.py):

  reconstruction  greedy elimination by routed-output reconstruction (compress/expert_select.py): the
                experts removed are those whose going, with their tokens re-routed as the pruned router
                does, moves the layer's routed output least; sees near-duplicate experts, which no
                per-expert score does (the default of `remodel score`)
  contribution  sum over calibration tokens of |router weight| * ||expert output||: an expert that is
                routed often but writes almost nothing scores low, one routed rarely but decisively
                scores by what it actually adds
  frequency     how many calibration tokens were routed to it (a baseline)
  reap          REAP, router-weighted expert activation pruning (Lasby et al., arXiv 2510.13999): the
                mean over the tokens routed to the expert of |router weight| * ||expert output||, what
                Scorer.result() itself writes as `experts` (for a LatentMoE the output is the expert's,
                in the latent, before fc2_latent_proj). `mean` is its older name, kept as an alias
  random        uniform [0, 1) from torch.Generator(seed), per layer (a baseline)

The router weight is the one the output is multiplied by (unbiased sigmoid / softmax score after
normalisation and scaling): e_score_correction_bias only decides selection, so it shows in which
tokens an expert sees (and in frequency), never in the weight. The shared expert is not a candidate.
The MTP head's MoE blocks (`mtp.layers.j.experts`) are ranked the same way, from their own activations.
"""
from __future__ import annotations

import torch

from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.kinds import KINDS

EXPERT_METHODS = ("reconstruction", "contribution", "frequency", "reap", "random")
ALIASES = {"mean": "reap"}  # the name `reap` had before it was named after its paper
SOURCE = {"reconstruction": "expert_reconstruction", "contribution": "expert_contribution",
          "frequency": "expert_frequency", "reap": "experts"}
ROUTED = ("reconstruction", "contribution")  # expert FFN channels ranked by what they write via the router


def check_expert_method(method: str) -> str:
    """The method's own name (an alias resolved); a one-line error for an unknown one."""
    if method not in EXPERT_METHODS and method not in ALIASES:
        raise RemodelError(f"unknown expert scoring method {method!r} (allowed: {', '.join(EXPERT_METHODS)})")
    return ALIASES.get(method, method)


def rank_experts(scores: dict, cfg: ModelConfig, method: str = "reconstruction", seed: int = 0) -> dict:
    """A copy of `scores` whose `layers.i.experts` is the `method` score of every MoE layer."""
    method = check_expert_method(method)
    out, g = dict(scores), torch.Generator().manual_seed(seed)
    trunk = [f"layers.{i}." for i, c in enumerate(cfg.pattern) if KINDS[c].routed]
    mtp = [f"mtp.layers.{j}." for j, c in enumerate(cfg.mtp_full_pattern) if KINDS[c].routed]
    for p in trunk + mtp:  # trunk first: the random draws of the trunk's layers do not depend on the MTP
        if method == "random":
            out[p + "experts"] = torch.rand(cfg.moe.n_routed_experts, generator=g)
            continue
        src = scores.get(p + SOURCE[method])
        if src is None and p in mtp:  # scores without the MTP head's own: prune ranks it by a stand-in
            continue
        if src is None:
            raise RemodelError(f"the scores have no {p + SOURCE[method]!r} (needed for --expert-method {method}); "
                               "re-run `remodel score` with activation importance")
        out[p + "experts"] = src.float().clone()
        if method in ROUTED and p + "expert_ffn_contribution" in scores:  # channels by what they write
            out[p + "expert_ffn"] = scores[p + "expert_ffn_contribution"].float().clone()
    return out
