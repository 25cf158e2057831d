import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from remodel.models.errors import RemodelError
from remodel.models.hf import config_from_hf, config_to_hf, default_family
from remodel.models.kinds import KINDS
from remodel.models.load import load_model, save_model
from remodel.models.model import HybridLM, init_weights
from remodel.models.params import AXES, closed_form, count_params, layer_params, memory_bytes
from remodel.pipelines.commands.inspection import format_inspect, inspect
from tests.conftest import hf_meta_model, tiny_configs

CONFIGS = Path(__file__).resolve().parents[1] / "models" / "configs"
PUBLISHED = {"nemotron-h-56b": 56.324, "nemotron-h-47b": 46.792, "nemotron-h-8b": 8.101,
             "nemotron-h-4b": 4.489, "nemotron-3-nano-30b-a3b": 31.578}


def numel(params) -> int:
    return sum(p.numel() for p in params)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_configs_match_transformers(name):
    d = json.loads((CONFIGS / f"{name}.json").read_text())
    cfg = config_from_hf(d)
    c = count_params(cfg)
    m = hf_meta_model(d)
    theirs = numel(m.parameters())
    print(f"{name}: ours {c['total']:,} transformers {theirs:,} active {c['active']:,}")
    assert c["total"] == theirs == c["hf_total"]
    assert round(c["total"] / 1e9, 3) == PUBLISHED[name]
    assert c["buffers"] == numel(b for n, b in m.named_buffers() if n.endswith("e_score_correction_bias"))
    cf = closed_form(cfg)  # the per-layer formulas agree type by type with the shape table
    assert {t: cf[t] for t in c["by_type"]} == c["by_type"]
    assert sum(c["by_type"].values()) == c["total"]
    # per-layer figures against transformers' own layers
    for i, ch in enumerate(cfg.pattern):
        if i == cfg.pattern.index(ch):
            assert layer_params(cfg, ch) == numel(m.model.layers[i].parameters()), (name, ch)
    if "E" not in cfg.pattern:
        assert c["active"] == c["total"] and c["routed"] == 0
        return
    # active: routed expert tensors of the meta model at k/E, everything else in full
    k, E = cfg.moe.num_experts_per_tok, cfg.moe.n_routed_experts
    routed = sum(p.numel() for n, p in m.named_parameters() if ".mixer.experts." in n)
    assert routed > 0 and routed % E == 0
    active = theirs - routed + routed * k // E
    print(f"{name}: active per token {active:,} ({active / 1e9:.3f}e9; without input embeddings "
          f"{(active - c['by_type']['embeddings']) / 1e9:.3f}e9)")
    assert c["active"] == active and c["routed"] == routed
    assert layer_params(cfg, "E", active=True) == numel(m.model.layers[1].parameters()) - routed // cfg.count("E") * (E - k) // E


