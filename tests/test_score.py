"""Activation-importance scoring: hooks against direct computation, padding, streaming == whole model,
bounded memory on a checkpoint larger than the cap, depth scores, and the `score` pipeline."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from remodel.compress.importance import Scorer, score_model
from remodel.compress.streaming import Streaming, score_streaming
from remodel.compress.scores import load_scores
from remodel.models.attention import rope_inv_freq, rotate_half
from remodel.models.checkpoint import CheckpointReader, CheckpointWriter
from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.hf import config_to_hf, our_shapes, weight_table
from remodel.models.load import load_model, save_model
from remodel.models.mlp import ACT
from remodel.models.model import HybridLM
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path
from remodel.pipelines.commands.score import choose_mode, score
from tests.conftest import random_model
from tests.rss import PEAK_RSS
from tests.score_helpers import NEMO, agg, hf_dir, make_model, out_proj_input, rand_ids, rel  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]
GATED = ModelConfig(vocab_size=64, hidden_size=32, pattern="*E*E", num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, rope_theta=10000.0, tie_word_embeddings=True, mlp_act="silu", mlp_gated=True,
                    n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, router="softmax")
CFGS = {"nemotron": NEMO, "gated_tied": GATED, "latent_moe": NEMO.replace(pattern="E*E", moe_latent_size=20)}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---- an independent computation of every score ----------------------------------------------

def ffn_hidden(x, up, gate, act):
    return act(F.linear(x, gate)) * F.linear(x, up) if gate is not None else act(F.linear(x, up))


def attention_inputs(mix, cfg, n):
    b, l, _ = n.shape
    nq, nkv, hd = cfg.attention.num_attention_heads, cfg.attention.num_key_value_heads, cfg.attention.head_dim
    q = F.linear(n, mix.q_proj.weight).view(b, l, nq, hd).transpose(1, 2)
    k = F.linear(n, mix.k_proj.weight).view(b, l, nkv, hd).transpose(1, 2)
    v = F.linear(n, mix.v_proj.weight).view(b, l, nkv, hd).transpose(1, 2)
    if cfg.attention.rope_theta is not None:
        f = torch.arange(l).float()[:, None] * rope_inv_freq(cfg)
        cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    s = s.masked_fill(~torch.ones(l, l, dtype=torch.bool).tril(), float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2).reshape(b, l, nq * hd)


def route(moe, cfg, x):
    logits = x @ moe.gate.weight.T
    k = cfg.moe.num_experts_per_tok
    if cfg.moe.router == "sigmoid":
        s = logits.sigmoid()
        idx = (s + moe.gate.e_score_correction_bias).topk(k, -1)[1]
        w = s.gather(1, idx)
    else:
        w, idx = logits.softmax(-1).topk(k, -1)
    if cfg.moe.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return w * cfg.moe.routed_scaling_factor, idx


def brute_elimination(moe, cfg, x, y):
    """Greedy elimination recomputing every candidate's routed output from scratch (expert_select's
    removal costs are incremental): x [T, H] router input, y [T, E, D] every expert's output."""
    logits = (x @ moe.gate.weight.T).double()
    sig = cfg.moe.router == "sigmoid"
    w = logits.sigmoid() if sig else logits.softmax(-1)
    c = w + moe.gate.e_score_correction_bias.double() if sig else w
    E, k = cfg.moe.n_routed_experts, cfg.moe.num_experts_per_tok

    def out(alive):
        t = torch.arange(len(w))[:, None]
        idx = c[:, alive].topk(min(k, len(alive)), -1)[1]
        ids, wk = torch.tensor(alive)[idx], w[:, alive][t, idx]
        wk = wk / wk.sum(-1, keepdim=True) if cfg.moe.norm_topk_prob else wk
        return (wk[..., None] * y.double()[t, ids]).sum(1)

    alive, order, full = list(range(E)), torch.empty(E), out(list(range(E)))
    for step in range(E - 1):
        err = {e: (out([a for a in alive if a != e]) - full).square().sum().item() for e in alive}
        gone = min(err, key=err.get)
        alive.remove(gone)
        order[gone] = step
    order[alive] = E - 1
    return order


