"""Activation recomputation (models.recompute): same losses and gradients as without it, same parameter
names, and less memory saved for backward (full < selective < none), on small fp32 hybrids."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from remodel.models.errors import RemodelError
from remodel.models.recompute import RECOMPUTE_MODES, set_recompute
from tests.conftest import recompute_batch as batch, recompute_build as build, recompute_step as step

def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name,mask", [("nemotron", False), ("nemotron", True), ("llama_moe", False)])
def test_losses_and_gradients_match(name, mask):
    model = build(name)
    ids, am = batch(mask=mask)
    names = list(dict(model.named_parameters()))
    loss0, g0 = step(model, ids, am)
    for mode in ("selective", "full", "none"):
        set_recompute(model, mode)
        assert list(dict(model.named_parameters())) == names
        assert list(model.state_dict()) == list(build(name).state_dict())
        loss, g = step(model, ids, am)
        assert _rel(loss, loss0) <= 1e-6, mode
        for n in names:
            assert _rel(g[n], g0[n]) <= 1e-6, (mode, n)


def test_whole_tensor_mamba_path(monkeypatch):
    """The mixer's CUDA path (separate conv, scan and norm; `_on_gpu` forced on CPU) recomputes exactly too."""
    from remodel.models import mamba
    monkeypatch.setattr(mamba, "_on_gpu", lambda t: True)
    model = build("nemotron")
    ids, am = batch(mask=True)
    loss0, g0 = step(model, ids, am)
    for mode in ("selective", "full"):
        set_recompute(model, mode)
        loss, g = step(model, ids, am)
        assert _rel(loss, loss0) <= 1e-6 and all(_rel(g[n], g0[n]) <= 1e-6 for n in g0), mode


def test_bad_mode_and_undo():
    model = build("nemotron")
    with pytest.raises(RemodelError, match="recompute"):
        set_recompute(model, "everything")
    set_recompute(model, "full")
    twin = copy.deepcopy(model)  # the mode is data on the block: a copy keeps it
    assert all(b.recompute for b in twin.layers) and all(b.recompute for b in model.layers)
    set_recompute(model, "none")
    assert not any(b.recompute for b in model.layers)
    assert all("forward" not in m.__dict__ for m in model.modules())  # nothing rebound on an instance
    assert not any(getattr(m, "recompute_core", False) for m in model.modules())
    set_recompute(model, "selective")
    assert sum(getattr(m, "recompute_core", False) for m in model.modules()) >= 5
    with torch.no_grad():  # evaluation under no_grad runs plainly in every mode
        model(batch()[0])


def saved_bytes(model, ids, am=None):
    """Bytes of the distinct storages autograd keeps for backward during one forward (checkpointed
    regions show only their inputs), the measure recomputation must lower."""
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids, attention_mask=am)
    logits.sum().backward()
    return sum(seen.values())


def test_recompute_saves_less_memory():
    model = build("nemotron")
    ids, _ = batch()
    got = {}
    for mode in RECOMPUTE_MODES:
        set_recompute(model, mode)
        got[mode] = saved_bytes(model, ids)
    assert got["full"] * 2 < got["selective"] < got["none"] * 0.8, got


FSDP_SCRIPT = r"""
import json, sys, tempfile
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from remodel.models.recompute import set_recompute
from tests.conftest import recompute_batch as batch, recompute_build as build, recompute_step as step
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
ids, am = batch(mask=True)
loss0, g0 = step(build("nemotron"), ids, am)
out = {}
for mode in ("selective", "full"):
    model = set_recompute(build("nemotron"), mode)  # as torchtitan: recomputation first, then FSDP2 per block
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    loss, g = step(model, ids, am)
    g = {n: t.full_tensor() for n, t in g.items()}
    out[mode] = [abs(loss.item() / loss0.item() - 1), sorted(g) == sorted(g0),
                 max(((g[n] - g0[n]).norm() / g0[n].norm().clamp_min(1e-30)).item() for n in g0)]
print("RESULT", json.dumps(out))
dist.destroy_process_group()
"""


def test_composes_with_fsdp2():
    """Recomputation applied before FSDP2's per-Block fully_shard (1-rank gloo mesh, own process):
    same loss, same parameter names, same gradients."""
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", FSDP_SCRIPT], cwd=root, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(root)})
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-2000:]
    for mode, (dloss, same_names, dgrad) in json.loads(line[0][7:]).items():
        assert dloss <= 1e-6 and same_names and dgrad <= 1e-6, mode


def test_trainer_applies_the_flag_by_saved_bytes(tmp_path):
    """--recompute through `remodel train` (train(), one process, one step): the bytes autograd saves for
    backward over the whole run fall with the mode, full < selective < none, as set_recompute makes them
    on the bare model. Equal losses alone would pass a trainer that ignored the flag; these bytes would not."""
    import gzip
    from remodel.models.config import ModelConfig
    from remodel.models.model import HybridLM, init_weights
    from remodel.pipelines.data.data import embedded_corpus
    from remodel.pipelines.training.train import train
    from tests.conftest import write_checkpoint
    cfg = ModelConfig(vocab_size=2048, hidden_size=32, pattern="M*-E", tie_word_embeddings=True, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=8,
                      ssm_state_size=8, chunk_size=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    write_checkpoint(init_weights(HybridLM(cfg), seed=0), tmp_path / "student")
    with gzip.open(embedded_corpus()[0], "rt", encoding="utf-8") as f:
        (tmp_path / "train.txt").write_text("\n".join(f.read().splitlines()[:300]) + "\n")
    got = {}
    for mode in RECOMPUTE_MODES:
        kept = {}  # storages kept alive, so a freed address cannot be reused and hide a saved tensor

        def pack(t):
            s = t.untyped_storage()
            kept[s.data_ptr()] = s
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            train(tmp_path / "student", tmp_path / mode, tmp_path / "train.txt", steps=1, seq_len=64, batch=2,
                  warmup=1, log_every=0, checkpoint_every=1, recompute=mode)
        got[mode] = sum(s.nbytes() for s in kept.values())
    bare = HybridLM(cfg)
    ids = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    alone = {mode: saved_bytes(set_recompute(bare, mode), ids) for mode in RECOMPUTE_MODES}
    print("saved bytes through the trainer:", got, "on the bare model:", alone)
    assert got["full"] < got["selective"] < got["none"], got
    for mode in ("selective", "full"):  # the trainer saves what the mode saves on the bare model (the loss's
        # logits, the same in every mode, are most of the total here, so the savings are compared)
        assert abs((got["none"] - got[mode]) / (alone["none"] - alone[mode]) - 1) < 0.05, (mode, got, alone)
