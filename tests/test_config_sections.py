"""ModelConfig is the trunk plus one config section per layer kind (issue 40): the sections are the kinds'
own dataclasses, flat names route to them, JSON keeps only the sections in use, and the configs written
before the sections (flat dicts) read the same."""
import json

import pytest

from remodel.models.config import OWNERS, SECTIONS, ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.kinds import BY_NAME, KINDS
from tests.conftest import FAMILY_CONFIGS, KIND_CONFIGS


def test_every_kind_owns_a_section_of_its_fields():
    assert {k.section_name for k in KINDS.values()} <= set(SECTIONS)
    for k in KINDS.values():  # a derived kind ('A': attention normalised after the mixer) reads its base's section
        assert SECTIONS[k.section_name] is (k.config or BY_NAME[k.section_name].config)
    fields = [f for cls in SECTIONS.values() for f in cls.names()]
    assert "d_state" in [f for f in fields if fields.count(f) == 2]  # Mamba-1 and Mamba-2: no uniqueness rule
    trunk = set(ModelConfig.__dataclass_fields__) - {"sections"}
    assert trunk == {"vocab_size", "hidden_size", "pattern", "norm_eps", "norm_offset", "tie_word_embeddings",
                     "padding_idx", "mtp_layers", "mtp_pattern", "extra"}


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_json_keeps_the_sections_in_use_and_old_flat_dicts_read_the_same(name):
    cfg = FAMILY_CONFIGS[name]
    d = json.loads(json.dumps(cfg.to_dict()))
    chars = set(cfg.pattern + cfg.mtp_pattern)
    in_use = {k.section_name for k in KINDS.values() if k.char in chars}
    assert in_use <= set(d), sorted(d)
    for n in set(SECTIONS) & set(d) - in_use:  # a section of a kind not in use is written only when it is set
        assert cfg.sections[n] != SECTIONS[n](), n
    assert set(SECTIONS) - set(d) - in_use, "no section is left out"
    assert ModelConfig.from_dict(d) == cfg
    paths = json.loads(json.dumps({k: "inf" if v == float("inf") else v for k, v in cfg.flat().items()}))
    assert ModelConfig.from_dict(paths) == cfg  # "section.field" keys
    renamed = {f"{n}.{new}": old for n, cls in SECTIONS.items() for old, new in cls.RENAMED.items()}
    # a config written before the sections: flat, under the names of then (a name two sections share stays a path)
    old = {renamed.get(k) or (k.rpartition(".")[2] if len(OWNERS.get(k.rpartition(".")[2], ())) == 1 else k): v
           for k, v in paths.items()}
    assert ModelConfig.from_dict(old) == cfg
    for k, v in cfg.flat().items():  # every path reads its owner's value; no section field is a config attribute
        assert cfg.value(k) == v
        if "." in k:
            with pytest.raises(AttributeError, match="a field of section"):
                getattr(cfg, k.rpartition(".")[2])


def test_paths_write_their_owning_sections():
    cfg = FAMILY_CONFIGS["mixtral"]
    assert cfg.mlp.mlp_act == cfg.moe.moe_act == "silu"  # the experts take the MLP's act where not given their own
    new = cfg.replace(**{"attention.num_attention_heads": 2 * cfg.attention.num_attention_heads}, mlp_act="gelu")
    assert new.sections["attention"].num_attention_heads == 2 * cfg.attention.num_attention_heads
    assert new.mlp.mlp_act == "gelu" and cfg.mlp.mlp_act == "silu"  # cfg itself unchanged
    assert new.sections["mamba"] is cfg.sections["mamba"]  # untouched sections are shared (frozen)


def test_bounds_come_from_the_section_field():
    cfg = FAMILY_CONFIGS["llama"]
    with pytest.raises(RemodelError, match=r"num_attention_heads must be in 0\.\.65,536, got 70000"):
        cfg.replace(num_attention_heads=70000)
    with pytest.raises(RemodelError, match="ssm_multipliers must be 5 finite numbers"):
        cfg.replace(ssm_multipliers=(1.0, 2.0))
    with pytest.raises(RemodelError, match="unknown remodel config fields: .'num_heads'."):
        ModelConfig.from_dict({**cfg.to_dict(), "num_heads": 4})
    with pytest.raises(RemodelError, match="unknown remodel config fields: .'heads'."):
        ModelConfig.from_dict({**cfg.to_dict(), "attention": {"heads": 4}})


