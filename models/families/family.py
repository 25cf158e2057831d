"""The spec of a Hugging Face model family: what config import/export, the key map, depth pruning,
upcycling and the CLI read about a family instead of testing its name.

One module per family (models/families/*.py) defines its Family instances; models/families/__init__.py
lists them. A new family is one such module and one registry line.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from remodel.models.attention import ATTENTION
from remodel.models.kinds import used

# ModelConfig's scalar multipliers at their plain values (a family without `multipliers` needs these)
MULTIPLIERS = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_scale": None,
               "logits_scaling": 1.0}


def plain_attention_scale(cfg) -> float | None:
    """cfg.attention_scale, None where it is the default 1/sqrt(head_dim) anyway or no layer attends."""
    s = cfg.attention_scale
    return None if ATTENTION not in used(cfg) or (cfg.head_dim and s == 1 / math.sqrt(cfg.head_dim)) else s


def scaled(cfg) -> list[str]:
    """The multipliers of `cfg` away from their plain values, as 'name=value'."""
    got = {k: getattr(cfg, k) for k in MULTIPLIERS} | {"attention_scale": plain_attention_scale(cfg)}
    return [f"{k}={getattr(cfg, k)}" for k, plain in MULTIPLIERS.items() if got[k] != plain]


@dataclass(frozen=True)
class Family:
    """name: transformers' model_type; arch: its CausalLM class; depth: our layers per HF decoder layer
    (depth pruning removes them together); moe: its layers hold routed experts (an upcycling target);
    mtp: it stores MTP layers; routers: the upcycling routers it can hold exactly; shared_expert_gate: its
    shared expert is scaled by sigmoid(w.x); hidden_divides_heads: transformers' config requires hidden
    to be a multiple of the query heads; block_types: its config's per-layer type names, as our layer kinds;
    multipliers: it holds embedding_multiplier, residual_multiplier, attention_scale and logits_scaling
    (every other family needs them at their defaults)."""
    name: str
    arch: str
    depth: int = 1
    moe: bool = False
    mtp: bool = False
    routers: tuple = ()
    shared_expert_gate: bool = False
    hidden_divides_heads: bool = False
    block_types: dict = field(default_factory=dict)
    multipliers: bool = False  # its config holds ModelConfig's scalar multipliers (embedding, residual, ...)
    upcycle_help: str = "no upcycling"  # the default upcycling target of a source of this family, in words  # HF per-layer type names -> our pattern characters

    # ---- HF config ---------------------------------------------------------------------
    def required(self, h) -> list:
        """Shape-defining config.json fields beyond vocab and hidden size (each a tuple of alternatives)."""
        return []

    def from_hf(self, h, extra: dict):
        """ModelConfig of transformers' config object `h` (extra: HF fields carried through)."""
        raise NotImplementedError

    def check(self, cfg, need) -> None:
        """need(ok, why) for everything the family cannot represent exactly."""

    def to_hf(self, cfg) -> dict:
        """The family's own config.json fields of `cfg` (vocab, hidden, ties and passthroughs are added by models.hf)."""
        raise NotImplementedError

    # ---- tensors -------------------------------------------------------------------------
    def key_map(self) -> dict:
        """{our name pattern: HF name pattern, or a Part of one} (models.hf_adapter reads it both ways)."""
        raise NotImplementedError

    def extra_tensors(self, cfg) -> dict:
        """{our name: shape} the family's checkpoint holds but our model lacks (written as zeros)."""
        return {}

    def depth_units(self, cfg) -> list:
        """The family's decoder layers as lists of our layer indices (removed together by depth pruning)."""
        d = self.depth
        return [list(range(j * d, (j + 1) * d)) for j in range(cfg.num_layers // d)]

    # ---- what it becomes -------------------------------------------------------------------
    def claims(self, cfg) -> bool:
        """Whether this family is the default export of `cfg` (asked in models.families.DEFAULT_ORDER)."""
        return False

    def upcycle_router(self) -> str:
        """The router upcycling uses by default for a source of this family."""
        return "topk-softmax"

    def upcycle_into(self, cfg, router: str, shared: int) -> str:
        """The MoE family a dense source of this family upcycles into by default."""
        raise NotImplementedError(f"{self.name} has no default upcycling target")

    def upcycle_check(self, cfg, router: str) -> str | None:
        """Why an upcycled `cfg` with `router` cannot be held exactly by this (MoE) family; None: it can."""
        if router not in self.routers:
            return f"{self.name} holds the routers {', '.join(self.routers)}, not {router}"
        return None


@dataclass(frozen=True)
class Part:
    """A key-map value (and what `to_hf_part` returns): our tensor is part `index` of `count` equal parts,
    along our tensor's dimension `dim`, of the HF tensor `name`, which concatenates them in index order.
    A plain tensor is part 0 of 1."""
    name: str
    dim: int = 0
    index: int = 0
    count: int = 1

    def narrow(self, hf_tensor, expert: int | None = None):
        """Our part of the HF tensor (of one expert's HF tensor when `expert` is given: dim counts ours)."""
        if self.count == 1:
            return hf_tensor
        d = self.dim - (expert is not None)
        size = hf_tensor.shape[d] // self.count
        return hf_tensor.narrow(d, self.index * size, size)

    def hf_shape(self, shape: tuple, expert: int | None = None) -> tuple:
        """The HF tensor's shape given our part's `shape` (one expert's, when `expert` is given)."""
        d = self.dim - (expert is not None)
        return tuple(n * self.count if k == d else n for k, n in enumerate(shape))
