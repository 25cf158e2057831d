"""`remodel hybridize` streams (issue 57): the hybrid is written from the source checkpoint a layer at a time
(upcycle.hybridize_stream), tensor for tensor the checkpoint the in-memory conversion (hybridize_model on the
model held whole, save_model) writes, for every mixer, both inits, a tied source and a MoE one; each replaced
layer's fresh init draws from its own generator (layer_seed); peak memory stays well below the checkpoint's."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import remodel.models
from remodel.cli import main
from remodel.models.checkpoint import CheckpointReader
from remodel.models.load import load_model, read_config_dict, save_model
from remodel.upcycle import hybridize as H
from tests.conftest import HYBRID_SOURCE, hf_pair
from tests.rss import PEAK_RSS

ROOT = str(Path(remodel.models.__file__).parents[2])  # where the child imports this remodel from
SOURCES = {"llama": ("llama", HYBRID_SOURCE),
           "llama_tied": ("llama", dict(HYBRID_SOURCE, tie_word_embeddings=True)),
           "mixtral": ("mixtral", dict(HYBRID_SOURCE, num_local_experts=4, num_experts_per_tok=2,
                                       sliding_window=None))}
CASES = [("llama", "mamba2", ["--keep-layers", "1"]),  # bamba: kept heads widened 8 -> 16
         ("llama", "gdn", ["--keep-layers", "1"]),  # qwen3_5_text: zero-centred norms, output gate, q/k norms
         ("llama_tied", "kda", ["--keep-attention", "0"]),  # kimi_linear: tied, lm_head written as a copy
         ("mixtral", "mamba2", ["--keep-layers", "2"]),  # granitemoehybrid: the MoE copied, a zero shared MLP
         ("llama_bf16", "mamba2", ["--keep-layers", "1"])]  # computed in float32 (as loaded), written in bfloat16


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("hyb_stream")
    out = {n: hf_pair(t, root, n, 5, **kw)[2] for n, (t, kw) in SOURCES.items()}
    out["llama_bf16"] = save_model(load_model(out["llama"]), root / "llama_bf16", family="llama",
                                   aux_from=out["llama"], dtype=torch.bfloat16)
    return out


def _in_memory(src: Path, out: Path, mixer: str, flags: list, init: str, seed: int) -> set:
    """The conversion as it was before streaming: the model loaded whole, hybridize_model, save_model in the
    checkpoint's dtype; -> the replaced layers."""
    model = load_model(src)
    layers = H.replaceable(model.cfg, mixer)
    keep = H.kept(len(layers), keep_layers=[int(flags[1])]) if flags[0] == "--keep-layers" else \
        H.kept(len(layers), keep_attention=int(flags[1]))
    replaced = {i for j, i in enumerate(layers) if j not in keep}
    family, new_cfg = H.target(model.cfg, mixer, replaced, None)
    config = read_config_dict(src)
    dtype = getattr(torch, config.get("dtype") or config["torch_dtype"])
    save_model(H.hybridize_model(model, new_cfg, mixer, replaced, init, seed), out, family=family, aux_from=src,
               dtype=dtype)
    return replaced


