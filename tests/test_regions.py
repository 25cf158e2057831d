"""models/regions.py RegionReader (the sharded loader's reads, issue 27 Deliver 3) against safetensors' own
slicing: random regions (random kept indices per dimension: runs, gaps, whole dimensions) of every tensor
of a sharded checkpoint in fp32, bf16 and fp8, fused experts included, equal what `safe_open(...).get_slice`
gives for the same indices, converted to fp32 exactly as the loader does."""
import json

import pytest
import torch
from safetensors import safe_open

from remodel.models.hf import weight_table
from remodel.models.load import save_model
from remodel.models.regions import RegionReader
from tests.conftest import FAMILY_CONFIGS, random_model

DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn]


@pytest.fixture(scope="module", params=DTYPES, ids=lambda t: str(t).split(".")[-1])
def ckpt(request, tmp_path_factory):
    """A nemotron_h (M, *, -, E with a shared expert) checkpoint in several shards of `dtype`."""
    d = tmp_path_factory.mktemp("regions") / "m"
    save_model(random_model(FAMILY_CONFIGS["nemotron_h"]), d, dtype=request.param, max_shard_bytes=4000)
    files = sorted(set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert len(files) > 3  # really sharded
    return d, request.param


def _file_of(d, hf):
    return d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][hf]


def _safetensors_region(d, hf, idx):
    """safetensors' own slicing: the bounding box by get_slice, then the kept indices within it."""
    with safe_open(_file_of(d, hf), "pt") as f:
        box = f.get_slice(hf)[tuple(slice(int(i.min()), int(i.max()) + 1) for i in idx)]
    for dim, i in enumerate(idx):
        box = box.index_select(dim, i - i.min())
    return box.float()


def _random_index(shape, g):
    """Per dimension: all of it (None), or a random sorted subset (with runs and gaps)."""
    out = []
    for n in shape:
        if torch.rand((), generator=g) < 0.3:
            out.append(None)
        else:
            keep = torch.rand(n, generator=g) < 0.6
            keep[torch.randint(n, (), generator=g)] = True
            out.append(torch.nonzero(keep).flatten())
    return out


def test_random_regions_equal_safetensors_slicing(ckpt):
    d, dtype = ckpt
    reader = RegionReader(d)
    rows = {}
    for ours, hf, e in weight_table(reader.cfg, reader.family):
        rows.setdefault(ours, []).append((hf, e))
    g = torch.Generator().manual_seed(0)
    checked = 0
    for ours, hf_rows in rows.items():
        shape = reader.shapes[ours]
        for _ in range(4):
            index = _random_index(shape, g)
            got = reader.read(ours, index)
            full = [torch.arange(n) if i is None else i for n, i in zip(shape, index)]
            if hf_rows[0][1] is None:  # one HF tensor
                want = _safetensors_region(d, hf_rows[0][0], full)
            else:  # fused experts [E, ...]: one HF tensor per expert
                want = torch.stack([_safetensors_region(d, hf_rows[e][0], full[1:]) for e in full[0].tolist()])
            assert got.dtype == torch.float32 and got.shape == want.shape, ours
            assert torch.equal(got, want), (ours, dtype)
            checked += 1
    assert checked == 4 * len(rows) and any(e is not None for r in rows.values() for _, e in r)
    reader.close()