def _away(v):
    """A value of a variant field away from its plain default."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, tuple):
        return tuple(x * 2 for x in v)
    return 0.5 if v is None else v * 2


NUMERICS = {"multipliers": {"embedding_multiplier", "residual_multiplier", "attention_scale", "logits_scaling"},
            "projections": {"key_multiplier", "ssm_multipliers", "mlp_multipliers", "attention_in_multiplier",
                            "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier", "lm_head_multiplier",
                            "mamba_rms_norm", "mamba_norm_before_gate"}}


@pytest.mark.parametrize("group,words", [("multipliers", "no scalar multipliers"),
                                         ("projections", "no per-projection multipliers")])
def test_family_numerics_are_the_sections_variants(group, words):
    """Each section field tagged as a family numeric (metadata 'variant') is refused, named, by a family
    that does not hold its group; the lists models.families checks are generated from those tags."""
    from remodel.models.hf import check_exportable
    from remodel.models.section import variants
    got = variants(SECTIONS.values(), group)
    assert set(got) == NUMERICS[group]
    cfg = FAMILY_CONFIGS["bamba"]  # plain: every numeric off
    check_exportable(cfg, "bamba")
    for name, plain_value in got.items():
        odd = cfg.replace(**{name: _away(plain_value)})
        with pytest.raises(RemodelError, match=f"{words}.*{name}"):
            check_exportable(odd, "bamba")


def test_raw_config_json_bounds_come_from_the_fields_that_hold_them():
    """models.hf checks the raw config.json against the bounds the kinds' fields declare (metadata "raw"),
    the families' own shape keys (Family.raw) and the trunk's; no other table. A field's bound moves the
    raw check with it."""
    import dataclasses

    from remodel.models import hf
    from remodel.models.families import FAMILIES
    from remodel.models.mamba import MambaConfig
    from remodel.models.section import Section, ints, raw_bounds, reals

    @dataclasses.dataclass(frozen=True)
    class Toy(Section):
        toy_heads: int = ints(0, 0, 7, raw={"toy_heads": 1, "toy_n_heads": 1})
        toy_eps: float = reals(1.0, gt=0, raw=("toy_eps",))

    assert raw_bounds([Toy]) == ({"toy_heads": (1, 7), "toy_n_heads": (1, 7)}, {"toy_eps": (0, False)})
    ints_, floats = raw_bounds([ModelConfig, *SECTIONS.values()])
    families = {k for f in FAMILIES.values() for k in f.raw}
    assert set(hf._RAW_INTS) == set(ints_) | families | set(hf._TRUNK_RAW)
    assert hf._RAW_FLOATS == floats
    field = MambaConfig.__dataclass_fields__["mamba_num_heads"]
    assert hf._RAW_INTS["mamba_n_heads"] == (1, field.metadata["check"][2])  # Bamba's name, Mamba's field
    with pytest.raises(RemodelError, match=r"config.json: 'mamba_n_heads' must be in 1\.\.65,536, got 70000"):
        hf.check_raw_config({"mamba_n_heads": 70000})
    with pytest.raises(RemodelError, match=r"'time_step_max' must be finite"):
        hf.check_raw_config({"time_step_max": float("nan")})
    hf.check_raw_config({"time_step_max": float("inf"), "num_local_experts": 0})  # +inf and 0 experts allowed


def test_section_fields_are_read_through_their_section_only():
    cfg = FAMILY_CONFIGS["nemotron_h"]
    assert cfg.attention.num_attention_heads == cfg.sections["attention"].num_attention_heads == 4
    for name in ("num_attention_heads", "d_state", "n_routed_experts", "embedding_multiplier"):
        with pytest.raises(AttributeError, match="a field of section"):
            getattr(cfg, name)
        with pytest.raises(AttributeError, match="immutable"):
            setattr(cfg, name, 1)
    assert cfg.value("mamba.d_state") == cfg.mamba.d_state and cfg.value("hidden_size") == 24
    assert cfg.get("n_groups", "mamba") == cfg.mamba.n_groups == cfg.get("mamba.n_groups")


def test_two_sections_may_name_a_field_alike(monkeypatch):
    """No cross-section uniqueness rule: a bare name two sections declare is refused in input and in
    path_of (name the section), while "section.field" keys and reads through the section work."""
    from remodel.models import config as config_mod
    monkeypatch.setitem(config_mod.OWNERS, "head_dim", ["attention", "mamba"])
    cfg = FAMILY_CONFIGS["llama"]
    with pytest.raises(RemodelError, match="declared by attention, mamba: name it as section.field"):
        cfg.replace(head_dim=4)
    with pytest.raises(RemodelError, match="name it as section.field"):
        config_mod.path_of("head_dim")
    assert config_mod.path_of("head_dim", "attention") == "attention.head_dim"
    assert cfg.replace(**{"attention.head_dim": 4}).attention.head_dim == 4


def test_slots_name_each_layer_kind_and_its_section():
    cfg = FAMILY_CONFIGS["nemotron_h"]
    assert "".join(s.kind.char for s in cfg.slots) == cfg.pattern and [s.index for s in cfg.slots] == list(range(4))
    for s in cfg.slots:
        assert s.section is cfg.sections[s.kind.section_name]


@pytest.mark.parametrize("name", sorted(KIND_CONFIGS))
def test_each_kind_module_is_built_from_its_own_sections(name):
    """Block gives a kind's module a KindView, and ModelConfig.validate gives one to the kind's checks: the trunk's
    fields and the kind's sections (LayerKind.sections); a read of any other kind's section raises, so a module or
    its checks cannot depend on another kind's config."""
    from remodel.models.block import Block
    from remodel.models.config import KindView
    cfg = KIND_CONFIGS[name]
    k = KINDS[cfg.pattern[0]]
    given, checked = [], []
    orig, orig_check = type(k).build, type(k).validate
    try:
        type(k).build = lambda self, c: given.append(c) or orig(self, c)
        type(k).validate = lambda self, c, need: checked.append(c) or orig_check(self, c, need)
        Block(cfg, k.char)
        cfg.replace()  # validated again
    finally:
        type(k).build, type(k).validate = orig, orig_check
    (view,) = given
    assert isinstance(view, KindView) and set(view.sections) == {"scales", *k.sections}
    assert checked and all(isinstance(c, KindView) and c.sections == view.sections for c in checked)
    path = f"{k.section_name}.{SECTIONS[k.section_name].names()[0]}"
    assert view.hidden_size == cfg.hidden_size and view.value(path) == cfg.value(path)
    for other in set(SECTIONS) - set(k.sections) - {"scales"}:
        with pytest.raises(AttributeError, match="read"):
            getattr(view, other)



