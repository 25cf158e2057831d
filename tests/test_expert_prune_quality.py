"""Expert pruning quality on the shipped trained MoE (data/embedded_moe; issue 20 acceptance), through
bench/bench_expert_prune_quality.py's `compare` at a small size (64 x 256 train-split calibration tokens,
16,384 held-out valid-split tokens):

- routed-contribution expert importance gives a lower held-out perplexity than the mean of 3 random
  seeds for experts 8 -> 6, 8 -> 4, expert FFN -50% and 8 -> 6 with expert FFN -50%;
- against frequency-only it is NOT reliably lower on this model: the two rank the experts almost alike
  and which is lower flips with the calibration / held-out size (bench/RESULTS.md "Expert pruning
  quality", 256 x 256 calibration + 32k held-out: contribution lower at 8 -> 6 and 8 -> 6 + FFN, higher
  at 8 -> 4; here, 64 x 256 + 16k: lower at 8 -> 4 by 1.2%, higher at 8 -> 6 + FFN by 0.5%; equal for FFN
  alone, where the expert ranking plays no part). The test asserts only what holds: contribution is never
  more than 1% above frequency."""
import importlib.util
from pathlib import Path

import pytest
import torch

from pipelines.data import embedded_moe_path

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_expert_prune_quality",
                                                  REPO / "bench" / "bench_expert_prune_quality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not (embedded_moe_path() / "config.json").exists(),
                    reason="the shipped trained MoE (data/embedded_moe, data/make_embedded_moe.py) is absent")
def test_contribution_beats_random_and_is_not_worse_than_frequency_on_the_trained_moe():
    torch.set_num_threads(1)
    res = _bench().compare(embedded_moe_path(), samples=64, seq_len=256, eval_tokens=16384, seeds=3)
    assert len(res["rows"]) == 4
    for r in res["rows"]:
        c, f, rnd = r["contribution"], r["frequency"], r["random_mean"]
        assert res["unpruned_ppl"] < c < rnd, (r["case"], res["unpruned_ppl"], c, r["random"])
        assert c < 1.01 * f, (r["case"], c, f)
