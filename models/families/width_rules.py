"""Constraints between widths that a family's transformers config imposes, declared by the family
(Family.width_rules) and asked by pruning, the search and plan: none of them names a family."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WidthRule:
    """The product of the widths `of` is a multiple of the product of `by`, wherever all of them are present
    (nonzero); why: what the family's config derives from them; name: how a refusal names the two sides."""
    of: tuple
    by: tuple
    why: str
    names: tuple = ("{of}", "{by}")

    @property
    def axes(self) -> tuple:
        """The widths it reads beside the trunk's hidden size (it applies where a layer has them all)."""
        return tuple(a for a in self.of + self.by if a != "hidden_size")

    def holds(self, w: dict) -> bool:
        a, b = math.prod(w.get(n) or 0 for n in self.of), math.prod(w.get(n) or 0 for n in self.by)
        return not (a and b) or a % b == 0

    def refusal(self, w: dict, family: str) -> str:
        a, b = math.prod(w[n] for n in self.of), math.prod(w[n] for n in self.by)
        of, by = self.names[0].format(of=a), self.names[1].format(by=b)
        return f"{of} is not a multiple of {by}, which transformers' {family} config requires ({self.why})"


HIDDEN_DIVIDES_HEADS = WidthRule(("hidden_size",), ("attn_heads",), "head_dim = hidden_size / num_attention_heads",
                                 ("hidden_size {of}", "the {by} attention heads"))
MAMBA_WIDTH_FROM_HIDDEN = WidthRule(("mamba_heads", "mamba_head_dim"), ("hidden_size",),
                                    "the Mamba width is mamba_expand * hidden_size",
                                    ("the Mamba width {of}", "hidden_size {by}"))
SHARED_FROM_EXPERT = WidthRule(("shared_expert_size",), ("expert_ffn_size",),
                               "the shared experts are n_shared_experts * moe_intermediate_size",
                               ("the shared expert size {of}", "the expert FFN size {by}"))