_COUNTS = ("axis_size", "cache_bytes", "state_rows", "buffer_elements", "mixing_flops", "check_tp")


def _own_view(given, k):
    """Every config a kind's method was given is its view: the trunk and its sections, no other kind's."""
    from remodel.models.config import KindView
    assert given and all(isinstance(c, KindView) and set(c.sections) == {"scales", *k.sections} for c in given)
    for other in set(SECTIONS) - set(k.sections) - {"scales"}:
        with pytest.raises(AttributeError, match="read"):
            getattr(given[0], other)


@pytest.mark.parametrize("name", sorted(KIND_CONFIGS))
def test_each_kind_counts_and_tp_plan_read_its_own_sections(name, monkeypatch):
    """A kind's counts (its axes' sizes, so every parameter count; its inference state, buffers and FLOPs), its
    TP checks and its TP plan's splits are given the kind's view (issue 54 Deliver 1): another kind's section
    raises there."""
    from types import SimpleNamespace

    from remodel.models.block import Block
    from remodel.models.params import count_params, memory_bytes
    from remodel.pipelines.distributed import styles
    from remodel.pipelines.distributed.parallel import check_layout
    from remodel.pipelines.training.metrics import forward_flops_per_token
    cfg = KIND_CONFIGS[name]
    k = KINDS[cfg.pattern[0]]
    given = {m: [] for m in (*_COUNTS, "tp_split")}
    for m in _COUNTS:
        orig = getattr(type(k), m)
        monkeypatch.setattr(type(k), m, lambda self, c, *a, _m=m, _o=orig, **kw: given[_m].append(c) or _o(self, c, *a, **kw))
    orig_split = styles.tp_split
    monkeypatch.setattr(styles, "tp_split", lambda c, axes: given["tp_split"].append(c) or orig_split(c, axes))
    assert count_params(cfg, by_axis=True)["total"] and memory_bytes(cfg)["total"]
    model = SimpleNamespace(cfg=cfg, parameters=lambda: iter(()))
    assert forward_flops_per_token(model, 16) > 0
    try:
        check_layout(cfg, 2, 1, None, "tp", "dp", SimpleNamespace(mesh_dim_names=("tp", "dp")))
    except RemodelError:
        pass  # a width 2 does not divide: the check itself is what is watched
    block = Block(cfg, k.char)
    styles.layer_plan(cfg, k, block.mixer, "layers.0.mixer.", {})
    from remodel.models.layout import owner
    for m, cs in given.items():  # every method watched was called (axis_size: where the kind owns an axis)
        if m != "axis_size" or any(owner(a) is k for a in k.sizes):
            _own_view(cs, k)


