"""The gradient head criteria of compress/head_criteria.py (issue 55) against a plain autograd loop on tiny Mamba
and Gated DeltaNet models: Fisher is the sum over sequences of the squared gradient of each sequence's own mean
loss with respect to a unit's gate (all of the unit's out_proj input channels scaled by one number), taylor2 is
-mean + mean of squares / 2 of those gradients, taylor the summed negative batch-loss gradient; padded sequences
count only their real tokens."""
import pytest
import torch

from remodel.compress.head_criteria import gate_criteria
from remodel.compress.head_loo import loo_units
from remodel.compress.importance import head_weight, lm_loss_sums
from remodel.models.config import ModelConfig
from tests.conftest import random_model

BASE = dict(vocab_size=96, hidden_size=24, norm_eps=1e-5, intermediate_size=40)
CFGS = {
    "mamba": dict(pattern="-M-M", n_groups=2, mamba_num_heads=4, mamba_head_dim=4, ssm_state_size=5, conv_kernel=4,
                  chunk_size=8),
    "gdn": dict(pattern="D-", linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=6),
}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def unit_grad(model, i, chans, ids, mask):
    """d(mean loss of `ids`)/d(one gate on the channels `chans` of layer i's out_proj input), by autograd."""
    gate = torch.ones((), requires_grad=True)
    scale = torch.ones(model.layers[i].mixer.out_proj.weight.shape[1])

    def pre(module, args):
        return (args[0] * torch.where(torch.isin(torch.arange(len(scale)), chans), gate, scale),) + args[1:]
    hnd = model.layers[i].mixer.out_proj.register_forward_pre_hook(pre)
    try:
        with torch.enable_grad():
            h, _ = model.hidden(ids, mask)
            s, n = lm_loss_sums(h, head_weight(model), ids, mask)
            (g,) = torch.autograd.grad(s / n, gate)
    finally:
        hnd.remove()
    return float(g)


@pytest.mark.parametrize("kind", ["mamba", "gdn"])
@pytest.mark.parametrize("padded", [False, True])
def test_fisher_and_taylor_equal_a_per_sequence_autograd_loop(kind, padded):
    model = random_model(ModelConfig(**BASE, **CFGS[kind]), 0)
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 96, (3, 12), generator=gen) for _ in range(2)]
    masks = None
    if padded:  # left padding, as the calibration loader pads: sequences of 12, 9 and 6 real tokens
        m = torch.ones(3, 12, dtype=torch.long)
        m[1, :3], m[2, :6] = 0, 0
        masks = [m, m]
    got = gate_criteria(model, batches, masks)
    units = loo_units(model.cfg)
    assert {n for _, n, _ in units} >= ({"mamba_heads_loo"} if kind == "mamba" else {"lin_v_heads_loo", "lin_k_heads_loo"})
    for i, name, chans in units:
        key = f"layers.{i}.{name}"
        seq = torch.tensor([[unit_grad(model, i, c, ids[q:q + 1], None if masks is None else masks[b][q:q + 1])
                             for c in chans] for b, ids in enumerate(batches) for q in range(3)])
        batch = torch.tensor([[unit_grad(model, i, c, ids, None if masks is None else masks[b]) for c in chans]
                              for b, ids in enumerate(batches)])
        assert seq.abs().max() > 1e-4, key  # the gradients are not all zero: the comparison means something
        torch.testing.assert_close(got["fisher"][key], seq.square().sum(0), rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(got["taylor2"][key], -seq.mean(0) + seq.square().mean(0) / 2, rtol=1e-4, atol=1e-8)
        torch.testing.assert_close(got["taylor"][key], -batch.sum(0), rtol=1e-4, atol=1e-8)
        torch.testing.assert_close(got["fisher_act"][key], got["fisher"][key].sqrt() * got["out_act"][key])
