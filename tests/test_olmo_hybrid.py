"""OLMo-hybrid's variants against transformers' own OlmoHybridForCausalLM, in memory (its runtime tensor names):
the GDN delta_rule variant (beta doubled, the gated norm's own eps), the attention's q/k norms over all heads
(qk_norm_full) and the post-norm kinds 'A' / '=' (norm after the mixer). The checkpoint round trips are the
family suite's (tests/test_families.py)."""
from __future__ import annotations

import pytest
import torch
import transformers

from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.families.olmo_hybrid import OLMO_HYBRID
from remodel.models.hf import config_from_hf, from_hf_name
from remodel.models.kinds import KINDS
from remodel.models.model import HybridLM

RUNTIME = {"input_layernorm": "attention_layer_norm", "post_attention_layernorm": "feedforward_layer_norm"}


def _ours(hf, cfg):
    """Our model holding transformers' in-memory weights (their names as the checkpoint spells them)."""
    sd = {}
    for n, v in hf.state_dict().items():
        for a, b in RUNTIME.items():
            n = n.replace(f".{a}.", f".{b}.")
        sd[from_hf_name(cfg, "olmo_hybrid", n)[0]] = v
    m = HybridLM(cfg).float().eval()
    m.load_state_dict(sd, strict=False)
    return m


@pytest.mark.parametrize("case", sorted(OLMO_HYBRID.tiny))
def test_logits_equal_transformers(case):
    torch.manual_seed(0)
    hc = transformers.OlmoHybridConfig(**OLMO_HYBRID.tiny[case])
    hf = transformers.OlmoHybridForCausalLM(hc).float().eval()
    with torch.no_grad():  # every norm away from ones: the placement and the q/k norms' extent show
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    cfg = config_from_hf(hc.to_dict() | {"model_type": "olmo_hybrid"})
    assert cfg.linear_allow_neg_eigval == hc.linear_allow_neg_eigval and cfg.linear_norm_eps == 1e-5
    assert set(cfg.pattern[0::2]) == {"D", "A"} and cfg.qk_norm_full
    ids = torch.randint(0, hc.vocab_size, (2, 21))
    with torch.no_grad():
        want, got = hf(ids).logits, _ours(hf, cfg)(ids)
    assert (want - got).abs().max().item() < 1e-5


def test_full_qk_norm_splits_over_tensor_parallel_ranks_and_excludes_per_head_qk_norm():
    """q/k norms over all heads take tensor parallelism (their weights split with the heads; the numerics:
    tests/test_parallel.py::test_all_heads_qk_norm_under_tp); KV heads must still divide; per-head qk_norm
    beside them is refused in one line."""
    from remodel.pipelines.distributed.styles import ShardedNorm, layer_plan
    cfg = ModelConfig(vocab_size=32, hidden_size=16, pattern="A=", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, intermediate_size=8, qk_norm_full=True)
    problems = {tp: [] for tp in (2, 4)}
    for tp, found in problems.items():
        KINDS["A"].check_tp(cfg, tp, lambda ok, why, found=found: ok or found.append(why))
    assert problems[2] == [] and len(problems[4]) == 1 and "num_key_value_heads=2" in problems[4][0]
    layer = HybridLM(cfg).layers[0]
    specs = {}
    plan = layer_plan(cfg, layer.spec, layer.mixer, "layers.0.mixer.", specs)
    assert isinstance(plan["q_norm"], ShardedNorm) and isinstance(plan["k_norm"], ShardedNorm)
    with pytest.raises(RemodelError, match="qk_norm_full"):
        ModelConfig(vocab_size=32, hidden_size=16, pattern="A=", num_attention_heads=2, num_key_value_heads=2,
                    head_dim=8, intermediate_size=8, qk_norm_full=True, qk_norm=True).validate()


@pytest.mark.parametrize("axis", ["attn_heads", "hidden_size", "ffn_size", "all"])
def test_pruned_equals_masked_in_memory(axis):
    """Width pruning of the post-norm layers and the all-heads q norm (tests/masking.py's qk_norm_full
    masking: the dropped heads' queries zeroed, the norm's mean over the kept heads), float64."""
    import copy

    from remodel.compress.baselines import random_scores
    from remodel.compress.prune import plan_keep, prune_model
    from tests.masking import masked_reference
    from tests.test_families import _smaller, ids

    torch.manual_seed(0)
    hc = transformers.OlmoHybridConfig(**OLMO_HYBRID.tiny["plain"])
    cfg = config_from_hf(hc.to_dict() | {"model_type": "olmo_hybrid"})
    model = _ours(transformers.OlmoHybridForCausalLM(hc).float().eval(), cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    model = copy.deepcopy(model).double()
    names = ["attn_heads", "hidden_size", "ffn_size"] if axis == "all" else [axis]
    keep = plan_keep(cfg, random_scores(cfg, seed=3), {n: _smaller(cfg, n) for n in names})
    x = ids(cfg.vocab_size, 1)
    with torch.no_grad():
        a, b, full = prune_model(model, keep)(x), masked_reference(model, keep)(x), model(x)
    assert (a - b).abs().max().item() <= 1e-10
    assert (a - full).abs().max().item() > 1e-2