@torch.no_grad()
def direct_scores(model, batches):
    cfg, acc = model.cfg, {}
    act = ACT[cfg.mlp.mlp_act]

    def add(k, v):
        acc[k] = acc[k] + v if k in acc else v

    for ids in batches:
        _, states = model(ids, output_hidden_states=True)
        b, l = ids.shape
        for i, layer in enumerate(model.layers):
            p, mix = f"layers.{i}.", layer.mixer
            n = layer.norm(states[i])
            add(f"site{i}", agg(n))
            cos = F.cosine_similarity(states[i].double(), states[i + 1].double(), dim=-1)
            add(p + "cos", torch.stack([cos.sum(), torch.tensor(float(cos.numel()), dtype=torch.float64)]))
            if layer.kind == "-":
                add(p + "ffn", agg(ffn_hidden(n, mix.up_proj.weight, getattr(mix.gate_proj, "weight", None), act)))
            elif layer.kind == "*":
                add(p + "attn", agg(attention_inputs(mix, cfg, n)))
            elif layer.kind == "M":
                add(p + "mamba_x", agg(out_proj_input(mix, n)))
            else:
                x = n.reshape(b * l, -1)
                w, idx = route(mix, cfg, x)
                if cfg.moe.moe_latent_size:  # experts read and write the latent space
                    x = F.linear(x, mix.fc1_latent_proj.weight)
                ex, E = mix.experts, cfg.moe.n_routed_experts
                acc.setdefault(p + "recon_x", []).append(n.reshape(b * l, -1))
                acc.setdefault(p + "recon_y", []).append(torch.stack([ex.expert(e, x) for e in range(E)], 1))
                ffn = torch.zeros(E, cfg.moe.moe_intermediate_size, dtype=torch.float64)
                routed = torch.zeros(E, cfg.moe.moe_intermediate_size, dtype=torch.float64)
                norms = torch.zeros(2, E, dtype=torch.float64)
                for e in range(E):
                    for s in range(b):
                        toks = [t for t in range(s * l, (s + 1) * l) if e in idx[t].tolist()]
                        if not toks:
                            continue
                        h = ffn_hidden(x[toks], ex.up_proj[e], None if ex.gate_proj is None else ex.gate_proj[e], act)
                        y = F.linear(h, ex.down_proj[e])
                        we = torch.stack([w[t][idx[t] == e][0] for t in toks])
                        ffn[e] += h.double().abs().mean(0).square()
                        routed[e] += (h.double().abs() * we.double().abs()[:, None]).mean(0).square()
                        norms[0, e] += (y.double().norm(dim=-1) * we.abs()).sum()
                        norms[1, e] += len(toks)
                add(p + "expert_ffn", ffn)
                add(p + "expert_ffn_contribution", routed)
                add(p + "experts", norms)
                if mix.shared_experts is not None:
                    add(p + "shared_ffn", agg(ffn_hidden(n, mix.shared_experts.up_proj.weight, None, act)))
        add(f"site{cfg.num_layers}", agg(model.norm_f(states[-1])))
    out = {"hidden": sum(acc[f"site{i}"].sqrt() for i in range(cfg.num_layers + 1)),
           "block_importance": torch.stack([1 - acc[f"layers.{i}.cos"][0] / acc[f"layers.{i}.cos"][1]
                                            for i in range(cfg.num_layers)])}
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        if layer.kind == "E":
            xs, ys = torch.cat(acc.pop(p + "recon_x")), torch.cat(acc.pop(p + "recon_y"))
            out[p + "expert_reconstruction"] = brute_elimination(layer.mixer, cfg, xs, ys)
            wn = layer.mixer.experts.down_proj.double().norm(dim=1)
            out[p + "expert_ffn_contribution"] = acc.pop(p + "expert_ffn_contribution").sqrt() * wn
    for k, v in acc.items():
        if k.startswith("layers.") and not k.endswith("cos"):
            out[k] = v[0] / v[1].clamp(min=1) if k.endswith("experts") else v.sqrt()
    for i, layer in enumerate(model.layers):  # ffn and mamba_x are weighted by the columns they feed
        w = {"-": "down_proj", "M": "out_proj"}.get(layer.kind)
        if w is not None:
            k = f"layers.{i}." + ("ffn" if layer.kind == "-" else "mamba_x")
            out[k] = out[k] * getattr(layer.mixer, w).weight.double().norm(dim=0)
    for i in range(cfg.num_layers):
        for k, shape in (("attn", (cfg.attention.num_attention_heads, cfg.attention.head_dim)),
                         ("mamba_x", (cfg.mamba.mamba_num_heads, cfg.mamba.mamba_head_dim))):
            if f"layers.{i}.{k}" in out:
                out[f"layers.{i}.{k}"] = out[f"layers.{i}.{k}"].view(shape)
    return out


