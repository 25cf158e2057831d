"""The layout registry (models/layout.py) is the one table: shapes equal the built model's, and the
parameter counts, the pruning indices and the TP plan all change when the table changes."""
import json
import math
import pathlib
import re

import pytest
import torch

from remodel.compress.axes import axis_index, dim_indices
from remodel.models import kinds, layout, spec
from remodel.models.config import ModelConfig
from remodel.models.families import FAMILIES
from remodel.models.hf import config_from_hf
from remodel.models.model import HybridLM
from remodel.models.params import count_params, per_layer
from remodel.pipelines.distributed.styles import layer_plan
from tests.conftest import tiny_configs

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRODUCT = ["models", "compress", "upcycle", "pipelines"]


def all_configs():
    cfgs = dict(tiny_configs())
    for f in sorted((ROOT / "models" / "configs").glob("*.json")):
        d = json.loads(f.read_text())
        if d["model_type"] in FAMILIES:  # olmo-hybrid-7b.json ships before its family (branch wt-olmo) merges
            cfgs[f.stem] = config_from_hf(d)
    return cfgs


@pytest.mark.parametrize("name", sorted(all_configs()))
def test_shapes_equal_the_built_model(name):
    cfg = all_configs()[name]
    if sum(math.prod(s) for s in layout.shapes(cfg).values()) > 3e9:
        cfg = cfg.replace(hidden_size=64)  # the real configs: same structure, small enough for meta
    with torch.device("meta"):
        model = HybridLM(cfg)
    ours = {n: tuple(t.shape) for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if not n.endswith(("inv_freq",)) and "." in n}
    assert ours == layout.shapes(cfg)


def _mamba_cfg():
    return ModelConfig(vocab_size=64, hidden_size=16, pattern="M*-", num_attention_heads=4, num_key_value_heads=2,
                       head_dim=4, intermediate_size=32, mamba_num_heads=4, mamba_head_dim=3, n_groups=2,
                       ssm_state_size=5)


def test_params_pruning_and_tp_plan_derive_from_the_segments(monkeypatch):
    cfg = _mamba_cfg()
    nh, H, Im, GN = 4, 16, 12, 10
    sizes = layout.segment_sizes(cfg, "mamba_in_proj")
    assert list(sizes) == ["z", "x", "B", "C", "dt"] and list(sizes.values()) == [Im, Im, GN, GN, nh]
    keep = {"layers.0.mamba_heads": torch.tensor([0, 2])}
    base_total, base_idx = count_params(cfg)["total"], axis_index(cfg, keep, "mamba_in_proj", 0)
    mixer = HybridLM(cfg).layers[0].mixer
    from remodel.models.mamba import MAMBA
    plan = layer_plan(cfg, MAMBA, mixer, "layers.0.mixer.", {})
    assert plan["in_proj"].splits["weight"] == (0, [Im, Im, GN, GN, nh]) and plan["in_proj"].entry
    assert plan["conv1d"].splits["weight"] == (0, [Im, GN, GN])

    # one more in_proj segment in the table: every consumer follows
    extra = MAMBA.segments["mamba_in_proj"] + (("w", "mamba_heads"),)
    monkeypatch.setitem(MAMBA.segments, "mamba_in_proj", extra)
    assert count_params(cfg)["total"] == base_total + nh * H
    assert per_layer(cfg)["mamba"] == per_layer(cfg, layout.widths(cfg))["mamba"]
    idx = axis_index(cfg, keep, "mamba_in_proj", 0)
    assert idx.tolist() == base_idx.tolist() + [2 * Im + 2 * GN + nh + 0, 2 * Im + 2 * GN + nh + 2]
    assert dim_indices(cfg, keep, "layers.0.mixer.in_proj.weight")[0].tolist() == idx.tolist()
    assert layout.tp_split(cfg, ("mamba_in_proj", "hidden")) == (0, [Im, Im, GN, GN, nh, nh])


def test_the_in_proj_layout_is_written_once():
    """Its segment order is spelled only in the Mamba kind's module, models/mamba.py (code and docstrings)."""
    order = re.compile(r"\bz\W{1,4}x\W{1,4}B\W{1,4}C\W{1,4}dt\b|\[\s*Im\s*,\s*Im\s*,\s*GN")
    files = [p for d in PRODUCT for p in (ROOT / d).rglob("*.py")] + [ROOT / "cli.py"]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in files if p.name != "mamba.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if order.search(line)]
    assert not hits, hits
    assert order.search((ROOT / "models" / "mamba.py").read_text())


def test_one_width_vocabulary():
    """The pruner's targets, the search axes and the parameter-count axes are the registry's names."""
    from remodel.compress.prune import AXES as PRUNE_AXES
    from remodel.compress.search_space import WIDTHS as SEARCH
    from remodel.models.params import AXES as COUNT_AXES
    assert set(PRUNE_AXES) == set(kinds.PRUNABLE)
    assert set(SEARCH) <= set(kinds.WIDTHS) and set(COUNT_AXES) == set(kinds.WIDTHS)
    for name, w in {**PRUNE_AXES, **SEARCH}.items():
        assert w is kinds.WIDTHS[name]


def test_each_width_is_declared_once_by_its_kind():
    """kinds.WIDTHS is the trunk's widths plus every kind's own declarations, each under that kind's
    layer character; a kind reads every width it declares, and its config section holds the field."""
    from remodel.models.kinds import KINDS
    declared = {w.name: k for k in KINDS.values() for w in k.declares}
    assert list(kinds.WIDTHS) == [w.name for w in spec.TRUNK_WIDTHS] + list(declared)
    for name, k in declared.items():
        w = kinds.WIDTHS[name]
        assert w.layer == k.char and name in k.widths and w.field in k.config.names(), name


def test_width_registry_complete_whatever_is_imported_first():
    """Each kind enters its own widths as it is made (LayerKind.__post_init__): whichever module a process
    imports first (a kind's own, spec, the search space), the registry and widths(cfg) hold every kind's widths
    in one order (before, spec.widths() saw the trunk's two alone until models.kinds was imported)."""
    import subprocess
    import sys
    got = set()
    for first in ("remodel.models.spec", "remodel.models.gated_deltanet", "remodel.compress.search_space"):
        code = (f"import {first}; from remodel.models import spec; from remodel.models.kinds import WIDTHS; "
                "assert spec.WIDTHS is WIDTHS; print(list(WIDTHS), len(WIDTHS))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        got.add(out.stdout)
    assert got == {f"{list(kinds.WIDTHS)} {len(kinds.WIDTHS)}\n"}
    assert len(kinds.WIDTHS) == len(spec.TRUNK_WIDTHS) + sum(len(k.declares) for k in kinds.KINDS.values()) > 10
