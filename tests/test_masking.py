"""The zero-masked references follow the kind registry: every registered layer kind (models.kinds.KINDS, post-norm
variants included) has its masking module in tests/kinds/ masking exactly the keep-dict axes it prunes, and its
declared outputs are everything its layers write to the residual stream; a family's tiny model holds it, so the
family suite's pruned == masked (tests/test_families.py) runs its masking. No list of kinds here: a new kind
brings its module and a family, and these tests hold it to both."""
import pytest
import torch

from remodel.models.families import FAMILIES
from remodel.models.hf import config_from_hf
from remodel.models.kinds import KINDS
from tests.conftest import random_model
from tests.kinds import masking

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def holder(char: str):
    """The first family (registry order) whose first tiny model holds trunk layers of kind `char`, and that config."""
    for name, fam in FAMILIES.items():
        if fam.nested or not fam.tiny:
            continue
        cfg = config_from_hf({"model_type": name, **next(iter(fam.tiny.values()))})
        if char in cfg.pattern:
            return name, cfg
    return None, None


@pytest.mark.parametrize("char", list(KINDS))
def test_every_kind_masks_exactly_the_axes_it_prunes(char):
    k = KINDS[char]
    try:
        m = masking(k)
    except ModuleNotFoundError:
        pytest.fail(f"layer kind {k.name!r} has no zero-masked reference: add tests/kinds/{k.section_name}.py")
    assert m.AXES == set(k.units) | set(k.hidden_units), k.name
    assert callable(m.mask) and callable(m.outputs)


@pytest.mark.parametrize("char", list(KINDS))
def test_masked_outputs_are_all_a_layer_writes(char):
    """With every tensor its masking module names as an output zeroed, each layer of the kind adds nothing to the
    residual stream (hidden pruning zeroes exactly those on the dropped channels); before, it did."""
    family, cfg = holder(char)
    assert family, f"no family's tiny model holds kind {KINDS[char].name!r}: the suite never prunes it"
    model = random_model(cfg, seed=5)
    x = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    blocks = [b for b in model.layers if b.kind == char]
    seen = []
    hooks = [b.register_forward_hook(lambda mod, a, out: seen.append((out - a[0]).abs().max().item())) for b in blocks]
    with torch.no_grad():
        model(x)
        assert min(seen) > 1e-3, (family, seen)  # each layer of the kind writes to the stream
        for b in blocks:
            for out in masking(b.spec).outputs(b.mixer):
                (out.weight if isinstance(out, torch.nn.Linear) else out).zero_()
                if isinstance(out, torch.nn.Linear) and out.bias is not None:
                    out.bias.zero_()
        seen.clear()
        model(x)
    for h in hooks:
        h.remove()
    assert max(seen) == 0.0, (family, seen)
