"""plan on a family whose config.json holds two of our widths in one key (Family.one_key: Jamba's intermediate_size
sizes both its dense MLPs and each expert): the search treats them as one knob (one option list, applied to both),
so every candidate is one `remodel prune` accepts and transformers loads with the candidate's parameter count."""
import json

import pytest
import torch

from remodel import cli
from remodel.compress.prune import validate_targets
from remodel.compress.search_space import build_space
from remodel.models.errors import RemodelError
from remodel.models.families import FAMILIES
from remodel.models.hf import check_exportable, config_from_hf
from remodel.models.params import count_params
from remodel.pipelines.commands.plan import plan
from tests.conftest import cli_pair

MIXED = dict(FAMILIES["jamba"].tiny["mixed_tied"], model_type="jamba", vocab_size=2048)  # "*-SES-SE": MLPs and MoEs


def test_one_key_ties_the_widths_the_model_has():
    """The tie follows the family's one_key and the layers present: MLPs beside experts tie the two FFN widths; experts
    alone (the plain case, "SE*ESE*E") tie nothing; two different values are refused by the family's check."""
    jamba, mixed = FAMILIES["jamba"], config_from_hf(MIXED)
    assert jamba.tied_fields(mixed) == [("mlp.intermediate_size", "moe.moe_intermediate_size")]
    plain = config_from_hf(dict(FAMILIES["jamba"].tiny["plain"], model_type="jamba"))
    assert jamba.tied_fields(plain) == [] and build_space(plain).ties == {}
    sp = build_space(mixed, "width")
    assert sp.ties == {"expert_ffn_size": "ffn_size"} and "ffn_size" in sp.outer_axes()  # the MoE's knob too
    assert "expert_ffn_size" not in sp.outer_axes() + [a for t in sp.types for a in sp.type_axes(t)]
    assert sp.values["ffn_size"] == sp.values["expert_ffn_size"] == [40, 32, 24]  # FFN steps of 4, experts of 8
    with pytest.raises(RemodelError, match="holds mlp.intermediate_size and moe.moe_intermediate_size in one key"):
        check_exportable(mixed.replace(**{"moe.moe_intermediate_size": 32}), "jamba")
    assert build_space(mixed, ("hidden_size", "experts")).values["expert_ffn_size"] == [40]  # not named: held


def test_any_family_declaring_one_key_is_checked_on_export(monkeypatch):
    """check_one_key is asked by the generic export check (models.hf.check_exportable) and Family.holds, not by a
    family's own check: kimi_linear given Jamba's one_key (its tiny case: dense MLPs of 40, experts of 16) refuses
    the two widths in one line, and holds them once equal."""
    from dataclasses import replace
    cfg = config_from_hf(dict(FAMILIES["kimi_linear"].tiny["kda_mla_moe"], model_type="kimi_linear"))
    check_exportable(cfg, "kimi_linear")  # as declared: no one_key
    monkeypatch.setitem(FAMILIES, "kimi_linear", replace(FAMILIES["kimi_linear"], one_key=FAMILIES["jamba"].one_key))
    with pytest.raises(RemodelError, match="kimi_linear holds mlp.intermediate_size and moe.moe_intermediate_size "
                                           r"in one key, intermediate_size \(mlp.intermediate_size=40, "):
        check_exportable(cfg, "kimi_linear")
    equal = cfg.replace(**{"mlp.intermediate_size": 16})
    assert not FAMILIES["kimi_linear"].holds(cfg) and FAMILIES["kimi_linear"].holds(equal)
    check_exportable(equal, "kimi_linear")


def test_plan_on_jamba_proposes_what_prune_writes(tmp_path):
    """Every candidate keeps the MLP and expert FFN equal and passes prune's checks; the top one (an FFN cut) pruned
    by the CLI from its PLAN file loads in transformers as JambaForCausalLM with the candidate's parameter count."""
    from transformers import JambaForCausalLM
    _, ours, d = cli_pair("jamba", "mixed_tied", tmp_path)
    cfg, n = ours.cfg, count_params(ours.cfg)["total"]
    p = tmp_path / "plan.json"
    assert cli.main(["plan", str(d), "--params", str(int(0.93 * n)), "--axes", "width", "--out", str(p)]) == 0
    cands = json.loads(p.read_text())["candidates"]
    for c in cands:
        assert c["widths"]["ffn_size"] == c["widths"]["expert_ffn_size"]
        validate_targets(cfg, c["prune_targets"], "jamba")
    assert len(cands) >= 3 and any(c["widths"]["ffn_size"] < 40 for c in cands)
    top = cands[0]
    assert top["widths"]["ffn_size"] == 32 and top["params"] <= 0.93 * n
    out = tmp_path / "out"
    assert cli.main(["prune", str(d), str(out), "--plan", str(p), "--candidate", "1"]) == 0
    hf = JambaForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(hf) is JambaForCausalLM and hf.config.intermediate_size == 32
    assert sum(t.numel() for t in hf.parameters()) == top["params"]


def _int_keys(d: dict, path=()):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _int_keys(v, path + (k,))
        elif isinstance(v, int) and not isinstance(v, bool):
            yield path + (k,), v


def _probed_ties(family: str, cfg) -> set:
    """The groups of the model's widths that follow one config.json key: each key whose value two widths share,
    doubled alone and read back (from_hf), and the widths then at the doubled value, leaving out pairs a width rule
    of the family relates (Granite-style shared = n_shared_experts x expert FFN: a multiple, not one key)."""
    from remodel.compress.search_space import WIDTHS
    from remodel.models.hf import config_to_hf
    from remodel.models.kinds import used
    kinds, rules = used(cfg, mtp=False), [set(r.of + r.by) for r in FAMILIES[family].width_rules]
    have = {a: w.of(cfg) for a, w in WIDTHS.items() if w.of(cfg) and (w.layer is None or any(a in k.widths for k in kinds))}
    hf, out = config_to_hf(cfg, family), set()
    for path, v in _int_keys(hf):
        if sum(x == v for x in have.values()) < 2:
            continue
        d = json.loads(json.dumps(hf))
        at = d
        for k in path[:-1]:
            at = at[k]
        at[path[-1]] = 2 * v
        try:
            new = config_from_hf(d)
        except RemodelError:
            continue
        moved = {a for a in have if have[a] == v and WIDTHS[a].of(new) == 2 * v}
        if len(moved) > 1 and not any(moved <= r for r in rules):
            out.add(frozenset(WIDTHS[a].path for a in moved))
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_key_holding_two_widths_is_declared(family):
    """Over every family's tiny configs: the widths one config.json key holds (probed through the family's own
    from_hf / to_hf) are exactly those its one_key declares for the layers the model has (jamba's mixed case: the MLP
    and expert FFN; no other family holds two widths in one key)."""
    for case, tiny in FAMILIES[family].tiny.items():
        cfg = config_from_hf(dict(tiny, model_type=family))
        declared = {frozenset(g) for g in FAMILIES[family].tied_fields(cfg)}
        assert _probed_ties(family, cfg) == declared, case
