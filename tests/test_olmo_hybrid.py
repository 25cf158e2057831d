"""OLMo-hybrid's variants against transformers' own OlmoHybridForCausalLM, in memory (its runtime tensor names):
the GDN delta_rule variant (beta doubled, the gated norm's own eps), the attention's q/k norms over all heads
(qk_norm_full) and the post-norm kinds 'A' / '=' (norm after the mixer); a checkpoint transformers saved
(three conv tensors) pruned by the CLI. The checkpoint round trips are the family suite's (tests/test_families.py)."""
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


def _checkpoint_tensors(hf):
    """transformers' in-memory weights under the checkpoint's names: its norms renamed, its one conv1d over
    [q | k | v] split into q_conv1d, k_conv1d, v_conv1d (what save_pretrained writes)."""
    c = hf.config
    qk, v = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    for n, t in hf.state_dict().items():
        for a, b in RUNTIME.items():
            n = n.replace(f".{a}.", f".{b}.")
        if n.endswith("linear_attn.conv1d.weight"):
            yield from zip([n.replace(".conv1d", f".{x}_conv1d") for x in "qkv"], t.split([qk, qk, v]))
        else:
            yield n, t


def _ours(hf, cfg):
    """Our model holding transformers' in-memory weights (their names as the checkpoint spells them)."""
    sd = {from_hf_name(cfg, "olmo_hybrid", n)[0]: t for n, t in _checkpoint_tensors(hf)}
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
    assert cfg.gated_deltanet.linear_allow_neg_eigval == hc.linear_allow_neg_eigval and cfg.gated_deltanet.linear_norm_eps == 1e-5
    assert set(cfg.pattern[0::2]) == {"D", "A"} and cfg.attention.qk_norm_full
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


SMALLER = {"attn_heads": 2, "hidden_size": 24, "ffn_size": 32}  # pruning targets of the plain tiny case


@pytest.mark.parametrize("axis", ["attn_heads", "hidden_size", "ffn_size", "all"])
def test_pruned_equals_masked_in_memory(axis):
    """Width pruning of the post-norm layers and the all-heads q norm (tests/kinds/attention.py's qk_norm_full
    masking: the dropped heads' queries zeroed, the norm's mean over the kept heads), float64."""
    import copy

    from remodel.compress.baselines import random_scores
    from remodel.compress.prune import plan_keep, prune_model
    from tests.masking import masked_reference

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
    keep = plan_keep(cfg, random_scores(cfg, seed=3), {n: SMALLER[n] for n in names})
    x = torch.randint(0, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b, full = prune_model(model, keep)(x), masked_reference(model, keep)(x), model(x)
    assert (a - b).abs().max().item() <= 1e-10
    assert (a - full).abs().max().item() > 1e-2


def test_cli_prunes_a_checkpoint_transformers_saved(tmp_path, capsys):
    """transformers' own save_pretrained checkpoint (its conv as q_conv1d, k_conv1d, v_conv1d) through the CLI:
    score, prune two Gated DeltaNet widths (the q/k and v convs then differ in size), transformers reloading
    the pruned checkpoint with the in-memory pruning's logits; upcycling refused in one line, nothing written."""
    import shutil

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from remodel import cli
    from remodel.compress.prune import plan_keep, prune_model
    from remodel.compress.scores import load_scores
    from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path
    from tests.conftest import hf_pair
    _, ours, d = hf_pair("olmo_hybrid", tmp_path, "src", 5, **dict(OLMO_HYBRID.tiny["plain"], vocab_size=2048))
    for f in embedded_tokenizer_path().iterdir():
        shutil.copy(f, d / f.name)
    with safe_open(d / "model.safetensors", "pt") as f:
        convs = sorted(k.rsplit(".", 2)[-2] for k in f.keys() if k.startswith("model.layers.0.linear_attn.")
                       and "conv" in k)
    assert convs == ["k_conv1d", "q_conv1d", "v_conv1d"]
    data, s, out = str(embedded_corpus()[1]), str(tmp_path / "s"), tmp_path / "pruned"
    assert cli.main(["score", str(d), "--data", data, "--out", s, "--samples", "4", "--seq-len", "16"]) == 0
    targets = {"linear_value_heads": 2, "linear_key_head_dim": 8}
    assert cli.main(["prune", str(d), str(out), "--scores", s, "--linear-value-heads", "2",
                     "--linear-key-head-dim", "8"]) == 0
    pruned = AutoModelForCausalLM.from_pretrained(out).float().eval()
    with safe_open(out / "model.safetensors", "pt") as f:
        sizes = [f.get_slice(f"model.layers.0.linear_attn.{c}.weight").get_shape()[0] for c in convs]
    assert sizes == [16, 16, 12]  # k, q: 2 key heads x 8; v: 2 value heads x 6
    want_model = prune_model(ours, plan_keep(ours.cfg, load_scores(s)[0], targets))
    x = torch.randint(0, 2048, (2, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = pruned(x).logits, want_model(x)
    assert (got - want).abs().max() <= 1e-4 and (want - ours(x)).abs().max() > 1e-2
    capsys.readouterr()
    assert cli.main(["upcycle", str(d), str(tmp_path / "up"), "--experts", "4", "--granularity", "1", "--top-k", "2",
                     "--exact"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1 and not (tmp_path / "up").exists()


def test_transformers_chunked_conv_is_read(tmp_path):
    """Where the q/k and v convs differ in size, transformers' save_pretrained writes three equal chunks of its
    conv under q_conv1d / k_conv1d / v_conv1d: remodel reads our convs from their concatenation (our logits are
    transformers'), and convert writes the q, k, v convs themselves, which transformers reloads alike."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from remodel import cli
    from remodel.models.load import load_model
    torch.manual_seed(0)
    hc = transformers.OlmoHybridConfig(**dict(OLMO_HYBRID.tiny["plain"], linear_key_head_dim=8))  # 16, 16, 24
    hf = transformers.OlmoHybridForCausalLM(hc).float().eval()
    hf.save_pretrained(tmp_path / "src")
    conv = "model.layers.0.linear_attn.{}_conv1d.weight"
    with safe_open(tmp_path / "src" / "model.safetensors", "pt") as f:
        assert [f.get_slice(conv.format(x)).get_shape()[0] for x in "qkv"] == [19, 19, 18]  # torch.chunk's
    assert cli.main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "olmo_hybrid"]) == 0
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert [f.get_slice(conv.format(x)).get_shape()[0] for x in "qkv"] == [16, 16, 24]
    x = torch.randint(0, hc.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x).logits
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()(x).logits
        ours = load_model(tmp_path / "src")(x)
    assert (back - want).abs().max() <= 1e-6 * want.abs().max() and (ours - want).abs().max() <= 1e-4
    # sharded loading reads regions of the stored tensors as they lie: the chunked layout refused in one line
    from remodel.models.regions import RegionReader
    with pytest.raises(RemodelError, match="remodel convert"):
        RegionReader(tmp_path / "src")
    name = "layers.0.mixer.k_conv1d.weight"
    region = RegionReader(tmp_path / "out").read(name, [torch.tensor([3, 4, 9]), None, None])
    assert torch.equal(region, load_model(tmp_path / "out").state_dict()[name][[3, 4, 9]])