@pytest.mark.parametrize("init", H.INITS)
@pytest.mark.parametrize("name,mixer,flags", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_streamed_is_the_in_memory_conversion(sources, tmp_path, name, mixer, flags, init):
    """The CLI (streamed) writes the in-memory conversion's checkpoint: the same names, dtypes, values, config."""
    src = sources[name]
    assert main(["hybridize", str(src), str(tmp_path / "s"), "--mixer", mixer, *flags, "--init", init,
                 "--seed", "4"]) == 0
    replaced = _in_memory(src, tmp_path / "m", mixer, flags, init, 4)
    assert replaced and (name == "llama_tied" or len(replaced) < 4)  # something replaced, something kept
    assert read_config_dict(src)["dtype"] == ("bfloat16" if name.endswith("bf16") else "float32")
    s, m = CheckpointReader(tmp_path / "s"), CheckpointReader(tmp_path / "m")
    assert sorted(s.keys()) == sorted(m.keys())
    differ = [k for k in m.keys() if s.dtype(k) != m.dtype(k) or not torch.equal(s.get(k), m.get(k))]
    assert not differ, differ[:5]
    assert s.config == m.config


def test_a_layers_fresh_init_is_its_own(sources):
    """The rule both paths follow: a replaced layer's fresh mixer is fresh_mixer(new_cfg, i, seed), drawn from
    layer_seed(seed, i) alone: the same whichever other layers are replaced, different per layer and per seed."""
    src = load_model(sources["llama"])
    att = H.replaceable(src.cfg, "gdn")  # our layer indices of the attention layers
    i, others = att[2], {att[0], att[3]}
    _, one = H.target(src.cfg, "gdn", {i}, None)
    _, three = H.target(src.cfg, "gdn", {i} | others, None)
    a = H.hybridize_model(src, one, "gdn", {i}, "random", seed=4).state_dict()
    b = H.hybridize_model(src, three, "gdn", {i} | others, "random", seed=4).state_dict()
    fresh, pre = H.fresh_mixer(three, i, 4), f"layers.{i}.mixer."
    layer = [k for k in a if k.startswith(pre)]
    assert len(layer) == len(fresh) and all(torch.equal(a[k], b[k]) and torch.equal(a[k], fresh[k.removeprefix(pre)])
                                            for k in layer)
    w = "mixer.in_proj_q.weight"
    assert not torch.equal(b[f"layers.{att[0]}.{w}"], b[f"layers.{i}.{w}"])
    assert not torch.equal(H.fresh_mixer(three, i, 5)["in_proj_q.weight"], fresh["in_proj_q.weight"])


WIDE = dict(vocab_size=2048, hidden_size=1024, num_hidden_layers=8, intermediate_size=2816, num_attention_heads=16,
            num_key_value_heads=4, head_dim=64)
MEMORY_SCRIPT = PEAK_RSS + """
import sys
from remodel.cli import main

tiny, big, out = sys.argv[1:4]
assert main(['hybridize', tiny, out + '.tiny', '--keep-layers', '1']) == 0  # every import and lazy init first
base = reset_peak()  # the warm-up's own peak is not the conversion's
assert main(['hybridize', big, out, '--keep-layers', '1']) == 0
print(base, status('VmHWM'))
"""


def _write_llama(path: Path, **fields):
    """A Llama checkpoint of random weights written tensor by tensor (never the whole model in memory)."""
    from remodel.models.checkpoint import CheckpointWriter
    from remodel.models.hf import config_from_hf, config_to_hf, our_shapes
    from remodel.models.load import iter_hf_tensors
    cfg = config_from_hf({"model_type": "llama", "torch_dtype": "float32", "tie_word_embeddings": False, **fields})
    shapes, g = our_shapes(cfg), torch.Generator().manual_seed(0)
    w = CheckpointWriter(path, max_shard_bytes=64 * 1024**2)
    for name, t in iter_hf_tensors(lambda n: torch.randn(shapes[n], generator=g) * 0.02, cfg, "llama"):
        w.add(name, t)
    w.close({**config_to_hf(cfg, "llama"), "torch_dtype": "float32"})


def test_hybridize_memory_is_bounded(tmp_path):
    """The conversion holds a few layers, not the model: the process's peak RSS grows by well under half the
    checkpoint's size (the in-memory conversion held the source and the hybrid whole: over twice its size)."""
    mb = 1024**2
    big, tiny, out = tmp_path / "wide", tmp_path / "tiny", tmp_path / "hybrid"
    try:
        _write_llama(big, **WIDE)
        _write_llama(tiny, **HYBRID_SOURCE)
        ckpt_bytes = CheckpointReader(big).total_bytes()
        assert ckpt_bytes >= 300 * mb
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
        res = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tiny), str(big), str(out)], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300, env=env)
        assert res.returncode == 0, res.stderr[-3000:]
        base, peak = map(int, res.stdout.split()[-2:])
        growth, cap = peak - base, ckpt_bytes // 2
        print(f"checkpoint {ckpt_bytes / mb:.0f} MiB, baseline RSS {base / mb:.0f} MiB, peak RSS {peak / mb:.0f} MiB, "
              f"growth {growth / mb:.1f} MiB, cap {cap / mb:.0f} MiB")
        assert growth < cap
        r = CheckpointReader(out)
        assert r.config["model_type"] == "bamba" and r.total_bytes() > ckpt_bytes // 2
    finally:
        for d in (big, tiny, out, Path(f"{out}.tiny")):
            shutil.rmtree(d, ignore_errors=True)


def test_streamed_refuses_a_tensor_nothing_gives(sources, tmp_path, monkeypatch, capsys):
    """A mixer init that forgets one of its tensors is refused in one line naming it, nothing written: the
    streamed writer never zero-fills a tensor no conversion step gave."""
    m = H.MIXERS["gdn"]
    monkeypatch.setitem(H.MIXERS, "gdn", m._replace(init=lambda cfg, att, fresh: {
        k: v for k, v in m.init(cfg, att, fresh).items() if k != "A_log"}))
    assert main(["hybridize", str(sources["llama"]), str(tmp_path / "out"), "--mixer", "gdn",
                 "--keep-layers", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mixer.A_log" in err and "nothing gives" in err, err
    assert not (tmp_path / "out").exists()
