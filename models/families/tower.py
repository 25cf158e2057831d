"""A family whose checkpoints hold another family's text model beside tensors remodel carries through untouched
(a vision tower and its merger: transformers' ForConditionalGeneration models).

The text model's config sits under one config.json key (`nested`), its tensors under a longer name prefix
(`prefix`); every other config field is kept in the model config's `extra` (OUTER) and written back around the
(possibly pruned) text model's; the `passthrough` tensors are copied byte-identical from the source checkpoint
(models.load.passthrough_tensors). Fields the tower fixes (`feeds`: the merger's output is the hidden size)
cannot change: an export that changes one is refused in one line naming why.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from functools import lru_cache

from .family import Family, Part

OUTER = "outer_config"  # ModelConfig.extra key: the checkpoint's config.json without the text model's config
_COPIED = ("depth", "moe", "mtp", "routers", "shared_expert_gate", "hidden_divides_heads", "mamba_width_from_hidden",
           "block_types", "multipliers", "projections", "raw", "variants", "padding_idx")


def outer_value(cfg, path: str):
    """The value at dotted `path` ("vision_config.out_hidden_size") of the model's outer config, None if absent."""
    v = cfg.extra.get(OUTER)
    for k in path.split("."):
        v = v.get(k) if isinstance(v, dict) else None
    return v


@dataclass(frozen=True)
class WithTower(Family):
    """text: the family of the text model; prefix: (its HF name prefix, this family's); tower: the outer config's
    key of the tower's own config (its parameters counted by transformers' class for it); feeds:
    {our field: outer config path that must equal it}; why: what the tower does with those fields, in words."""
    text: Family | None = None
    prefix: tuple = ("model.", "model.language_model.")
    tower: str = ""
    feeds: dict | None = None
    why: str = ""
    upcycles_to: str = ""

    @classmethod
    def around(cls, text: Family, name: str, arch: str, **kw) -> "WithTower":
        """The family `name` of checkpoints holding `text`'s model: its structure flags copied from `text`."""
        return cls(name, arch, text=text, **{k: getattr(text, k) for k in _COPIED}, **kw)

    def from_hf(self, h, extra):
        """The text model's config (transformers ties the lm_head by the outer config's flag)."""
        cfg = self.text.from_hf(getattr(h, self.nested), extra)
        return cfg.replace(tie_word_embeddings=bool(h.tie_word_embeddings))

    def check(self, cfg, need):
        self.text.check(cfg, need)
        need(isinstance(cfg.extra.get(OUTER), dict) and isinstance(cfg.extra[OUTER].get(self.tower), dict),
             f"its checkpoints hold a {self.tower.split('_')[0]} tower this model was not read with "
             f"(read a {self.name} checkpoint, or export the text model to {self.text.name})")
        for field, path in (self.feeds or {}).items():
            v = outer_value(cfg, path)
            need(getattr(cfg, field) == v, f"{self.why} ({path}={v}) and the tower passes through unpruned: "
                                           f"{field} must stay {v}, got {getattr(cfg, field)}")

    def fixed_fields(self, cfg) -> tuple:
        return tuple(self.feeds or ())

    def key_map(self):
        """The text family's map, its HF names under this family's prefix (the lm_head's stays)."""
        old, new = self.prefix

        def moved(v):
            if isinstance(v, Part):
                return replace(v, name=moved(v.name))
            return new + v[len(old):] if v.startswith(old) else v
        return {k: moved(v) for k, v in self.text.key_map().items()}

    def extra_tensors(self, cfg):
        return self.text.extra_tensors(cfg)

    def depth_units(self, cfg):
        return self.text.depth_units(cfg)

    def passthrough_params(self, cfg) -> int:
        """The tower's parameters as transformers builds it from its config (0 where the model has none)."""
        sub = (cfg.extra.get(OUTER) or {}).get(self.tower)
        return _tower_params(json.dumps(sub, sort_keys=True)) if isinstance(sub, dict) else 0

    def upcycle_router(self):
        return self.text.upcycle_router()

    def upcycle_into(self, cfg, router, shared):
        self.text.upcycle_into(cfg, router, shared)  # the text model's refusal, if it has no target
        return self.upcycles_to or super().upcycle_into(cfg, router, shared)

    def upcycle_check(self, cfg, router):
        return self.text.upcycle_check(cfg, router)


@lru_cache(maxsize=16)
def _tower_params(sub: str) -> int:
    """Parameters of transformers' model of the config JSON `sub`, built on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModel
    d = json.loads(sub)
    with torch.device("meta"):
        m = AutoModel.from_config(AutoConfig.for_model(d.pop("model_type"), **d))
    return sum(p.numel() for p in m.parameters())


assert {f.name for f in fields(Family)} >= set(_COPIED)