@pytest.mark.parametrize("name", sorted(tiny_configs()))
def test_counts_match_our_model_and_transformers_export(name):
    cfg = tiny_configs()[name]
    c = count_params(cfg)
    with torch.device("meta"):
        model = HybridLM(cfg)
    assert c["total"] == numel(model.parameters())
    assert c["buffers"] == numel(b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    groups = {"embeddings": [model.embeddings], "lm_head": [model.lm_head] if model.lm_head is not None else [],
              "norms": [model.norm_f] + [blk.norm for blk in model.layers]}
    for ch, k in KINDS.items():  # every registered kind
        groups[k.name] = [blk.mixer for blk in model.layers if blk.kind == ch]
    assert c["by_type"] == {t: sum(numel(mod.parameters()) for mod in groups[t]) for t in c["by_type"]}
    cf = closed_form(cfg)
    assert {t: cf[t] for t in c["by_type"]} == c["by_type"] and cf["routed"] == c["routed"]
    for blk in model.layers:
        assert layer_params(cfg, blk.kind) == numel(blk.parameters())
    routed = sum(numel(mod.experts.parameters()) for mod in model.moe_layers())
    assert c["active"] == c["total"] - routed + routed * cfg.moe.num_experts_per_tok // max(cfg.moe.n_routed_experts, 1)
    # hf_total: what transformers builds from the exported config (size-1 shared expert included)
    family = default_family(cfg)
    theirs = numel(hf_meta_model(config_to_hf(cfg, family)).parameters())
    assert c["hf_total"] == theirs, (family, c["hf_total"], theirs)
    if name == "hybrid_noshared_latent_bias":
        assert c["hf_total"] == c["total"] + 2 * 2 * cfg.hidden_size  # two E layers, up [1,H] + down [H,1]


@pytest.mark.parametrize("name", ["hybrid_shared", "llama_tied_bias"])
def test_by_axis_marginals_are_exact(name):
    cfg = tiny_configs()[name]
    c = count_params(cfg, by_axis=True)
    steps = {"mamba_heads": cfg.mamba.n_groups, "attn_heads": cfg.attention.num_key_value_heads}
    if cfg.attention.rope_theta is not None:
        steps["head_dim"] = 2
    tested = set()
    for axis, v in c["by_axis"].items():
        step = steps.get(axis, 1)
        field = AXES[axis]
        if axis == "kv_heads":
            smaller = cfg.replace(num_key_value_heads=1, num_attention_heads=cfg.attention.num_attention_heads)
            step = cfg.attention.num_key_value_heads - 1
        else:
            smaller = cfg.replace(**{field: cfg.get(field) - step})
        assert count_params(smaller)["total"] == c["total"] - step * v["per_unit"], axis
        # params using the axis are exactly those that are linear in it: size * per_unit
        assert v["params"] == v["size"] * v["per_unit"], axis
        assert sum(v["by_type"].values()) == v["params"]
        tested.add(axis)
    want = {"vocab_size", "hidden_size", "attn_heads", "kv_heads", "head_dim", "ffn_size"}
    if "M" in cfg.pattern:
        want |= {"mamba_heads", "mamba_head_dim", "ssm_state_size", "experts", "expert_ffn_size", "shared_expert_size"}
    assert tested == want


def test_memory_matches_transformers_cache():
    d = dict(vocab_size=64, hidden_size=32, hybrid_override_pattern="M*-EM*", num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=4,
             n_groups=2, ssm_state_size=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
             moe_shared_expert_intermediate_size=16, chunk_size=16)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model("nemotron_h", **d)).to(torch.bfloat16).eval()
    cfg = config_from_hf({"model_type": "nemotron_h", **d})
    b, seq = 3, 7
    with torch.no_grad():
        cache = m(torch.randint(0, 64, (b, seq)), use_cache=True).past_key_values
    kv = conv = ssm = 0
    for layer in cache.layers:
        if hasattr(layer, "conv_states"):
            conv += sum(t.nbytes for t in layer.conv_states.values() if t is not None)
            ssm += sum(t.nbytes for t in layer.recurrent_states.values() if t is not None)
        elif getattr(layer, "keys", None) is not None and torch.is_tensor(layer.keys):
            kv += layer.keys.nbytes + layer.values.nbytes
    mem = memory_bytes(cfg, dtype_bytes=2, batch=b, seq_len=seq)
    assert (mem["kv_cache"], mem["mamba_conv_state"], mem["mamba_ssm_state"]) == (kv, conv, ssm)
    # the docstring's formulas, written out independently
    nM, nA = 2, 2
    assert kv == nA * 2 * b * seq * 2 * 8 * 2
    assert conv == nM * b * (8 * 4 + 2 * 2 * 8) * 4 * 2
    assert ssm == nM * b * 8 * 4 * 8 * 4
    assert mem["weights"] == 2 * sum(p.numel() for p in m.parameters()) + 4 * 8  # + fp32 router bias
    assert mem["total"] == mem["weights"] + kv + conv + ssm
    big = memory_bytes(cfg, batch=b, seq_len=2 * seq)
    assert big["kv_cache"] == 2 * kv and big["mamba_state"] == conv + ssm  # state does not grow with length


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    cfg = tiny_configs()["hybrid_shared"]
    model = init_weights(HybridLM(cfg), seed=0)
    return save_model(model, tmp_path_factory.mktemp("ckpt") / "m", dtype=torch.bfloat16)


def test_inspect_checkpoint(tiny_ckpt):
    d = inspect(tiny_ckpt)
    loaded = load_model(tiny_ckpt)
    p = d["params"]
    assert p["total"] == numel(loaded.parameters())
    assert p["total"] == count_params(loaded.cfg)["total"]
    assert d["pattern"] == "M*-EM-" and d["layers"] == {"mamba": 2, "attention": 1, "mlp": 2, "moe": 1}
    assert d["family"] == "nemotron_h" and d["architecture"] == "NemotronHForCausalLM"
    ck = d["checkpoint"]
    assert ck["tensor_numel"] == p["hf_total"] + p["buffers"]
    assert ck["tensor_bytes"] == d["memory_bf16"]["weights"]  # bf16 weights, fp32 router bias
    assert set(ck["dtype_bytes"]) == {"bfloat16", "float32"} and ck["dtype_bytes"]["float32"] == 4 * p["buffers"]
    assert ck["file_bytes"] > ck["tensor_bytes"]
    text = format_inspect(d)
    assert f"{p['total']:,}" in text and "bfloat16" in text and "M*-EM-" in text


