"""`remodel hybridize` (issue 57, first slice): a transformers-saved Llama into a Mamba-2 / attention `bamba`
hybrid. transformers is the oracle: the written checkpoint is loaded by BambaForCausalLM and compared with the
source LlamaForCausalLM."""
from __future__ import annotations

import json

import pytest
import torch

from remodel.cli import main
from remodel.models.mamba import ssd_reference
from tests.conftest import hf_pair

LLAMA = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, intermediate_size=40, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
IDS = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(transformers Llama with randomised weights, its checkpoint dir)."""
    hf, _, d = hf_pair("llama", tmp_path_factory.mktemp("hyb"), "llama", 7, **LLAMA)
    return hf, d


def _bamba(out):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(m).__name__ == "BambaForCausalLM"
    return m


def _run(*argv) -> int:
    return main(["hybridize", *map(str, argv)])


def test_every_layer_kept_writes_the_sources_logits(llama, tmp_path):
    """Conversion without replacement is the identity: bamba (whose attention rotates half of each head,
    so the heads are widened 8 -> 16 with zero channels) gives the Llama's logits."""
    hf, src = llama
    assert _run(src, tmp_path / "out", "--keep-attention", 4, "--to", "bamba") == 0
    b = _bamba(tmp_path / "out")
    assert b.config.layers_block_type == ["full_attention"] * 4 and b.config.head_dim == 16
    with torch.no_grad():
        want, got = hf(IDS).logits, b(IDS).logits
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("flags,attn", [(("--keep-layers", "0,3"), [0, 3]), (("--keep-attention", "1"), [2]),
                                        (("--keep-attention", "2", "--init", "random"), [1, 3])])
def test_n_attention_layers_kept_where_asked(llama, tmp_path, flags, attn):
    """transformers loads OUT (the family found by the registry, no --to) with exactly the asked attention
    layers, and their MLPs are the source's."""
    hf, src = llama
    assert _run(src, tmp_path / "out", *flags) == 0
    b = _bamba(tmp_path / "out")
    assert [i for i, layer in enumerate(b.model.layers) if hasattr(layer, "self_attn")] == attn
    assert sum(hasattr(layer, "mamba") for layer in b.model.layers) == 4 - len(attn)
    with torch.no_grad():
        assert torch.isfinite(b(IDS).logits).all()
    for j in attn:
        assert torch.equal(b.model.layers[j].feed_forward.down_proj.weight, hf.model.layers[j].mlp.down_proj.weight)


