"""Qwen3.5 and Qwen3.5-MoE as released (transformers' ForConditionalGeneration, a vision tower beside the text
model: models/families/qwen3_5_vision.py), by the CLI alone as a new user runs it: inspect counts the tower as
transformers does, convert is byte-identical both ways, score -> prune of a Gated DeltaNet width and the FFN
writes a checkpoint transformers reloads with the tower byte-identical and the text logits of the in-memory
pruning, eval reads the text model, and --hidden-size (the merger projects into it) is refused in one line."""
import json
import shutil

import pytest
import torch

from remodel import cli
from remodel.compress.prune import plan_keep, prune_model
from remodel.compress.scores import load_scores
from remodel.models.checkpoint import CheckpointReader
from remodel.models.families import FAMILIES
from remodel.models.load import load_model
from remodel.pipelines.commands.inspection import inspect
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path
from tests.conftest import randomise

TOWER = "model.visual."
# per family: the pruning flags (a GDN width and the FFN) and the pruned config's fields they set
PRUNE = {"qwen3_5": ({"linear_value_heads": 2, "ffn_size": 24}, ("linear_num_value_heads", "intermediate_size")),
         "qwen3_5_moe": ({"linear_value_heads": 2, "expert_ffn_size": 8},
                         ("linear_num_value_heads", "moe_intermediate_size"))}


def _hf_model(family: str):
    from transformers import AutoConfig, AutoModelForImageTextToText
    tiny = FAMILIES[family].tiny["plain"]
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, text_config=dict(tiny["text_config"], vocab_size=2048),
                               vision_config=tiny["vision_config"])
    return randomise(AutoModelForImageTextToText.from_config(cfg).float().eval(), seed=1)


@pytest.fixture(scope="module", params=sorted(PRUNE))
def vl(request, tmp_path_factory):
    """(family, transformers' model, its save_pretrained with the tokenizer) of a tiny released-layout checkpoint."""
    hf = _hf_model(request.param)
    d = tmp_path_factory.mktemp(request.param) / "model"
    hf.save_pretrained(d)
    for f in embedded_tokenizer_path().iterdir():
        shutil.copy(f, d / f.name)
    return request.param, hf, d


def _tensors(path, prefix="") -> dict:
    """{name: (dtype, shape, raw bytes)} of a checkpoint's tensors under `prefix`."""
    with CheckpointReader(path) as r:
        return {k: (r.dtype(k), r.shape(k), r.get(k).reshape(-1).view(torch.uint8).numpy().tobytes())
                for k in r.keys() if k.startswith(prefix)}


