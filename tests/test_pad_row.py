"""The pad row (issue 53): transformers builds the input embedding of every family but Nemotron-H as
nn.Embedding(vocab, hidden, padding_idx=pad_token_id), so that row gets no gradient from the input lookup; ours
freezes the same row (ModelConfig.padding_idx, declared per family by Family.padding_idx), never touching its
weights.

Per registered family and tiny case, with the pad id set and held by the inputs (a run of it, as left padding
writes, and every fourth token, as pad == eos does in packed text): the family's flag is what transformers' own
embedding module holds, and the embedding's gradient equals transformers' (fp32; 1e-5 + 1e-4 x its largest,
the parity tests' tolerance) with the pad row included, where the gradient of an unfrozen row differs by far
more (the check can fail). Loading, export, `convert` and pruning keep the pad row's weights bit for bit.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from remodel import cli
from remodel.compress.prune import plan_keep, prune_model
from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.families import FAMILIES
from remodel.models.hf import config_from_hf
from remodel.models.load import load_model, save_model
from tests.conftest import assert_same_tensors, randomise, tensors

PAD = 5  # inside every tiny vocabulary, apart from the bos / eos ids the tiny configs use (0..2)
B, L = 2, 29
CASES = [(f, c) for f, fam in FAMILIES.items() for c in fam.tiny]
_BUILT = {}


def hf_config(family: str, case: str, pad=PAD) -> dict:
    """The tiny case's transformers fields with pad_token_id = pad (in the text model's config where it nests)."""
    fam, tiny = FAMILIES[family], FAMILIES[family].tiny[case]
    if fam.nested:
        return {**tiny, fam.nested: {**tiny[fam.nested], "pad_token_id": pad}}
    return {**tiny, "pad_token_id": pad}


def build(family: str, case: str, root):
    """(transformers' model with randomised weights, fp32 eval; ours loaded from its save_pretrained; the dir)."""
    key = (str(root), family, case)
    if key not in _BUILT:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
        auto = AutoModelForImageTextToText if FAMILIES[family].nested else AutoModelForCausalLM
        torch.manual_seed(0)
        hf = auto.from_config(AutoConfig.for_model(family, **hf_config(family, case))).float().eval()
        randomise(hf, seed=len(case))
        d = root / f"{family}-{case}"
        hf.save_pretrained(d)
        _BUILT[key] = hf, load_model(d), d
    return _BUILT[key]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("pad_row")


def inputs(V: int):
    """(ids holding PAD 6 times at the start of row 1 and at every fourth position, labels)."""
    g = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, V, (B, L), generator=g), torch.randint(0, V, (B, L), generator=g)
    ids[:, ::4] = PAD
    ids[1, :6] = PAD
    return ids, labels


def embedding_grad(model, ids, labels, logits_of):
    model.zero_grad(set_to_none=True)
    logits = logits_of(ids)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    return logits.detach(), model.get_input_embeddings().weight.grad.clone() if hasattr(model, "get_input_embeddings") \
        else model.embeddings.weight.grad.clone()


@pytest.mark.parametrize("family,case", CASES)
def test_embedding_gradient_equals_transformers_with_the_pad_id_in_the_input(family, case, root):
    hf, ours, _ = build(family, case, root)
    frozen = FAMILIES[family].padding_idx
    # the family's flag is what transformers' own module holds, and ours reads it so
    assert hf.get_input_embeddings().padding_idx == (PAD if frozen else None)
    assert ours.cfg.padding_idx == (PAD if frozen else None)
    # the row's weights as loaded (padding_idx never zeroes them)
    row = hf.get_input_embeddings().weight[PAD]
    assert torch.equal(ours.embeddings.weight[PAD], row) and row.abs().max() > 0.1
    V = ours.cfg.vocab_size
    x, labels = inputs(V)
    ref, g_ref = embedding_grad(hf, x, labels, lambda i: hf(input_ids=i).logits)
    out, g = embedding_grad(ours, x, labels, ours)
    assert (out - ref).abs().max().item() <= 1e-4 and ref.std().item() > 0.3
    tol = 1e-5 + 1e-4 * g_ref.abs().max().item()
    err = (g - g_ref).abs().max().item()
    assert err <= tol, f"embedding grad diff {err:.2e} > {tol:.2e} (pad row {(g - g_ref)[PAD].abs().max():.2e})"
    # the check can fail: with every row trained (the old embedding) the pad row's gradient is far off in a
    # freezing family; in Nemotron-H (nothing frozen) the row does get its lookup's gradient, as in transformers
    ours.cfg.padding_idx = None if frozen else PAD
    try:
        _, g_other = embedding_grad(ours, x, labels, ours)
    finally:
        ours.cfg.padding_idx = PAD if frozen else None
    assert (g_other - g_ref)[PAD].abs().max().item() > 100 * tol
    if not ours.cfg.tie_word_embeddings:  # an untied pad row's gradient is its lookup's alone
        assert (g_ref[PAD].abs().max().item() == 0) == frozen