def _linear_attention(attn, u, heads, kv):
    """sum_{s<=t} (q_t . k_s) v_s per query head of a Llama attention module (no RoPE, no softmax) -> [b, l, h, d]."""
    q = attn.q_proj(u).unflatten(-1, (heads, -1))
    k = attn.k_proj(u).unflatten(-1, (kv, -1)).repeat_interleave(heads // kv, dim=2)
    v = attn.v_proj(u).unflatten(-1, (kv, -1)).repeat_interleave(heads // kv, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k).tril()
    return torch.einsum("bhts,bshd->bthd", scores, v)


def test_mamba_initialised_from_attention_is_its_linear_form(llama, tmp_path):
    """MambaInLlama's init, read back from the written bamba: the SSD scan of its in_proj's x, B, C (decay 1,
    dt 1, no conv) is the source attention's linear form per head, and out_proj is o_proj."""
    hf, src = llama
    assert _run(src, tmp_path / "out", "--keep-layers", "1") == 0
    b = _bamba(tmp_path / "out")
    u = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(0))
    for j in (0, 2, 3):
        m, a = b.model.layers[j].mamba, hf.model.layers[j].self_attn
        with torch.no_grad():
            _, xbc, _ = m.in_proj(u).split([32, 32 + 2 * 32, 4], dim=-1)
            x, B, C = xbc.split([32, 32, 32], dim=-1)
            y = ssd_reference(x.unflatten(-1, (4, 8)), torch.ones(2, 9, 4), torch.zeros(4),
                              B.unflatten(-1, (4, 8)), C.unflatten(-1, (4, 8)))
            want = _linear_attention(a, u, 4, 2)
        assert (y - want).abs().max().item() < 1e-5 * want.abs().max().item()
        assert torch.equal(m.out_proj.weight, a.o_proj.weight)


def test_report_and_config(llama, tmp_path):
    """The config.json names the asked attention layers; the report counts them."""
    _, src = llama
    assert _run(src, tmp_path / "out", "--keep-layers", "2") == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "bamba" and cfg["attn_layer_indices"] == [2]


@pytest.mark.parametrize("flags,flag", [(("--keep-attention", "5"), "--keep-attention"),
                                        (("--keep-layers", "0,4"), "--keep-layers"),
                                        (("--keep-layers", "1,1"), "--keep-layers"),
                                        ((), "--keep-attention"),
                                        (("--keep-attention", "1", "--keep-layers", "0"), "--keep-layers"),
                                        (("--keep-attention", "1", "--to", "nosuch"), "--to"),
                                        (("--keep-attention", "1", "--to", "llama"), "--to"),
                                        (("--keep-attention", "1", "--mixer", "rwkv7"), "--mixer"),
                                        (("--keep-attention", "1", "--select", "even", "--data", "train.txt"), "--steps"),
                                        (("--keep-attention", "1", "--steps", "0"), "--steps")])
def test_bad_input_one_line_naming_the_flag(llama, tmp_path, capsys, flags, flag):
    _, src = llama
    with pytest.raises(SystemExit) if "--mixer" in flags else _nothing():
        rc = _run(src, tmp_path / "out", *flags)
        assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err
    assert not (tmp_path / "out").exists()


def test_an_existing_init_folder_is_refused_not_replaced(llama, tmp_path, capsys):
    """Stage two writes the initialised hybrid to OUT.init: a non-empty folder there (not this run's) is refused in
    one line naming --resume / --overwrite before any work, its files untouched, nothing written."""
    _, src = llama
    (tmp_path / "train.txt").write_text("in the beginning was the word\n" * 50)
    mine = tmp_path / "out.init" / "notes.txt"
    mine.parent.mkdir()
    mine.write_text("a user's file")
    assert _run(src, tmp_path / "out", "--keep-attention", "1", "--data", tmp_path / "train.txt", "--steps", "1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--overwrite" in err and "--resume" in err, err
    assert mine.read_text() == "a user's file" and sorted(p.name for p in mine.parent.iterdir()) == ["notes.txt"]
    assert not (tmp_path / "out").exists()


def test_source_without_attention_refused(tmp_path, capsys):
    from remodel.models.families import FAMILIES
    tiny = dict(FAMILIES["bamba"].tiny["plain"], attn_layer_indices=[])
    _, _, d = hf_pair("bamba", tmp_path, "mamba_only", 3, **tiny)
    capsys.readouterr()  # transformers' save progress
    assert _run(d, tmp_path / "out", "--keep-attention", "0") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--mixer" in err and "attention" in err, err
    assert not (tmp_path / "out").exists()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_qwen3_every_layer_replaced_and_its_qk_norm_refused_when_kept(tmp_path, capsys):
    """A Qwen3 (q/k-normed attention) becomes an all-Mamba bamba that transformers loads, Mamba weights from its
    attention (out_proj = o_proj); keeping a layer is refused in one line (bamba's attention has no q/k norm)."""
    hf, _, d = hf_pair("qwen3", tmp_path, "qwen3", 4, **LLAMA)
    capsys.readouterr()
    assert _run(d, tmp_path / "out", "--keep-attention", "0") == 0
    b = _bamba(tmp_path / "out")
    assert b.config.layers_block_type == ["linear_attention"] * 4
    assert torch.equal(b.model.layers[1].mamba.out_proj.weight, hf.model.layers[1].self_attn.o_proj.weight)
    with torch.no_grad():  # no cache: transformers 5.25's bamba asks an all-Mamba cache for attention mask sizes
        assert torch.isfinite(b(IDS, use_cache=False).logits).all()
    capsys.readouterr()
    assert _run(d, tmp_path / "out2", "--keep-attention", "1", "--to", "bamba") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--to bamba" in err and "q/k norm" in err, err  # widening (or bamba's check)
    assert not (tmp_path / "out2").exists()


def test_select_kl_keeps_the_costliest_layers_as_transformers_measures_them(tmp_path):
    """--select kl, the default with --data and --keep-attention N (no --select given): the report's per-layer KL
    equals the KL of transformers' bamba with that layer alone replaced (written by --keep-layers) to the Llama on
    the same calibration blocks, and the kept layers are its top N. Without --data the default is even."""
    import gzip
    import shutil

    import torch.nn.functional as F
    from transformers import AutoTokenizer

    from remodel.pipelines.commands.hybridize import hybridize
    from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path, load_texts, pack
    hf, _, d = hf_pair("llama", tmp_path, "llama_tok", 9, **dict(LLAMA, vocab_size=2048))
    for f in embedded_tokenizer_path().iterdir():
        shutil.copy(f, d / f.name)
    with gzip.open(embedded_corpus()[0], "rt", encoding="utf-8") as f:
        (tmp_path / "calib.txt").write_text("\n".join(x for x in f.read().splitlines()[:200] if x.strip()) + "\n")
    rep = hybridize(d, tmp_path / "out", keep_attention=2, data=str(tmp_path / "calib.txt"), seq_len=16, samples=4)
    assert rep["select"] == "kl"
    blocks = pack(load_texts(str(tmp_path / "calib.txt")), AutoTokenizer.from_pretrained(d), 16, max_tokens=64)
    with torch.no_grad():
        ref = F.log_softmax(hf(blocks).logits, -1)
    want = []
    for j in range(4):
        out = tmp_path / f"only{j}"
        hybridize(d, out, keep_layers=[k for k in range(4) if k != j], to="bamba")
        with torch.no_grad():
            got = F.log_softmax(_bamba(out)(blocks).logits, -1)
        want.append(F.kl_div(got, ref, log_target=True, reduction="sum").item() / blocks.numel())
    assert rep["kl_per_layer"] == pytest.approx(want, rel=1e-3, abs=1e-7)
    assert rep["attention_kept"] == sorted(sorted(range(4), key=lambda j: -want[j])[:2])
    assert sorted(want)[1] < sorted(want)[2]  # the top two are well defined
    even = hybridize(d, tmp_path / "even", keep_attention=2)
    assert even["select"] == "even" and even["attention_kept"] == [1, 3] and even["kl_per_layer"] is None


@pytest.mark.parametrize("mixer", ["mamba2", "gdn", "kda"])
def test_an_init_that_forgets_a_tensor_is_refused_not_zero_filled(llama, monkeypatch, mixer):
    """Only the tensors the target's form adds (upcycle.hybridize.HybridLayers) are filled in: a mixer init that
    drops one of its tensors is refused in one line naming it, where a blanket zero fill used to hide it."""
    from remodel.models.errors import RemodelError
    from remodel.models.load import load_model
    from remodel.upcycle import hybridize as H
    src = load_model(llama[1])
    replaced = set(H.replaceable(src.cfg, mixer))
    _, new_cfg = H.target(src.cfg, mixer, replaced, None)
    m = H.MIXERS[mixer]
    dropped = []

    def forgetful(cfg, att, fresh):
        out = m.init(cfg, att, fresh)
        dropped.append(sorted(out)[-1])
        return {k: v for k, v in out.items() if k != dropped[-1]}

    assert H.hybridize_model(src, new_cfg, mixer, replaced) is not None  # the real init: every tensor has a value
    monkeypatch.setitem(H.MIXERS, mixer, m._replace(init=forgetful))
    with pytest.raises(RemodelError) as e:
        H.hybridize_model(src, new_cfg, mixer, replaced)
    first = min(replaced)
    assert len(str(e.value).splitlines()) == 1 and f"layers.{first}.mixer.{dropped[0]} " in str(e.value), e.value
    assert f"nor {len(replaced) - 1} more" in str(e.value), e.value
