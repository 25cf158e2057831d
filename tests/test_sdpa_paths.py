"""MLA and sink attention's two paths (models/sdpa.py): eager on CPU, SDPA on CUDA. Here on CPU the SDPA path is asked
for (attn_impl "sdpa") and must give the eager path's logits and gradients within 1e-5 (fp32), with left padding and
sliding windows shorter than the sequence: MLA with its v head padded to the q / k head and sliced back (and with q / k
padded when v is the wider one), gpt-oss's sinks as an extra zero key whose mask entry is the sink logit. (On CUDA,
tests/test_cuda.py's families against transformers run the SDPA path by default.)"""
import copy

import pytest
import torch

from remodel.models.families import FAMILIES
from remodel.models.hf import config_from_hf
from remodel.models.sdpa import set_attn_impl, wants_sdpa
from tests.conftest import random_model

# (family, case, config changes): MLA with v narrower than q / k, MLA with v wider, gpt-oss (window 3 < 13 tokens)
CASES = [("glm4_moe_lite", "flash", {}), ("deepseek_v3", "direct_q_tied", {"v_head_dim": 14}),
         ("gpt_oss", "yarn", {})]


def model_of(family, case, changes):
    cfg = config_from_hf({"model_type": family, **FAMILIES[family].tiny[case], **changes})
    return random_model(cfg, seed=3).float()


def run(model, impl, x, mask):
    """(logits, every parameter's gradient) of `model` on the `impl` path."""
    m = copy.deepcopy(model)
    set_attn_impl(m, impl)
    logits = m(x, attention_mask=mask)
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family,case,changes", CASES)
def test_sdpa_path_equals_eager(family, case, changes):
    model = model_of(family, case, changes)
    x = torch.randint(0, model.cfg.vocab_size, (3, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[1, :4], mask[2, :9] = 0, 0  # left padding
    for am in (None, mask):
        (a, ga), (b, gb) = run(model, "eager", x, am), run(model, "sdpa", x, am)
        assert (a - b).abs().max().item() <= 1e-5 and a.abs().max().item() > 1e-2
        assert ga.keys() == gb.keys() and any("sinks" in n or "kv_b_proj" in n for n in ga)
        for n in ga:
            assert (ga[n] - gb[n]).abs().max().item() <= 1e-5 * max(1.0, ga[n].abs().max().item()), n


def test_the_default_path_follows_the_device():
    """attn_impl None: eager on CPU tensors; "sdpa" / "eager" whatever the device; anything else refused."""
    model = model_of("gpt_oss", "yarn", {})
    layer = next(m for m in model.modules() if hasattr(m, "attn_impl"))
    t = torch.zeros(1)
    assert not wants_sdpa(layer, t) and not wants_sdpa(layer, torch.zeros(1, device="meta"))
    set_attn_impl(model, "sdpa")
    assert wants_sdpa(layer, t)
    with pytest.raises(Exception) as e:
        set_attn_impl(model, "flash")
    assert "attention implementation" in str(e.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family,case,changes", CASES)
def test_cuda_takes_sdpa_by_default_with_the_eager_logits(family, case, changes, monkeypatch):
    """On CUDA (attn_impl None) the SDPA path runs, and gives the CPU eager path's logits (fp32, TF32 off)."""
    import remodel.models.attention as attention
    import remodel.models.mla as mla
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = model_of(family, case, changes)
    x = torch.randint(0, model.cfg.vocab_size, (3, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    with torch.no_grad():
        want = model(x, attention_mask=mask)
        taken = []
        for mod in (attention, mla):  # the layers' own references to models.sdpa.wants_sdpa
            monkeypatch.setattr(mod, "wants_sdpa", lambda m, t, f=mod.wants_sdpa: taken.append(f(m, t)) or taken[-1])
        got = model.cuda()(x.cuda(), attention_mask=mask.cuda()).cpu()
    assert taken and all(taken) and (got - want).abs().max().item() <= 1e-4