def test_inspect_counts_the_tower_and_convert_is_byte_identical(vl, tmp_path, capsys):
    family, hf, d = vl
    got = inspect(d)["params"]
    tower = sum(p.numel() for n, p in hf.named_parameters() if n.startswith(TOWER))
    assert got["passthrough"] == tower > 0 and got["hf_total"] == sum(p.numel() for p in hf.parameters())
    assert got["total"] == got["hf_total"] - tower  # the text model alone, as Qwen3_5(Moe)ForCausalLM counts it
    assert cli.main(["inspect", str(d)]) == 0
    assert f"tower (passed through) {tower:,}" in " ".join(capsys.readouterr().out.split())
    assert cli.main(["convert", str(d), str(tmp_path / "a")]) == 0
    assert cli.main(["convert", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    src = _tensors(d)
    assert _tensors(tmp_path / "a") == src and _tensors(tmp_path / "b") == src  # every tensor, the tower too
    a, b = (json.loads((tmp_path / x / "config.json").read_text()) for x in "ab")
    assert a == b and a["architectures"] == [type(hf).__name__] and a["vision_config"]["out_hidden_size"] == 32


def test_cli_prunes_every_axis_but_hidden_and_keeps_the_tower(vl, tmp_path, capsys):
    from transformers import AutoModelForImageTextToText
    family, hf, d = vl
    data, scores = str(embedded_corpus()[1]), tmp_path / "s"
    assert cli.main(["score", str(d), "--data", data, "--out", str(scores), "--samples", "4", "--seq-len", "16",
                     "--no-loss-increase"]) == 0
    targets, fields = PRUNE[family]
    out = tmp_path / "pruned"
    flags = [x for k, v in targets.items() for x in ("--" + k.replace("_", "-"), str(v))]
    assert cli.main(["prune", str(d), str(out), "--scores", str(scores)] + flags) == 0
    assert cli.main(["eval", str(out), "--data", data, "--seq-len", "16", "--max-tokens", "64"]) == 0
    pruned = AutoModelForImageTextToText.from_pretrained(out).float().eval()
    assert type(pruned) is type(hf)
    assert tuple(getattr(pruned.config.text_config, f) for f in fields) == tuple(targets.values())
    assert _tensors(out, TOWER) == _tensors(d, TOWER)  # the tower and its merger, byte for byte
    ours = load_model(d)
    want_model = prune_model(ours, plan_keep(ours.cfg, load_scores(scores)[0], targets))
    x = torch.randint(0, 2048, (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = pruned(input_ids=x).logits, want_model(x)
    assert (got - want).abs().max() <= 1e-4
    # the hidden size: one line naming why, nothing written
    capsys.readouterr()
    assert cli.main(["prune", str(d), str(tmp_path / "bad"), "--scores", str(scores), "--hidden-size", "24"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "merger" in err and "hidden_size must stay 32" in err, err
    assert not (tmp_path / "bad").exists()


def test_upcycle_into_the_moe_family_keeps_the_tower(vl, tmp_path):
    """Dense Qwen3.5 -> Qwen3.5-MoE (--exact): transformers reloads it as the MoE ForConditionalGeneration with
    the dense text logits and the tower byte-identical; an MoE source is refused in one line."""
    from transformers import AutoModelForImageTextToText
    family, hf, d = vl
    flags = ["--experts", "4", "--granularity", "1", "--top-k", "2", "--exact"]
    if FAMILIES[family].moe:
        assert cli.main(["upcycle", str(d), str(tmp_path / "up")] + flags) == 2
        assert not (tmp_path / "up").exists()
        return
    assert cli.main(["upcycle", str(d), str(tmp_path / "up")] + flags) == 0
    moe = AutoModelForImageTextToText.from_pretrained(tmp_path / "up").float().eval()
    assert type(moe).__name__ == FAMILIES[FAMILIES[family].upcycles_to].arch
    assert _tensors(tmp_path / "up", TOWER) == _tensors(d, TOWER)
    x = torch.randint(0, 2048, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (moe(input_ids=x).logits - hf(input_ids=x).logits).abs().max() <= 1e-5


def test_text_model_export_and_refusals(vl, tmp_path, capsys):
    """--to the text family writes the text model alone (transformers' CausalLM reloads it with the same
    logits); a text checkpoint cannot become the tower family (no tower to carry) and plan holds the hidden
    size: each refusal one line, nothing written."""
    from transformers import AutoModelForCausalLM
    family, hf, d = vl
    text = FAMILIES[family].text.name
    assert cli.main(["convert", str(d), str(tmp_path / "t"), "--to", text]) == 0
    assert not any(k.startswith(TOWER) for k in _tensors(tmp_path / "t"))
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "t").float().eval()
    x = torch.randint(0, 2048, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (lm(x).logits - hf(input_ids=x).logits).abs().max() <= 1e-5
    capsys.readouterr()
    assert cli.main(["convert", str(tmp_path / "t"), str(tmp_path / "back"), "--to", family]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "vision tower this model was not read with" in err, err
    assert not (tmp_path / "back").exists()
    assert cli.main(["plan", str(d), "--params", str(sum(p.numel() for p in lm.parameters()) * 9 // 10)]) in (0, 2)
    assert "hidden" not in capsys.readouterr().out.split("space:")[-1].split("\n")[0]  # held: one value, not searched