@pytest.mark.parametrize("name", list(CFGS))
def test_hooks_equal_direct_computation(name):
    cfg = CFGS[name]
    model = make_model(cfg)
    batches = [rand_ids(cfg, 3, 20, s) for s in range(2)]
    plain = model(batches[0])
    scorer = Scorer(model).attach()
    with torch.no_grad():
        hooked = model(batches[0])
        model(batches[1])
    scorer.detach()
    assert torch.equal(plain, hooked)  # the recording expert hook path computes exactly what the model does
    assert all(not m.experts._expert_hooks for m in model.moe_layers())  # detach removed the expert hooks
    assert all("expert" not in m.experts.__dict__ for m in model.moe_layers())  # nothing rebound
    assert not any(mod._forward_hooks or mod._forward_pre_hooks for mod in model.modules())
    got, want = scorer.result(), direct_scores(model, batches)
    n_e, F_e = cfg.moe.n_routed_experts, cfg.moe.moe_intermediate_size
    expected_shapes = {"hidden": (32,), "block_importance": (cfg.num_layers,)}
    for i, c in enumerate(cfg.pattern):
        p = f"layers.{i}."
        moe = {p + "shared_ffn": (16,)} if cfg.moe.moe_shared_expert_intermediate_size else {}
        moe.update({p + "expert_contribution": (n_e,), p + "expert_frequency": (n_e,),
                    p + "expert_reconstruction": (n_e,), p + "expert_ffn_contribution": (n_e, F_e)})
        moe.update({p + "latent": (cfg.moe.moe_latent_size,)} if cfg.moe.moe_latent_size else {})
        expected_shapes.update({"-": {p + "ffn": (48,)}, "*": {p + "attn": (4, 8)}, "M": {p + "mamba_x": (8, 4)},
                                "E": {p + "experts": (n_e,), p + "expert_ffn": (n_e, F_e), **moe}}[c])
    assert {k: tuple(v.shape) for k, v in got.items()} == expected_shapes
    for k in want:
        assert got[k].dtype == torch.float32
        assert rel(got[k].double(), want[k]) < 1e-5, k
    for i, c in enumerate(cfg.pattern):  # every expert was routed something and scores vary
        if c == "E":
            assert (got[f"layers.{i}.experts"] > 0).sum() >= n_e - 1
    assert got["hidden"].std() > 0.05 * got["hidden"].mean()
    with torch.no_grad():
        model(batches[0])  # detached: nothing more is accumulated
    assert torch.equal(scorer.result()["hidden"], got["hidden"])


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_is_masked(side):
    cfg = NEMO  # no RoPE: left padding leaves real tokens' positions meaningless only with RoPE
    model = make_model(cfg, seed=1)
    lengths, L = [20, 13, 7], 20
    seqs = [rand_ids(cfg, 1, n, 10 + j)[0] for j, n in enumerate(lengths)]
    ids = rand_ids(cfg, 3, L, 99)  # garbage in the padding
    mask = torch.zeros(3, L, dtype=torch.long)
    for j, s in enumerate(seqs):
        sl = slice(0, len(s)) if side == "right" else slice(L - len(s), L)
        ids[j, sl], mask[j, sl] = s, 1
    padded, _ = score_model(model, [ids], [mask], loss_increase=False)
    single, _ = score_model(model, [s[None] for s in seqs], loss_increase=False)
    unmasked, _ = score_model(model, [ids], loss_increase=False)
    assert padded.keys() == single.keys()
    for k in single:
        assert rel(padded[k], single[k]) < 1e-5, k
    assert rel(unmasked["hidden"], single["hidden"]) > 1e-3  # the padding would have changed the scores


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for name, cfg in CFGS.items():
        d = tmp_path_factory.mktemp(name) / "ck"
        save_model(make_model(cfg, seed=2), d)
        out[name] = d
    return out