@pytest.mark.parametrize("family,blocks", [("mixtral", None), ("qwen3_next", "D"), ("gpt_oss", "E")])
def test_the_hf_key_map_reads_each_tensor_kinds_own_sections(family, blocks, monkeypatch):
    """Where the HF key map reads the config (a routed tensor's expert count, both ways; the blocks of a fused
    tensor: Qwen3-Next's per-key-head qkvz, gpt-oss's interleaved gate/up) it reads the view of the tensor's kind
    (every row of weight_table round-trips), and that view raises on another kind's section."""
    import sys

    from remodel.models.config import KindView
    from remodel.models.hf_adapter import from_hf_name, kind_view, to_hf_part, weight_table
    cfg = FAMILY_CONFIGS[family]
    seen = set()
    for m in ("get", "reads"):
        orig = getattr(KindView, m)

        def watched(self, *a, _o=orig, _m=m):
            f = sys._getframe(1)
            if f.f_globals["__name__"].endswith("hf_adapter"):  # the key map's own reads: (its function, what, view)
                fn = f.f_back.f_code.co_name if f.f_code.co_name == "_check_expert" else f.f_code.co_name
                seen.add((fn, _m, frozenset(self.sections)))
            return _o(self, *a)
        monkeypatch.setattr(KindView, m, watched)
    for ours, _, e in weight_table(cfg, family):
        part = to_hf_part(cfg, family, ours, e)
        assert from_hf_name(cfg, family, part.name, part.index) == (ours, e)
    own = {c: frozenset({"scales", *KINDS[c].sections}) for c in cfg.pattern}
    assert {("to_hf_part", "reads", own["E"]), ("from_hf_name", "reads", own["E"])} <= seen
    assert blocks is None or ("to_hf_part", "get", own[blocks]) in seen
    assert {v for *_, v in seen} <= set(own.values())
    view = kind_view(cfg, f"layers.{cfg.pattern.index('E')}.mixer.x")
    for other in set(SECTIONS) - set(view.sections):
        with pytest.raises(AttributeError, match="read"):
            getattr(view, other)


def test_moe_has_its_own_activation():
    """The MoE kind's experts and shared expert take moe_act and moe_gated, fields of its own section (issue 54
    Deliver 1: MoE reads no MLP field); a config without them (written before they existed, or read from a
    family's one activation key) takes the MLP's; a family holding both in one key refuses to export two
    different ones."""
    from remodel.models.block import Block
    from remodel.models.hf import config_to_hf, our_shapes
    from remodel.models.mlp import ACT
    from remodel.models.kinds import KINDS as kinds
    assert "mlp" not in kinds["E"].sections  # its module reads no MLP field
    cfg = KIND_CONFIGS["moe"].replace(**{"mlp.mlp_act": "silu", "moe.moe_act": "gelu", "mlp.mlp_gated": True,
                                         "moe.moe_gated": False})
    moe = Block(cfg, "E").mixer
    assert moe.experts.act is ACT["gelu"] and moe.shared_experts.act is ACT["gelu"]
    assert moe.experts.gate_proj is None and moe.shared_experts.gate_proj is None
    assert not any("gate_proj" in n for n in our_shapes(cfg))  # the layout's flag is the MoE's own
    old = {**cfg.to_dict(), "mlp": cfg.mlp.to_dict(),
           "moe": {k: v for k, v in cfg.moe.to_dict().items() if k not in ("moe_act", "moe_gated")}}
    assert (ModelConfig.from_dict(old).moe.moe_act, ModelConfig.from_dict(old).moe.moe_gated) == ("silu", True)
    dense = FAMILY_CONFIGS["llama"]  # a config without MoE layers writes no MoE section, unless set apart
    apart = dense.replace(**{"moe.moe_act": "gelu"})
    assert "moe" not in dense.to_dict() and ModelConfig.from_dict(apart.to_dict()) == apart != dense
    nemo = FAMILY_CONFIGS["nemotron_h"]
    assert config_to_hf(nemo, "nemotron_h")["mlp_hidden_act"] == nemo.moe.moe_act == nemo.mlp.mlp_act
    with pytest.raises(RemodelError, match="holds mlp.mlp_act and moe.moe_act in one key"):
        config_to_hf(nemo.replace(**{"moe.moe_act": "silu"}), "nemotron_h")
