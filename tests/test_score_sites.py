"""Where Mamba-2 heads are read (issue 55): the default at out_proj's input (the gated norm's output), and
`score --method activation_in`, the former site (in_proj's x segment), everything else as the default."""
import pytest
import torch
import torch.nn.functional as F

from remodel.compress.importance import score_model
from remodel.compress.scores import load_scores
from remodel.pipelines.commands.score import score
from remodel.pipelines.data.data import embedded_corpus
from tests.score_helpers import NEMO, agg, hf_dir, make_model, out_proj_input, rand_ids, rel  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@torch.no_grad()
def direct_mamba_x(model, batches, at_in_proj):
    """{layers.i.mamba_x: sqrt(sum over batches of agg(X)) * ||out_proj[:, c]||} with X the out_proj input or
    the x segment of in_proj's output, computed from the layers' own inputs (no hooks)."""
    cfg, acc = model.cfg, {}
    for ids in batches:
        _, states = model(ids, output_hidden_states=True)
        for i, layer in enumerate(model.layers):
            if layer.kind == "M":
                n, mix, Im = layer.norm(states[i]), layer.mixer, cfg.mamba_inner
                x = F.linear(n, mix.in_proj.weight)[..., Im:2 * Im] if at_in_proj else out_proj_input(mix, n)
                acc[f"layers.{i}.mamba_x"] = acc.get(f"layers.{i}.mamba_x", 0) + agg(x)
    shape = (cfg.mamba.mamba_num_heads, cfg.mamba.mamba_head_dim)
    return {k: (v.sqrt() * model.layers[int(k.split(".")[1])].mixer.out_proj.weight.double().norm(dim=0)).view(shape)
            for k, v in acc.items()}


def test_mamba_heads_default_and_activation_in_sites():
    cfg = NEMO.replace(pattern="M*M-")
    model = make_model(cfg, seed=2)
    batches = [rand_ids(cfg, 3, 16, s) for s in range(2)]
    default, _ = score_model(model, batches, loss_increase=False)
    old, _ = score_model(model, batches, loss_increase=False, in_sites=True)
    for at_in_proj, got in ((False, default), (True, old)):
        want = direct_mamba_x(model, batches, at_in_proj)
        assert set(want) == {"layers.0.mamba_x", "layers.2.mamba_x"}
        for k in want:
            assert rel(got[k].double(), want[k]) < 1e-5, (at_in_proj, k)
    assert default.keys() == old.keys()
    for k in default:  # only the Mamba heads' site moves
        assert torch.equal(default[k], old[k]) != k.endswith("mamba_x"), k
        if k.endswith("mamba_x"):
            assert rel(default[k].double(), old[k].double()) > 0.05


def test_score_method_activation_in(hf_dir, tmp_path):
    """The CLI method: whole and streamed runs give the in_proj site's mamba_x, every other tensor as activation."""
    data, kw = embedded_corpus()[1], dict(samples=4, seq_len=16, batch=2, progress=False)
    score(hf_dir, data, tmp_path / "act", mode="whole", **kw)
    rep = score(hf_dir, data, tmp_path / "in", method="activation_in", mode="whole", **kw)
    score(hf_dir, data, tmp_path / "in_stream", method="activation_in", mode="streaming", **kw)
    (act, _), (old, meta), (stream, _) = (load_scores(tmp_path / d) for d in ("act", "in", "in_stream"))
    assert rep["method"] == meta["method"] == "activation_in" and act.keys() == old.keys() == stream.keys()
    for k in act:
        assert torch.equal(act[k], old[k]) != (k == "layers.0.mamba_x"), k
        assert rel(stream[k].double(), old[k].double()) < 1e-5, k
    assert rel(act["layers.0.mamba_x"].double(), old["layers.0.mamba_x"].double()) > 0.05