@pytest.mark.parametrize("name", list(CFGS))
def test_streaming_equals_whole_model(saved, name, tmp_path):
    cfg = CFGS[name]
    batches = [rand_ids(cfg, 2, 24, 50 + s) for s in range(3)]
    masks = [torch.ones(2, 24, dtype=torch.long) for _ in batches]
    masks[1][0, 15:] = 0  # one padded sequence
    whole, wi = score_model(load_model(saved[name]), batches, masks, loss_batches=2)
    assert wi["loss_batches"] == 2 and wi["tokens"] == 3 * 48 - 9
    for budget in (None, 0, 3 * 24 * 32 * 4):  # all in memory, everything spilled, some spilled
        spill = tmp_path / f"spill{budget}"
        spill.mkdir()
        got, gi = score_streaming(saved[name], batches, masks, loss_batches=2,
                                  run=Streaming(max_memory_bytes=budget, spill_dir=spill))
        assert (gi["spilled_bytes"] > 0) == (budget is not None)
        assert list(spill.iterdir()) == []  # spill files removed
        assert got.keys() == whole.keys() and "loss_increase" in got
        for k in whole:
            assert rel(got[k], whole[k]) <= 1e-5, (budget, k)
        assert abs(gi["baseline_loss"] - wi["baseline_loss"]) <= 1e-6 * wi["baseline_loss"]
    assert whole["loss_increase"].abs().max() > 1e-3


def test_depth_scores_are_sensible():
    cfg = NEMO
    model = make_model(cfg, seed=3)
    with torch.no_grad():
        model.layers[1].mixer.o_proj.weight.zero_()  # attention layer 1 writes nothing
        model.layers[4].mixer.out_proj.weight.zero_()  # Mamba layer 4 writes nothing
    batches = [rand_ids(cfg, 2, 16, s) for s in range(3)]
    scores, info = score_model(model, batches, loss_batches=3)
    bi, li = scores["block_importance"], scores["loss_increase"]
    for i in (1, 4):
        assert abs(bi[i]) < 1e-6 and abs(li[i]) < 1e-6
    for i in (0, 2, 3, 5):
        assert bi[i] > 1e-3 and abs(li[i]) > 1e-4
    # loss increase of layer 3 against a model built without it
    drop = 3
    small = HybridLM(cfg.replace(pattern=cfg.pattern[:drop] + cfg.pattern[drop + 1:])).eval()
    state = {}
    for k, v in model.state_dict().items():
        if k.startswith("layers."):
            i = int(k.split(".")[1])
            if i == drop:
                continue
            k = f"layers.{i - (i > drop)}." + k.split(".", 2)[2]
        state[k] = v
    small.load_state_dict(state)

    def loss(m):
        with torch.no_grad():
            return sum(F.cross_entropy(m(ids)[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1),
                                       reduction="sum") for ids in batches) / sum(ids[:, 1:].numel() for ids in batches)
    assert abs(float(loss(model)) - info["baseline_loss"]) < 1e-5
    assert abs(float(loss(small) - loss(model)) - float(li[drop])) < 1e-5


