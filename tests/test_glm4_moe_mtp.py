"""glm4_moe's MTP layer (issue 56 Deliver 2, GLM-4.5 / 4.6 / 4.7): the decoder layer at index num_hidden_layers
(`model.layers.{L}.eh_proj` / `enorm` / `hnorm` / `shared_head.norm` + one attention and one MoE layer), which
transformers skips on load, is read into our MTP head, written back under the same names (convert byte-identical),
and pruned with the trunk: the output's MTP tensors equal the source's sliced by the pruning's own keep indices,
and transformers reloads the output with the in-memory pruning's trunk logits."""
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from remodel.cli import main
from remodel.compress.baselines import random_scores
from remodel.compress.prune import plan_keep, prune_model
from remodel.compress.scores import save_scores
from remodel.models.families import FAMILIES
from remodel.models.hf import config_from_hf, config_to_hf
from remodel.models.load import load_model, read_config_dict, save_model
from tests.conftest import random_model

HF = dict(FAMILIES["glm4_moe"].tiny["grouped"], model_type="glm4_moe", num_nextn_predict_layers=1)
CFG = config_from_hf(HF)  # 3 decoder layers (the first dense) + one MTP layer, HF index 3
IDS = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(2))
TARGETS = dict(hidden_size=24, attn_heads=2, experts=6, expert_ffn_size=8)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _tensors(d):
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("glm_mtp") / "src"
    save_model(random_model(CFG, seed=1, mtp=True), d, family="glm4_moe")
    return d


def test_the_mtp_layer_is_read_under_vllms_names(ckpt):
    """One MTP step '*E' at HF index 3, named as vLLM's glm4_moe_mtp reads it; the config says so; a checkpoint
    without those tensors (transformers' own save) loads with the head off."""
    from transformers import AutoModelForCausalLM
    assert (CFG.mtp_layers, CFG.mtp_pattern, CFG.pattern) == (1, "*E", "*-*E*E")
    t = _tensors(ckpt)
    mtp = sorted(k for k in t if k.startswith("model.layers.3."))
    for k in ("eh_proj", "enorm", "hnorm", "shared_head.norm", "input_layernorm", "post_attention_layernorm",
              "self_attn.q_proj", "self_attn.q_norm", "mlp.gate", "mlp.experts.7.down_proj", "mlp.shared_experts.up_proj"):
        assert f"model.layers.3.{k}.weight" in mtp, k
    assert len(mtp) == 4 + 2 + 9 + 2 + 8 * 3 + 3 and read_config_dict(ckpt)["num_nextn_predict_layers"] == 1
    src, ours = random_model(CFG, seed=1, mtp=True), load_model(ckpt)  # the model the fixture saved, and its reload
    a, f = src.mtp.layers
    for mine, name in ((a.enorm, "enorm"), (a.hnorm, "hnorm"), (a.eh_proj, "eh_proj"), (a.norm, "input_layernorm"),
                       (a.mixer.q_proj, "self_attn.q_proj"), (f.norm, "post_attention_layernorm"),
                       (f.final_layernorm, "shared_head.norm"), (f.mixer.gate, "mlp.gate")):
        assert mine.weight.equal(t[f"model.layers.3.{name}.weight"]), name  # vLLM's glm4_moe_mtp names
    assert f.mixer.experts.down_proj[7].equal(t["model.layers.3.mlp.experts.7.down_proj.weight"])
    sd = ours.state_dict()
    assert all(v.equal(src.state_dict()[k]) for k, v in sd.items() if k.startswith("mtp."))  # read back whole
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()  # skips model.layers.3.*
    with torch.no_grad():
        assert (hf(IDS).logits - ours(IDS)).abs().max().item() <= 1e-4
    hf.save_pretrained(ckpt.parent / "hf")
    assert load_model(ckpt.parent / "hf").cfg.mtp_layers == 0  # declared, absent: off
    assert config_to_hf(CFG, "glm4_moe")["num_nextn_predict_layers"] == 1


def test_convert_keeps_the_mtp_layer_byte_identical(ckpt, tmp_path):
    assert main(["convert", str(ckpt), str(tmp_path / "out")]) == 0
    a, b = _tensors(ckpt), _tensors(tmp_path / "out")
    assert sorted(a) == sorted(b) and sum(k.startswith("model.layers.3.") for k in a) == 44
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].view(torch.uint8).equal(b[k].view(torch.uint8)), k
    assert read_config_dict(tmp_path / "out")["num_nextn_predict_layers"] == 1


