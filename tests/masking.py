"""The honest zero-masked reference of a width-pruned model, written by hand (not from the axes table):
the unpruned model with every dropped unit's output zeroed (and the norms and routers that would still see
it patched), whose logits pruning must reproduce (tests/test_families.py on every family's axes, and
tests/test_prune.py). The trunk's hidden channels are masked here; each layer kind's units by its own module
in tests/kinds/ (found by the kind's section name: a new kind adds its module there, not a line here). An axis
no kind's module masks fails loudly."""
import copy

import torch

from remodel.models.kinds import KINDS
from tests.kinds import dropped, kept_mean_rmsnorm, masking


def _mask_hidden(ref, kept):
    """Dropped hidden channels: the embedding and every layer's output write zero there, so the residual stream
    starts and stays zero on them; every trunk norm averages over the kept channels."""
    d = dropped(kept, ref.cfg.hidden_size)
    ref.embeddings.weight[:, d] = 0
    for layer in ref.layers:
        for out in masking(layer.spec).outputs(layer.mixer):
            if isinstance(out, torch.nn.Linear):
                out.weight[d] = 0
                if out.bias is not None:
                    out.bias[d] = 0
            else:  # experts' down_proj [E, H, F] (or their biases [E, H])
                out[:, d] = 0
        kept_mean_rmsnorm(layer.norm, len(kept))
    kept_mean_rmsnorm(ref.norm_f, len(kept))


def known_axes() -> set:
    """Every keep-dict axis a masking module (or the trunk: hidden) masks."""
    return {"hidden"}.union(*(masking(k).AXES for k in KINDS.values()))


@torch.no_grad()
def masked_reference(model, keep):
    """A copy of `model` with everything `keep` drops zero-masked (see the module docstring)."""
    unknown = {k.rsplit(".", 1)[-1] for k in keep if k != "layers"} - known_axes()
    assert not unknown, f"no module in tests/kinds/ masks the axes {sorted(unknown)}: add it to its kind's"
    ref = copy.deepcopy(model)
    if "hidden" in keep:
        _mask_hidden(ref, keep["hidden"])
    for i, layer in enumerate(ref.layers):
        masking(layer.spec).mask(ref.cfg, layer.mixer, keep, f"layers.{i}.")
    return ref