# ---- the pipeline -------------------------------------------------------------------------

def test_score_pipeline_writes_scores(hf_dir, tmp_path, monkeypatch):
    data = embedded_corpus()[1]
    out = tmp_path / "scores"
    report = score(hf_dir, data, out, samples=6, seq_len=32, batch=4, mode="auto", progress=False)
    tensors, meta = load_scores(out)
    assert sorted(p.name for p in out.iterdir()) == ["importance.png", "remodel_report.json", "scores.json",
                                                     "scores.safetensors"]
    assert (out / "importance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert meta["format"] == "remodel-scores/1" and meta["mode"] == "whole" and meta["samples"] == 6
    assert meta["seq_len"] == 32 and meta["tokens"] == 6 * 32 and meta["config"]["pattern"] == "M*-E"
    assert 0 < meta["baseline_loss"] < 20 and meta["source"] == str(hf_dir)
    assert set(tensors) == {"hidden", "layers.0.mamba_x", "layers.1.attn", "layers.2.ffn", "layers.3.experts",
                            "layers.3.expert_ffn", "layers.3.shared_ffn", "layers.3.expert_contribution",
                            "layers.3.expert_frequency", "layers.3.expert_reconstruction",
                            "layers.3.expert_ffn_contribution", "block_importance", "loss_increase"}
    rep = json.loads((out / "remodel_report.json").read_text())
    assert rep["command"] == "score" and [r["type"] for r in rep["layers"]] == list("M*-E")
    assert rep["layers"][2]["block_importance"] == pytest.approx(float(tensors["block_importance"][2]))
    assert report["tokens"] == 192

    import psutil  # 'auto' streams when the weights exceed half of the (here: pretended tiny) free memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 1000})())
    score(hf_dir, data, tmp_path / "auto_stream", samples=6, seq_len=32, batch=4, progress=False)
    t2, m2 = load_scores(tmp_path / "auto_stream")
    assert m2["mode"] == "streaming" and t2.keys() == tensors.keys()
    for k in tensors:
        assert rel(t2[k], tensors[k]) <= 1e-5, k
    assert choose_mode("auto", 10, 100) == "whole" and choose_mode("auto", 51, 100) == "streaming"
    assert choose_mode("whole", 10**12, 1) == "whole"


def test_score_refuses_bad_input_and_writes_nothing(hf_dir, tmp_path):
    data = embedded_corpus()[1]
    out = tmp_path / "out"
    no_tok = tmp_path / "no_tok"
    shutil.copytree(hf_dir, no_tok)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (no_tok / f).unlink()
    cases = [((tmp_path / "missing", data, out), {}, "model not found"),
             ((hf_dir, tmp_path / "nope.txt", out), {}, "data not found"),
             ((hf_dir, data, out), {"samples": 0}, "samples must be a positive"),
             ((hf_dir, data, out), {"seq_len": -1}, "seq_len must be a positive"),
             ((hf_dir, data, out), {"mode": "fast"}, "unknown mode"),
             ((no_tok, data, out), {}, f"no tokenizer files in {no_tok}"),
             ((hf_dir, data, hf_dir / "inside"), {}, "overlaps input"),
             ((hf_dir, tmp_path / "empty.txt", out), {}, "no text")]
    (tmp_path / "empty.txt").write_text("\n\n")
    for args, kw, msg in cases:
        with pytest.raises(RemodelError, match=msg) as e:
            score(*args, progress=False, **{"samples": 4, "seq_len": 16, **kw})
        assert "\n" not in str(e.value)
        assert not out.exists() and not list(tmp_path.glob(".out*")) and not (hf_dir / "inside").exists()
    out.mkdir()
    (out / "x").write_text("keep")
    with pytest.raises(RemodelError, match="not empty"):
        score(hf_dir, data, out, samples=4, seq_len=16, progress=False)
    assert [p.name for p in out.iterdir()] == ["x"]


# ---- bounded memory on a checkpoint larger than the cap ----------------------------------------

MEMORY_SCRIPT = PEAK_RSS + """
import re, sys
import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot
import transformers, datasets, psutil, torch
from transformers import AutoTokenizer
from remodel.pipelines.commands.score import score
torch.set_num_threads(1)
# warm-up on a tiny checkpoint of the same layer kinds: code pages of the kernels, allocator pools
score(sys.argv[4], sys.argv[2], sys.argv[5], samples=4, seq_len=32, batch=2, mode="streaming",
      max_memory_bytes=64 * 1024, loss_batches=1, progress=False)
base = reset_peak()
r = score(sys.argv[1], sys.argv[2], sys.argv[3], samples=4, seq_len=32, batch=2, mode="streaming",
          max_memory_bytes=64 * 1024, loss_batches=1, progress=False)
print(base, status("VmHWM"), r["spilled_bytes"])
"""


def write_random_checkpoint(path, cfg, max_shard_bytes):
    """A nemotron_h checkpoint of random weights written tensor by tensor (no model in memory)."""
    g = torch.Generator().manual_seed(0)
    shapes, w = our_shapes(cfg), CheckpointWriter(path, max_shard_bytes)
    for ours, hf, e in weight_table(cfg, "nemotron_h"):
        shape = shapes[ours][1:] if e is not None else shapes[ours]
        leaf = ours.rsplit(".", 1)[-1]
        if ours.endswith("norm.weight") or leaf == "D":
            t = torch.ones(shape)
        elif leaf == "A_log":
            t = torch.log(torch.arange(1, shape[0] + 1, dtype=torch.float32))
        elif leaf in ("dt_bias", "e_score_correction_bias") or leaf == "bias":
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=g) * (0.5 / math.sqrt(shape[-1]))
        w.add(hf, t)
    w.close(config_to_hf(cfg, "nemotron_h"), aux_from=embedded_tokenizer_path())