def test_inspect_transformers_checkpoint(tmp_path):
    h = AutoConfig.for_model("nemotron_h", vocab_size=64, hidden_size=32, hybrid_override_pattern="M*-E",
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                             mamba_num_heads=8, mamba_head_dim=4, n_groups=2, ssm_state_size=8, n_routed_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                             chunk_size=16)
    m = AutoModelForCausalLM.from_config(h)
    m.save_pretrained(tmp_path)
    d = inspect(tmp_path)
    assert d["params"]["total"] == numel(m.parameters()) == numel(load_model(tmp_path).parameters())
    assert d["checkpoint"]["tensor_numel"] == numel(m.parameters()) + numel(m.buffers())
    assert d["checkpoint"]["dtype_bytes"] == {"float32": 4 * d["checkpoint"]["tensor_numel"]}


def test_inspect_config_only_and_names(tiny_ckpt, tmp_path):
    only = tmp_path / "cfg"
    only.mkdir()
    shutil.copy(tiny_ckpt / "config.json", only / "config.json")
    full = inspect(tiny_ckpt)
    for src in (only, only / "config.json", str(only / "config.json")):
        d = inspect(src)
        assert d["checkpoint"] is None and d["params"] == full["params"] and d["widths"] == full["widths"]
    assert "checkpoint" not in format_inspect(inspect(only)).splitlines()
    js = json.loads((CONFIGS / "nemotron-h-8b.json").read_text())
    theirs = numel(hf_meta_model(js).parameters())
    for src in ("nemotron-h-8b", "nemotron-h-8b.json", js, config_from_hf(js)):
        d = inspect(src)
        assert d["params"]["total"] == theirs
        assert d["memory_bf16"]["seq_len"] == 4096 and d["memory_bf16"]["batch"] == 1
        assert d["widths"]["hidden_size"] == 4096 and d["layers"]["mamba"] == 24


def test_inspect_bad_inputs(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "gpt2.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "empty").mkdir()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    cases = {tmp_path / "missing": "no such", tmp_path / "bad.json": "invalid JSON",
             tmp_path / "list.json": "JSON object", tmp_path / "gpt2.json": "gpt2",
             tmp_path / "empty": "config.json", tmp_path / "bin": "invalid JSON", "nemotron-h-9000b": "shipped"}
    for src, words in cases.items():
        with pytest.raises(RemodelError) as e:
            inspect(src)
        msg = str(e.value)
        assert words in msg and "\n" not in msg, (src, msg)


_UNIT = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}


def _printed_memory(text: str) -> dict:
    """{row: (bytes, half a printed unit)} of `remodel inspect`'s memory section, read back from the text."""
    rows, on = {}, False
    for line in text.splitlines():
        if line.startswith("memory at"):
            on = True
            continue
        if on and not line.startswith("  "):
            break
        if on:
            name, value, unit = line.strip().rsplit(maxsplit=2) if " " in line.strip() else (line, "0", "B")
            rows[name.strip()] = (float(value) * _UNIT[unit], 0.005 * _UNIT[unit] if unit != "B" else 0)
    return rows


@pytest.mark.parametrize("name", __import__("remodel.pipelines.commands.inspection",
                                            fromlist=["shipped_configs"]).shipped_configs())
def test_inspect_memory_rows_add_up_to_the_total(name):
    """Every kind's inference state has its own printed row (GDN's too), and weights + the rows printed
    equal the printed total within the printed rounding (qwen3.5-35b-a3b once printed 64.56 GiB + 80 MiB
    as 64.70 GiB: its GDN state had no row)."""
    from remodel.pipelines.commands.inspection import format_inspect, inspect
    d = inspect(name)
    m = d["memory_bf16"]
    assert "" not in m["state_rows"] and m["weights"] + sum(m["state_rows"].values()) == m["total"]
    rows = _printed_memory(format_inspect(d))
    total, slack = rows.pop("total")
    parts = [k for k in rows if "not in total" not in k]
    assert set(parts) == {"weights", *m["state_rows"]}
    assert abs(sum(rows[k][0] for k in parts) - total) <= slack + sum(rows[k][1] for k in parts)
