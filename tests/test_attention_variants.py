"""The attention kind's variants (AttentionConfig's output gate, q/k norms, key multiplier, RoPE) are parts
chosen once when the module is built, not branches in its forward (logits per family: tests/test_families.py)."""
import ast
import inspect
import textwrap

import torch

from remodel.models import attention
from remodel.models.attention import Attention
from remodel.models.config import ModelConfig

VARIANTS = {"attn_output_gate", "qk_norm", "qk_norm_full", "key_multiplier", "rope_theta", "attention_sinks",
            "sliding_window"}


def test_forward_tests_no_variant_field():
    for fn in (Attention.forward, Attention._core):
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        tested = {n.attr for node in ast.walk(tree) if isinstance(node, (ast.If, ast.IfExp))
                  for n in ast.walk(node.test) if isinstance(n, ast.Attribute)}
        assert not tested & VARIANTS, (fn.__name__, tested & VARIANTS)


def _cfg(**kw):
    return ModelConfig(vocab_size=64, hidden_size=32, pattern="*", num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, **kw)


def test_each_variant_selects_its_part():
    plain = Attention(_cfg())
    assert (plain.norm_projections, plain.norm_heads, plain.split_query, plain.position, plain.scale_keys) == (
        attention._same_qk, attention._same_qk, attention._query_heads, attention._unrotated, attention._same_keys)
    rich = Attention(_cfg(attn_output_gate=True, qk_norm=True, rope_theta=1e4, key_multiplier=0.5))
    assert (rich.norm_heads, rich.split_query, rich.gate_output, rich.position, rich.scale_keys) == (
        attention._norm_qk, attention._query_and_gate_heads, attention._gated_out, attention._rotated,
        attention._scaled_keys)
    assert Attention(_cfg(qk_norm_full=True)).norm_projections is attention._norm_qk
    assert (plain.attend, Attention(_cfg(attention_sinks=True)).attend) == (attention._sdpa, attention._with_sinks)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    assert rich(x).shape == plain(x).shape == (2, 5, 32)