class StandIn(torch.nn.Module):
    """A module in place of nn.Embedding that knows no padding_idx (as tensor parallelism's vocab-parallel one)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, ids):
        return F.embedding(ids, self.weight)


def test_a_stand_in_embedding_freezes_the_same_row(root):
    """The freeze is on the lookup's output (HybridLM.embed), not nn.Embedding's own padding_idx: an embedding
    module that knows none still gives transformers' gradient."""
    hf, ours, _ = build("olmo_hybrid", "plain", root)
    m = copy.deepcopy(ours)
    m.embeddings = StandIn(m.embeddings.weight)
    x, labels = inputs(m.cfg.vocab_size)
    _, g_ref = embedding_grad(hf, x, labels, lambda i: hf(input_ids=i).logits)
    _, g = embedding_grad(m, x, labels, m)
    assert (g - g_ref).abs().max().item() <= 1e-5 + 1e-4 * g_ref.abs().max().item()
    assert g[PAD].abs().max().item() == 0 and g_ref[PAD].abs().max().item() == 0  # untied: no gradient at all


def test_frozen_only_in_training_and_every_forward_agrees(root):
    """Under no_grad (eval, scoring) and for a frozen embedding the lookup is the plain one; the logits are the
    same with and without the freeze (it changes gradients, never values)."""
    _, ours, _ = build("llama", "tied", root)
    x, _ = inputs(ours.cfg.vocab_size)
    with torch.no_grad():
        plain = ours(x)
    frozen = ours(x)
    assert torch.equal(plain, frozen.detach())
    m = copy.deepcopy(ours)
    m.embeddings.weight.requires_grad_(False)
    assert torch.equal(m(x).detach(), plain)  # no gradient asked of the embedding: nothing masked, same values


def test_export_convert_and_prune_keep_the_pad_row(root, tmp_path):
    hf, ours, d = build("qwen3", "plain", root)
    out = save_model(ours, tmp_path / "out", family="qwen3")
    assert_same_tensors(d, out)  # the pad row too, bit for bit
    assert load_model(out).cfg.padding_idx == PAD
    assert cli.main(["convert", str(d), str(tmp_path / "conv"), "--to", "qwen3"]) == 0
    assert_same_tensors(d, tmp_path / "conv")
    src = tensors(d)["model.embed_tokens.weight"]
    scores = {"hidden": torch.arange(ours.cfg.hidden_size, dtype=torch.float)}
    pruned = prune_model(ours, plan_keep(ours.cfg, scores, {"hidden_size": 24}, "qwen3"))
    kept = scores["hidden"].argsort(descending=True)[:24].sort().values
    assert pruned.cfg.padding_idx == PAD
    assert torch.equal(pruned.embeddings.weight[PAD], src[PAD, kept])


@pytest.mark.parametrize("pad,want", [(PAD, PAD), (-1, 95), (96, None), (None, None), (True, None), ("5", None)])
def test_pad_token_id_read_as_transformers_builds_the_row(pad, want):
    """A negative id counts from the end (nn.Embedding's reading); one outside the vocabulary, or not an int, is
    no row (transformers would refuse to build the model): every row trains."""
    from remodel.models.hf import _padding_idx
    assert _padding_idx(FAMILIES["llama"], pad, 96) == want
    assert _padding_idx(FAMILIES["nemotron_h"], pad, 96) is None
    cfg = config_from_hf({"model_type": "qwen2", **FAMILIES["qwen2"].tiny["plain"], "pad_token_id": PAD})
    assert cfg.padding_idx == PAD and cfg.extra["pad_token_id"] == PAD
    assert ModelConfig.from_dict(cfg.to_dict()).padding_idx == PAD


def test_padding_idx_outside_the_vocab_refused():
    with pytest.raises(RemodelError, match="padding_idx 96 is not a row of the 96-token embedding"):
        ModelConfig(vocab_size=96, hidden_size=8, pattern="-", intermediate_size=8, padding_idx=96)
