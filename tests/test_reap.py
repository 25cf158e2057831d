"""`--expert-method reap` (REAP, arXiv 2510.13999; `mean` its alias): each routed expert's score is the mean
over the tokens routed to it of router weight x the norm of its output, computed here directly from the
router and the experts, for a routed MoE (sigmoid and softmax routers) and a LatentMoE; the shared expert
is never a candidate."""
import dataclasses

import pytest
import torch

from remodel.compress.expert_scores import rank_experts
from remodel.compress.importance import score_model
from tests.conftest import KIND_CONFIGS, random_model

MOE = KIND_CONFIGS["moe"]  # two MoE layers, 6 experts top-2, a shared expert, sigmoid router
CASES = {"routed": MOE, "softmax": dataclasses.replace(MOE, router="softmax"),
         "latent": dataclasses.replace(MOE, moe_latent_size=8)}


@torch.no_grad()
def direct_reap(model, ids) -> dict:
    """{layer: [E]} REAP from each MoE's input, captured by a hook: the router's weights and choices, and
    each expert run alone on its tokens (in the latent for a LatentMoE)."""
    inputs = {}
    hooks = [layer.mixer.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
             for i, layer in enumerate(model.layers) if layer.spec.routed]
    model(ids)
    for h in hooks:
        h.remove()
    out = {}
    for i, x in inputs.items():
        moe = model.layers[i].mixer
        x = x.reshape(-1, x.shape[-1])
        _, w, idx = moe.gate(x)
        h = moe.fc1_latent_proj(x) if moe.cfg.moe.moe_latent_size else x
        s = torch.zeros(moe.cfg.moe.n_routed_experts, dtype=torch.float64)
        for e in range(len(s)):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if len(tok):
                y = moe.experts.expert(e, h[tok])
                s[e] = (w[tok, slot].abs().double() * y.double().norm(dim=-1)).mean()
        out[i] = s
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_reap_equals_direct_computation(case):
    cfg = CASES[case]
    model = random_model(cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    scores = score_model(model, [ids], loss_increase=False)[0]
    reap, alias = rank_experts(scores, cfg, "reap"), rank_experts(scores, cfg, "mean")
    want = direct_reap(model, ids)
    assert sorted(want) == [0, 1]
    for i, s in want.items():
        got = reap[f"layers.{i}.experts"]
        assert got.shape == (cfg.moe.n_routed_experts,)  # routed experts only: no slot for the shared expert
        assert torch.allclose(got.double(), s, rtol=1e-5, atol=1e-7), (i, got, s)
        assert torch.equal(alias[f"layers.{i}.experts"], got)
        assert len(set(s[s > 0].tolist())) >= 3  # several experts routed, with distinct scores: a ranking


def test_shared_expert_never_moves_reap():
    """Scaling the shared expert's output changes the first MoE layer's output but not its REAP scores."""
    model = random_model(MOE, seed=3)
    ids = torch.randint(0, MOE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    before = rank_experts(score_model(model, [ids], loss_increase=False)[0], MOE, "reap")["layers.0.experts"]
    with torch.no_grad():
        model.layers[0].mixer.shared_experts.down_proj.weight.mul_(10)
    after = rank_experts(score_model(model, [ids], loss_increase=False)[0], MOE, "reap")["layers.0.experts"]
    assert torch.equal(before, after)
