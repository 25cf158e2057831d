"""`remodel convert` end to end through the CLI: round trips, bad input, bounded memory."""
import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from remodel.models.checkpoint import CheckpointWriter
from remodel.models.config import ModelConfig
from remodel.models.hf import config_to_hf
from remodel.models.load import save_model
from remodel.models.model import HybridLM, init_weights
from tests.conftest import assert_same_tensors

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, check=True, fresh=False):
    """`remodel ARGS` -> (returncode, stderr), run by cli.main in this process (no ~5 s of imports per call),
    or with `fresh` as a new `python cli.py` process: where stderr must be exactly one line, so that an
    import-time warning or a traceback would show as well."""
    if fresh:
        r = subprocess.run([sys.executable, str(ROOT / "cli.py"), *map(str, args)], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)
        code, err = r.returncode, r.stderr
    else:
        from remodel.cli import main
        err_io = io.StringIO()
        with contextlib.redirect_stderr(err_io), contextlib.redirect_stdout(io.StringIO()):
            code = main([str(a) for a in args])
        err = err_io.getvalue()
    if check and code != 0:
        raise AssertionError(err)
    return SimpleNamespace(returncode=code, stderr=err)


def tiny_hybrid(**kw):
    base = dict(vocab_size=96, hidden_size=32, pattern="M*-E", num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=4, n_groups=2,
                ssm_state_size=8, chunk_size=16, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16, moe_shared_expert_intermediate_size=16)
    base.update(kw)
    return init_weights(HybridLM(ModelConfig(**base)), seed=0)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("src") / "hybrid"
    save_model(tiny_hybrid(), d, family="nemotron_h", max_shard_bytes=20_000)
    (d / "tokenizer.json").write_text("{}")  # aux files travel with the checkpoint
    return d


def test_roundtrip_identical_and_loads_in_transformers(hybrid_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    cli("convert", hybrid_dir, out)
    assert_same_tensors(hybrid_dir, out)
    assert (out / "tokenizer.json").exists() and (out / "remodel_report.json").exists()
    assert len(list(out.glob("model-*.safetensors"))) > 1  # sharded like the input
    ids = torch.randint(0, 96, (2, 21))
    m1 = AutoModelForCausalLM.from_pretrained(hybrid_dir).eval()
    m2 = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(m1(ids).logits, m2(ids).logits)


def test_llama_to_mixtral_family_refused_and_qwen_export(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=40)).eval()
    m.save_pretrained(tmp_path / "src")
    r = cli("convert", tmp_path / "src", tmp_path / "bad", "--to", "mixtral", check=False, fresh=True)
    assert r.returncode != 0 and "layer pattern" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()
    cli("convert", tmp_path / "src", tmp_path / "mistral", "--to", "mistral")
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path / "mistral").eval()
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        assert (m(ids).logits - m2(ids).logits).abs().max() <= 1e-5


def _broken(src, tmp_path, how):
    import shutil

    d = tmp_path / how
    shutil.copytree(src, d)
    shards = sorted(d.glob("model-*.safetensors"))
    if how == "missing_config":
        (d / "config.json").unlink()
    elif how == "missing_shard":
        shards[-1].unlink()
    elif how == "corrupt_header":
        with open(shards[0], "r+b") as f:
            f.write(b"\xff" * 16)
    elif how == "unknown_model_type":
        c = json.loads((d / "config.json").read_text())
        c["model_type"] = "gpt_neo_x9"
        (d / "config.json").write_text(json.dumps(c))
    elif how == "shape_mismatch":
        c = json.loads((d / "config.json").read_text())
        c["intermediate_size"] = 64
        (d / "config.json").write_text(json.dumps(c))
    return d


@pytest.mark.parametrize("how,needle", [("missing_config", "config.json"), ("missing_shard", "model-"),
                                        ("corrupt_header", "header"), ("unknown_model_type", "gpt_neo_x9"),
                                        ("shape_mismatch", "shape")])
def test_malformed_inputs_one_line_error_nothing_written(hybrid_dir, tmp_path, how, needle):
    d = _broken(hybrid_dir, tmp_path, how)
    out = tmp_path / "out"
    before = sorted(os.listdir(tmp_path))
    r = cli("convert", d, out, check=False, fresh=True)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert sorted(os.listdir(tmp_path)) == before  # no output, no temporary sibling left behind


def test_refuses_non_empty_out_and_writing_into_model(hybrid_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    r = cli("convert", hybrid_dir, out, check=False)
    assert r.returncode != 0 and "not empty" in r.stderr and (out / "keep.txt").read_text() == "x"
    r = cli("convert", hybrid_dir, hybrid_dir / "inside", check=False)
    assert r.returncode != 0 and not (hybrid_dir / "inside").exists()


def test_conversion_memory_bounded(tmp_path):
    """A sharded nemotron_h checkpoint 4x+ larger than the memory cap converts under the cap."""
    cfg = ModelConfig(vocab_size=4096, hidden_size=512, pattern="M-E*" * 6, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64, intermediate_size=2048, mamba_num_heads=16,
                      mamba_head_dim=64, n_groups=2, ssm_state_size=64, n_routed_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=1024, moe_shared_expert_intermediate_size=1024)
    src = tmp_path / "big"
    from remodel.models.load import iter_hf_tensors
    from remodel.models.hf import our_shapes

    shapes = our_shapes(cfg)
    g = torch.Generator().manual_seed(0)
    w = CheckpointWriter(src, max_shard_bytes=32 << 20)
    for name, t in iter_hf_tensors(lambda n: torch.randn(shapes[n], generator=g) * 0.02, cfg, "nemotron_h"):
        w.add(name, t)
    w.close(config_to_hf(cfg, "nemotron_h"))
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    cap = size // 4
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        from remodel.pipelines.commands.convert import convert
        import transformers  # imported before the baseline: its import cost is not the conversion's
        from remodel.models.hf import config_from_hf
        def rss(field):
            for line in open('/proc/self/status'):
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        base = rss('VmRSS:')
        open('/proc/self/clear_refs', 'w').write('5')
        convert({str(src)!r}, {str(tmp_path / 'out')!r}, max_shard_bytes=32 << 20)
        print(rss('VmHWM:') - base)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    growth = int(r.stdout.strip().splitlines()[-1])
    print(f"checkpoint {size / 2**20:.0f} MiB, cap {cap / 2**20:.0f} MiB, peak growth {growth / 2**20:.0f} MiB")
    assert size >= 4 * cap and growth < cap
    assert_same_tensors(src, tmp_path / "out")
