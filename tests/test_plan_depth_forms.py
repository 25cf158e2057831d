"""plan with depth on a family that places its layer types by a rule (Family.depth_forms: Jamba's attention and
experts every period layers from an offset): it proposes only counts of layers some placement can write, and places
the layers (evenly spaced without scores, by scores in prune --plan) so that they keep a period / offset form."""
import itertools
import json
import random

import pytest
import torch

from remodel import cli
from remodel.models.config import ModelConfig
from remodel.models.families import FAMILIES, depth_units
from remodel.models.families.depth_forms import choose, possible, unit_types
from remodel.models.hf import config_from_hf
from remodel.models.params import count_params
from tests.conftest import hf_pair

# 10 decoder layers "S- *E S- SE S- *E S- SE S- *E": attention every 4 from 1, experts every 2 from 1. Dropping one
# SE unit, or the evenly spaced S- unit 4, leaves no period / offset form
TEN = dict(FAMILIES["jamba"].tiny["mixed_tied"], vocab_size=256, num_hidden_layers=10, attn_layer_period=4,
           attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1)


def _writable(cfg: ModelConfig, drop) -> bool:
    """The family's own check of the pattern left (the oracle: what prune refuses)."""
    kept = "".join(cfg.pattern[i] for j, u in enumerate(depth_units(cfg, "jamba")) if j not in drop for i in u)
    return FAMILIES["jamba"].holds(cfg.replace(pattern=kept))


def test_possible_and_choose_against_every_subset():
    """Over every count vector of the ten-unit model: possible() is whether some subset with those counts passes
    jamba's check, and choose() returns such a subset of least cost (random costs), its own when it already passes."""
    cfg = config_from_hf(dict(TEN, model_type="jamba"))
    types, rng = unit_types(cfg, "jamba"), random.Random(0)
    cost = [rng.random() for _ in types]
    by: dict = {}
    for k in range(1, 4):
        for drop in itertools.combinations(range(len(types)), k):
            key = tuple(sorted((t, sum(types[j] == t for j in drop)) for t in set(types)))
            by.setdefault(key, []).append((_writable(cfg, drop), sum(cost[j] for j in drop), list(drop)))
    assert not possible(cfg, "jamba", {"SE": 1}) and possible(cfg, "jamba", {"S-": 1})
    for key, sets in by.items():
        removed = dict(key)
        ok = [s for s in sets if s[0]]
        assert possible(cfg, "jamba", removed) == bool(ok), removed
        if ok:
            got = choose(cfg, "jamba", removed, cost, sets[0][2])
            assert _writable(cfg, got) and sorted(types[j] for j in got) == sorted(types[j] for j in sets[0][2])
            assert sum(cost[j] for j in got) == pytest.approx(min(s[1] for s in ok)) or (sets[0][0] and got == sets[0][2])
    plain = config_from_hf(dict(FAMILIES["nemotron_h"].tiny[next(iter(FAMILIES["nemotron_h"].tiny))], model_type="nemotron_h"))
    assert choose(plain, "nemotron_h", {"x": 1}, [0.0] * len(unit_types(plain, "nemotron_h")), [1]) == [1]


@pytest.mark.parametrize("share", [0.97, 0.88])
def test_plan_depth_on_jamba_proposes_what_prune_writes(tmp_path, share):
    """Every candidate of a depth plan is pruned by `prune --plan --candidate K` (its layers re-placed by magnitude
    scores) into a model transformers loads as JambaForCausalLM with the candidate's parameter count."""
    from transformers import JambaForCausalLM
    _, ours, d = hf_pair("jamba", tmp_path, "model", 5, **TEN)
    n = count_params(ours.cfg)["total"]
    p = tmp_path / "plan.json"
    assert cli.main(["plan", str(d), "--params", str(int(share * n)), "--axes", "depth", "--tol", "0.3",
                     "--out", str(p)]) == 0
    cands = json.loads(p.read_text())["candidates"]
    assert cands and all(c["drop_layers"] for c in cands)
    for k, c in enumerate(cands, 1):
        assert _writable(ours.cfg, c["drop_layers"]), c["pattern"]
        out = tmp_path / f"out{k}"
        assert cli.main(["prune", str(d), str(out), "--plan", str(p), "--candidate", str(k)]) == 0
        hf = JambaForCausalLM.from_pretrained(out, dtype=torch.float32)
        assert type(hf) is JambaForCausalLM and hf.config.num_hidden_layers == 10 - len(c["drop_layers"])
        assert sum(t.numel() for t in hf.parameters()) == c["params"]


def test_prune_replaces_a_plans_layers_within_the_forms():
    """prune --plan re-places a plan's layers by scores (plan_file.place_by_scores): the least important S- unit, 4,
    would break the attention period (attention at units 1, 4, 8 left); unit 0 is the only S- unit that may go."""
    from remodel.pipelines.commands.plan_file import place_by_scores
    cfg = config_from_hf(dict(TEN, model_type="jamba"))
    scores = [1.0] * 10
    scores[4] = 0.0
    assert not _writable(cfg, [4]) and [j for j in range(0, 10, 2) if _writable(cfg, [j])] == [0]
    assert place_by_scores(cfg, "jamba", [8], scores) == [0]
    scores[4], scores[0] = 1.0, 0.5  # one S- and one *E unit: a writable pair
    assert _writable(cfg, place_by_scores(cfg, "jamba", [8, 1], scores))


def test_prune_num_layers_drops_a_writable_set():
    """prune --num-layers drops the least important units whatever their types; on Jamba, where the least important
    two (S- units 2 and 4) would break the attention period, the writable pair of least scores instead (brute force
    over every pair), and the pruned config is one the family holds."""
    from remodel.compress.prune import new_config, plan_keep
    cfg = config_from_hf(dict(TEN, model_type="jamba"))
    units = depth_units(cfg, "jamba")
    per_unit = [0.9, 0.5, 0.1, 0.7, 0.2, 0.8, 0.6, 0.95, 0.3, 0.4]
    s = torch.zeros(cfg.num_layers, dtype=torch.float64)
    for j, u in enumerate(units):
        s[u[0]] = per_unit[j]
    best = min((sum(per_unit[j] for j in d), d) for d in itertools.combinations(range(10), 2) if _writable(cfg, d))[1]
    assert not _writable(cfg, (2, 4)) and best != (2, 4)
    keep = plan_keep(cfg, {"block_importance": s.float()}, {"num_layers": 8}, "jamba")
    assert keep["layers"].tolist() == [i for j, u in enumerate(units) if j not in best for i in u]
    assert FAMILIES["jamba"].holds(new_config(cfg, keep))


def test_plan_ranges_count_only_writable_depths():
    """The reachable range plan reports (extremes: smallest, and largest below the source) is over the writable
    removals only: brute force over every set of units within the depth caps that jamba's check accepts."""
    from remodel.compress.search_space import build_space, extremes
    from remodel.pipelines.commands.plan_file import candidate_config
    cfg = config_from_hf(dict(TEN, model_type="jamba", num_hidden_layers=12, attn_layer_offset=2))  # S-SE*-SE...
    sp, types = build_space(cfg, "depth", family="jamba"), unit_types(cfg, "jamba")
    got = []
    for k in range(1, sp.max_removed + 1):
        for drop in itertools.combinations(range(len(types)), k):
            if all(sum(types[j] == t for j in drop) <= sp.removable[t] for t in sp.types) and _writable(cfg, drop):
                got.append(count_params(candidate_config(cfg, {"widths": {}, "drop_layers": drop}, "jamba"))["total"])
    assert extremes(sp)["params"] == (min(got), max(got), count_params(cfg)["total"])
