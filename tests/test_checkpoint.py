import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from remodel.models.checkpoint import CheckpointReader, CheckpointWriter, atomic_output_dir, copy_checkpoint, read_header
from remodel.models.errors import RemodelError
from tests.rss import PEAK_RSS

REPO = Path(__file__).resolve().parents[1]
CONFIG = {"model_type": "llama", "hidden_size": 16}


def random_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.int64] * 3):
        shape = (7 + i, 33) if i % 2 else (129,)
        if dtype == torch.int64:
            out[f"layers.{i}.idx"] = torch.randint(-2**40, 2**40, shape, generator=g)
        else:
            out[f"layers.{i}.w"] = torch.randn(shape, generator=g).to(dtype)
    out["scalar"] = torch.tensor(3.5)
    out["empty"] = torch.zeros(0, 4)
    return out


def write(out_dir, tensors, max_shard_bytes=2 * 1024**3, config=CONFIG):
    w = CheckpointWriter(out_dir, max_shard_bytes)
    for k, v in tensors.items():
        w.add(k, v)
    w.close(config)
    return Path(out_dir)


def test_round_trip_sharded(tmp_path):
    tensors = random_tensors()
    total = sum(t.nbytes for t in tensors.values())
    ckpt = write(tmp_path / "ck", tensors, max_shard_bytes=total // 4)
    shards = sorted(ckpt.glob("*.safetensors"))
    assert len(shards) >= 3 and not list(ckpt.glob("*.tmp"))
    n = len(shards)
    assert [s.name for s in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == set(tensors)
    loaded = {}
    for s in shards:
        loaded.update(load_file(s))
    assert set(loaded) == set(tensors)

    r = CheckpointReader(ckpt)
    assert r.keys() == sorted(tensors) and r.config == CONFIG
    assert r.total_bytes() == total
    for k, t in tensors.items():
        assert k in r and r.shape(k) == tuple(t.shape) and r.dtype(k) == t.dtype and r.nbytes(k) == t.nbytes
        got = r.get(k)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k
        assert torch.equal(loaded[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k
    assert "nope" not in r
    r.close()

    single = write(tmp_path / "one", tensors)  # everything fits: one model.safetensors, no index
    assert sorted(p.name for p in single.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(CheckpointReader(single).get("layers.0.w"), tensors["layers.0.w"])


def test_writer_rejects_duplicates_and_writes_values_at_add(tmp_path):
    w = CheckpointWriter(tmp_path / "w", max_shard_bytes=1000)
    big = torch.arange(1000.0)
    w.add("a", big[:10])  # a view of a 4000-byte base, 40 bytes: written now, base not kept
    w.add("odd", big[10:13])  # 12 bytes: held until the shard ends, so it must be a copy
    with pytest.raises(RemodelError, match="duplicate"):
        w.add("a", torch.zeros(2))
    w.add("b", big[:10])  # same storage twice
    big.fill_(-1.0)  # later in-place changes must not reach the file
    assert [t.untyped_storage().nbytes() for t in w._held.values()] == [12]
    w.close(CONFIG)
    r = CheckpointReader(tmp_path / "w")
    assert r.nbytes("a") == 40 and torch.equal(r.get("b"), torch.arange(10.0))
    assert torch.equal(r.get("a"), torch.arange(10.0)) and torch.equal(r.get("odd"), torch.arange(10.0, 13.0))


def test_writer_large_shard_keeps_header_reservation_and_splits_on_header(tmp_path):
    """A shard not compacted keeps the header space reserved at its start (padded with spaces);
    a shard whose header would outgrow the reservation closes early. Both load in safetensors."""
    import remodel.models.checkpoint as C
    from safetensors.torch import load_file

    old = C.COMPACT_WASTE
    C.COMPACT_WASTE = 1e9  # never compact
    try:
        tensors = {f"t{i:03d}.weight": torch.full((2, 4), float(i)) for i in range(200)}
        w = CheckpointWriter(tmp_path / "w", max_shard_bytes=10**9)
        w._reserve = 4096  # ~60 entries per shard
        for k, v in tensors.items():
            w.add(k, v)
        w.close(CONFIG)
    finally:
        C.COMPACT_WASTE = old
    shards = sorted((tmp_path / "w").glob("*.safetensors"))
    assert len(shards) >= 3  # split by the header budget, not by bytes (6.4 KB of data)
    loaded = {}
    for f in shards:
        n = int.from_bytes(f.read_bytes()[:8], "little")
        assert n == 4096 and f.read_bytes()[8 + n - 1:8 + n] == b" "
        loaded.update(load_file(f))
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_writer_output_is_what_safetensors_writes(tmp_path):
    """Our serialiser against the safetensors library on mixed dtypes and odd sizes: same tensors, and
    every tensor aligned to its element size in the file (data laid out by descending item size)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = random_tensors(1)
    tensors["odd"] = torch.ones(3, dtype=torch.bfloat16)  # 6 bytes between wider tensors if unsorted
    tensors["after"] = torch.ones(5, dtype=torch.float64)
    ours = write(tmp_path / "ours", tensors) / "model.safetensors"
    save_file(tensors, tmp_path / "lib.safetensors", metadata={"format": "pt"})
    with safe_open(ours, "pt") as a, safe_open(tmp_path / "lib.safetensors", "pt") as b:
        assert a.metadata() == b.metadata() == {"format": "pt"} and set(a.keys()) == set(b.keys()) == set(tensors)
        for k in tensors:
            x, y = a.get_tensor(k), b.get_tensor(k)
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), k
    start, header = read_header(ours)
    assert start % 8 == 0
    for k, e in header.items():
        assert e["data_offsets"][0] % tensors[k].element_size() == 0, k


def test_transformers_interop(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=32, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    src, out = tmp_path / "src", tmp_path / "out"
    model.save_pretrained(src, max_shard_size="20KB")
    (src / "tokenizer_config.json").write_text("{}")
    assert (src / "model.safetensors.index.json").exists()
    assert len(list(src.glob("*.safetensors"))) >= 2

    copy_checkpoint(src, out, max_shard_bytes=16 * 1024)
    assert (out / "model.safetensors.index.json").exists() and (out / "tokenizer_config.json").exists()
    assert len(list(out.glob("*.safetensors"))) >= 2
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 5, 9, 33, 2, 63, 0, 17]])
    with torch.no_grad():
        a, b = model(ids).logits, loaded(ids).logits
    assert torch.equal(a, b)


MEMORY_SCRIPT = PEAK_RSS + """
import re, sys, torch
from remodel.models.checkpoint import copy_checkpoint
base = reset_peak()
copy_checkpoint(sys.argv[1], sys.argv[2], max_shard_bytes=int(sys.argv[3]))
print(base, status("VmHWM"))
"""


def test_copy_memory_is_bounded(tmp_path):
    mb = 1024**2
    src, out = tmp_path / "big", tmp_path / "big_copy"
    try:
        w = CheckpointWriter(src, max_shard_bytes=50 * mb)
        for i in range(52):  # 52 x 8 MiB = 416 MiB
            w.add(f"layers.{i}.weight", torch.full((2048, 1024), float(i)))
        w.close(CONFIG)
        ckpt_bytes = CheckpointReader(src).total_bytes()
        assert ckpt_bytes >= 400 * mb and len(list(src.glob("*.safetensors"))) >= 8

        res = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(src), str(out), str(50 * mb)],
                             cwd=REPO, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        assert res.returncode == 0, res.stderr
        base, peak = map(int, res.stdout.split())
        growth, cap = peak - base, ckpt_bytes // 4
        print(f"checkpoint {ckpt_bytes / mb:.0f} MiB, baseline RSS {base / mb:.0f} MiB, "
              f"peak RSS {peak / mb:.0f} MiB, growth {growth / mb:.1f} MiB, cap {cap / mb:.0f} MiB")
        assert growth < cap

        r = CheckpointReader(out)
        assert r.total_bytes() == ckpt_bytes and len(r) == 52
        assert torch.equal(r.get("layers.37.weight"), torch.full((2048, 1024), 37.0))
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture
def small_ckpt(tmp_path):
    tensors = {f"t{i}": torch.randn(64, 16) for i in range(6)}
    return write(tmp_path / "ck", tensors, max_shard_bytes=2 * 64 * 16 * 4)


def corrupt_header(d):
    shard = sorted(d.glob("*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.write(b"\xde\xad\xbe\xef garbage!")
    return shard.name


def truncate(d):
    shard = sorted(d.glob("*.safetensors"))[1]
    os.truncate(shard, shard.stat().st_size - 100)
    return shard.name


def missing_shard(d):
    shard = sorted(d.glob("*.safetensors"))[-1]
    shard.unlink()
    return shard.name


def missing_key(d):
    p = d / "model.safetensors.index.json"
    index = json.loads(p.read_text())
    index["weight_map"]["ghost"] = sorted(index["weight_map"].values())[0]
    p.write_text(json.dumps(index))
    return "ghost"


def pickle_only(d):
    for p in d.iterdir():
        p.unlink()
    (d / "config.json").write_text(json.dumps(CONFIG))
    (d / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really")
    return "pickle"


def edit_config(text):
    def f(d):
        (d / "config.json").write_text(text)
        return "config.json"
    return f


@pytest.mark.parametrize("breakage, words", [
    (lambda d: shutil.rmtree(d) or str(d), "does not exist"),
    (lambda d: (d / "config.json").unlink() or "config.json", "not found"),
    (edit_config('{"hidden_size": 16}'), "model_type"),
    (edit_config('{"model_type": "llama",'), "invalid JSON"),
    (edit_config('[1, 2]'), "JSON object"),
    (missing_shard, "does not exist"),
    (missing_key, "missing from the shard"),
    (corrupt_header, "corrupt"),
    (truncate, "truncated"),
    (pickle_only, "pytorch_model.bin"),
], ids=["no_dir", "no_config", "no_model_type", "bad_json", "config_not_object", "missing_shard",
        "missing_key", "corrupt_header", "truncated", "pickle_only"])
def test_malformed_inputs(small_ckpt, breakage, words):
    CheckpointReader(small_ckpt)  # fine before the breakage
    named = breakage(small_ckpt)
    with pytest.raises(RemodelError) as e:
        CheckpointReader(small_ckpt)
    msg = str(e.value)
    assert "\n" not in msg and words in msg and named in msg, msg


def test_atomic_output_dir(tmp_path, small_ckpt):
    out = tmp_path / "out"
    with pytest.raises(ValueError):
        with atomic_output_dir(out) as tmp:
            (tmp / "partial.safetensors").write_bytes(b"x" * 100)
            raise ValueError("boom")
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]

    with atomic_output_dir(out) as tmp:
        assert tmp.parent.parent == out.parent and tmp.parent.name.startswith(".out.tmp-")  # in a marked sibling
        (tmp / "a.txt").write_text("new")
    assert (out / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out"]

    with pytest.raises(RemodelError, match="not empty") as e:
        with atomic_output_dir(out):
            pass
    assert "\n" not in str(e.value) and str(out) in str(e.value)
    assert (out / "a.txt").read_text() == "new"

    with pytest.raises(RuntimeError):  # failed overwrite keeps the old output
        with atomic_output_dir(out, overwrite=True) as tmp:
            raise RuntimeError
    assert (out / "a.txt").read_text() == "new"

    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "b.txt").write_text("newer")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out"]

    for bad in [small_ckpt, small_ckpt / "sub", tmp_path]:  # equal to, inside, containing an input
        with pytest.raises(RemodelError, match="overlaps input"):
            with atomic_output_dir(bad, overwrite=True, inputs=[small_ckpt]):
                pass
    with pytest.raises(RemodelError, match="overlaps input"):
        copy_checkpoint(small_ckpt, small_ckpt / "copy")
    assert CheckpointReader(small_ckpt).keys() == [f"t{i}" for i in range(6)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out"]