def test_streaming_memory_stays_under_cap(hf_dir, tmp_path):
    mb = 1024**2
    cfg = ModelConfig(vocab_size=2048, hidden_size=512, pattern="M-*E" * 8, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64, intermediate_size=2048, mamba_num_heads=16,
                      mamba_head_dim=64, n_groups=2, ssm_state_size=64, chunk_size=32, n_routed_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=512, moe_shared_expert_intermediate_size=512)
    src, out = tmp_path / "big", tmp_path / "scores"
    write_random_checkpoint(src, cfg, 64 * mb)
    ckpt = CheckpointReader(src).total_bytes()
    assert ckpt >= 280 * mb and len(list(src.glob("*.safetensors"))) >= 4
    args = [src, embedded_corpus()[1], out, hf_dir, tmp_path / "warm"]
    res = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, *map(str, args)],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr[-3000:]
    base, peak, spilled = map(int, res.stdout.split()[-3:])
    growth, cap = peak - base, ckpt // 3
    print(f"checkpoint {ckpt / mb:.0f} MiB, baseline RSS {base / mb:.0f} MiB, peak {peak / mb:.0f} MiB, "
          f"growth {growth / mb:.1f} MiB, cap {cap / mb:.0f} MiB, spilled {spilled / mb:.1f} MiB")
    assert growth < cap and spilled > 0
    tensors, meta = load_scores(out)
    assert meta["mode"] == "streaming" and tensors["block_importance"].shape == (32,)
    assert tensors["loss_increase"].isfinite().all() and tensors["block_importance"].isfinite().all()
