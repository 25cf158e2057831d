"""Our model definition against transformers beyond the family conformance suite (tests/test_families.py,
which checks every family's logits, gradients, padding and round trips): an export without a shared expert,
empty batches."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from remodel.models.config import ModelConfig
from remodel.models.families import FAMILIES
from remodel.models.load import save_model
from remodel.models.model import HybridLM, init_weights
from tests.conftest import hf_pair, randomise

V, B, L = 96, 2, 37


def build(family, root):
    """-> (hf model, our model, checkpoint dir) of the family's first tiny model (Family.tiny), built once."""
    case, kw = next(iter(FAMILIES[family].tiny.items()))
    return hf_pair(family, root, family, len(case), **kw)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("parity")


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, L), generator=g), torch.randint(0, V, (B, L), generator=g)


def test_export_without_shared_expert(tmp_path):
    cfg = ModelConfig(vocab_size=V, hidden_size=32, pattern="M*E-E", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=4, n_groups=2,
                      ssm_state_size=8, chunk_size=16, n_routed_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=16, moe_shared_expert_intermediate_size=0, routed_scaling_factor=1.5)
    ours = randomise(init_weights(HybridLM(cfg), seed=0), seed=3).eval()
    out = save_model(ours, tmp_path / "ck", family="nemotron_h")
    hf = AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert hf.model.layers[2].mixer.shared_experts.up_proj.weight.shape == (1, 32)
    ids, _ = inputs(3)
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
    assert (got - ref).abs().max().item() <= 1e-4 and ref.std().item() > 0.3


@pytest.mark.parametrize("family", ["nemotron_h", "qwen2_moe"])
def test_empty_batch(family, root):
    """A batch of zero sequences (e.g. the last shard of a split batch) or of zero-length sequences
    gives logits of shape [B, L, V] and a backward that runs (transformers' own models raise here:
    their attention views an empty tensor with -1); a one-sequence batch gives that row of the full
    batch's logits."""
    _, ours, _ = build(family, root)
    ids = inputs()[0]
    for x in (ids[:0], ids[:, :0]):
        ours.zero_grad(set_to_none=True)
        out = ours(x)
        assert out.shape == (*x.shape, V)
        out.sum().backward()
        assert all(p.grad is None or p.grad.abs().max().item() == 0 for p in ours.parameters())
    with torch.no_grad():
        assert (ours(ids[:1]) - ours(ids)[:1]).abs().max().item() < 1e-5