def _sliced_reference(src: dict, keep: dict, cfg) -> dict:
    """The source's MTP tensors cut by the keep indices: hidden everywhere, query heads, experts and their FFN."""
    h, p = keep["hidden"], "model.layers.3."
    heads = keep["mtp.layers.0.attn_heads"]
    q = torch.cat([torch.arange(i * 8, (i + 1) * 8) for i in heads.tolist()])
    out = {p + n: src[p + n][h] for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                                          "input_layernorm.weight", "post_attention_layernorm.weight")}
    out[p + "eh_proj.weight"] = src[p + "eh_proj.weight"][h][:, torch.cat([h, cfg.hidden_size + h])]
    out[p + "self_attn.q_proj.weight"] = src[p + "self_attn.q_proj.weight"][q][:, h]
    out[p + "self_attn.q_proj.bias"] = src[p + "self_attn.q_proj.bias"][q]
    out[p + "self_attn.o_proj.weight"] = src[p + "self_attn.o_proj.weight"][h][:, q]
    out[p + "self_attn.k_proj.weight"] = src[p + "self_attn.k_proj.weight"][:, h]
    e = keep["mtp.layers.1.experts"]
    out[p + "mlp.gate.weight"] = src[p + "mlp.gate.weight"][e][:, h]
    out[p + "mlp.gate.e_score_correction_bias"] = src[p + "mlp.gate.e_score_correction_bias"][e]
    for r, old in enumerate(e.tolist()):
        f = keep["mtp.layers.1.expert_ffn"][r]
        for n in ("up_proj", "gate_proj"):
            out[f"{p}mlp.experts.{r}.{n}.weight"] = src[f"{p}mlp.experts.{old}.{n}.weight"][f][:, h]
        out[f"{p}mlp.experts.{r}.down_proj.weight"] = src[f"{p}mlp.experts.{old}.down_proj.weight"][h][:, f]
    out[p + "mlp.shared_experts.down_proj.weight"] = src[p + "mlp.shared_experts.down_proj.weight"][h]
    return out


def test_prune_cuts_the_mtp_layer_with_the_trunk(ckpt, tmp_path):
    """CLI prune on hidden, heads, experts and expert FFN: every MTP tensor of the output is the source's sliced
    by the keep indices (the MTP head's own: its units scored apart); transformers reloads the trunk with the
    in-memory pruning's logits, and our reload has its MTP logits."""
    from transformers import AutoModelForCausalLM
    scores = random_scores(CFG, seed=5)
    scores["mtp.layers.1.experts"] = torch.arange(8.0)  # the head's own expert scores: the top 3 of each group of 4
    save_scores(tmp_path / "scores", scores, {"config": CFG.to_dict()})
    out = tmp_path / "pruned"
    assert main(["prune", str(ckpt), str(out), "--scores", str(tmp_path / "scores"), "--hidden-size", "24",
                 "--attn-heads", "2", "--experts", "6", "--expert-ffn-size", "8"]) == 0
    keep = plan_keep(CFG, scores, TARGETS)
    assert keep["mtp.layers.1.experts"].tolist() == [1, 2, 3, 5, 6, 7] != keep["layers.5.experts"].tolist()
    got, want = _tensors(out), _sliced_reference(_tensors(ckpt), keep, CFG)
    assert "model.layers.3.mlp.experts.6.up_proj.weight" not in got
    for k, v in want.items():
        assert got[k].equal(v), k
    assert read_config_dict(out)["num_nextn_predict_layers"] == 1
    mem, ours = prune_model(load_model(ckpt), keep), load_model(out)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (hf(IDS).logits - mem(IDS)).abs().max().item() <= 1e-4
        m_ours, m_mem = ours.forward_mtp(IDS)[1][0], mem.forward_mtp(IDS)[1][0]
    assert (m_ours - m_mem).abs().max().item() <= 1e-5
    out = tmp_path / "depth"  # decoder layer 1 dropped: the MTP layer follows the trunk's last one (index 2)
    assert main(["prune", str(ckpt), str(out), "--scores", str(tmp_path / "scores"), "--drop-layers", "1"]) == 0
    got, src = _tensors(out), _tensors(ckpt)
    assert read_config_dict(out)["num_hidden_layers"] == 2 and not any(k.startswith("model.layers.3.") for k in got)
    assert all(got[k.replace(".3.", ".2.", 1)].equal(v) for k, v in src.items() if k.startswith("model.layers.3."))


def test_the_mtp_layer_is_scored_from_its_own_activations(ckpt):
    """score reads the MTP layer too: whole-model and streaming scoring (one layer at a time from the checkpoint)
    give the head its own scores, equal with right padding; its expert frequencies count its own routed tokens."""
    from remodel.compress.importance import score_model
    from remodel.compress.streaming import score_streaming
    mask = torch.ones_like(IDS)
    mask[1, 8:] = 0
    whole, _ = score_model(load_model(ckpt), [IDS], [mask], loss_increase=False)
    stream, _ = score_streaming(ckpt, [IDS], [mask], loss_increase=False)
    mtp = sorted(k for k in whole if k.startswith("mtp."))
    assert {"mtp.layers.0.attn", "mtp.layers.1.experts", "mtp.layers.1.expert_ffn"} <= set(mtp)
    assert sorted(whole) == sorted(stream) and all(torch.allclose(whole[k], stream[k], rtol=1e-5) for k in whole)
    assert whole["mtp.layers.1.expert_frequency"].sum() == (10 + 7) * 2  # rows whose two tokens are real, top-2
