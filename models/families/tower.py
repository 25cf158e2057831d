"""A family whose checkpoints hold another family's text model beside tensors remodel carries through untouched
(a vision tower and its merger: transformers' ForConditionalGeneration models).

The text model's config sits under one config.json key (`nested`), its tensors under a longer name prefix
(`prefix`); every other config field is kept in the model config's `extra` (OUTER) and written back around the
(possibly pruned) text model's; the `passthrough` tensors are copied byte-identical from the source checkpoint
(models.load.passthrough_tensors). Fields the tower fixes (`feeds`: the merger's output is the hidden size)
cannot change: an export that changes one is refused in one line naming why, and a config where one differs
already (a merger projecting into another width than the text model's) is refused when read.

The tower is checked before anything is written (check_tower): its tensors are those transformers' own class
for the tower's config builds (on the meta device: names and shapes), and finite.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
from dataclasses import dataclass, fields, replace
from functools import lru_cache

from remodel.models.errors import RemodelError

from .family import Family, Part

OUTER = "outer_config"  # ModelConfig.extra key: the checkpoint's config.json without the text model's config
_COPIED = ("depth", "moe", "mtp", "routers", "shared_expert_gate", "width_rules",
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
        """The text model's config (transformers ties the lm_head by the outer config's flag); refused when a
        field the tower fixes (`feeds`, as transformers reads it) differs from the text model's."""
        cfg = self.text.from_hf(getattr(h, self.nested), extra)
        for field, path in (self.feeds or {}).items():
            v = h
            for k in path.split("."):
                v = getattr(v, k, None)
            if v != cfg.get(field):
                raise RemodelError(f"{path}={v} differs from the text model's {field} {cfg.get(field)}, and "
                                   f"{self.why}: they must be equal")
        return cfg.replace(tie_word_embeddings=bool(h.tie_word_embeddings))

    def check(self, cfg, need):
        self.text.check(cfg, need)
        need(isinstance(cfg.extra.get(OUTER), dict) and isinstance(cfg.extra[OUTER].get(self.tower), dict),
             f"its checkpoints hold a {self.tower.split('_')[0]} tower this model was not read with "
             f"(read a {self.name} checkpoint, or export the text model to {self.text.name})")
        for field, path in (self.feeds or {}).items():
            v = outer_value(cfg, path)
            need(cfg.get(field) == v, f"{self.why} ({path}={v}) and the tower passes through unpruned: "
                                           f"{field} must stay {v}, got {cfg.get(field)}")

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
        return sum(map(math.prod, _tower_model(json.dumps(sub, sort_keys=True))[0].values())) \
            if isinstance(sub, dict) else 0

    def check_tower(self, reader, cfg):
        """The tower tensors of checkpoint `reader` (a CheckpointReader) are exactly those transformers' class
        for the tower's config builds (every name, every shape) and hold no NaN or inf; a one-line
        RemodelError naming the first that is not (read before anything is written)."""
        sub = (cfg.extra.get(OUTER) or {}).get(self.tower)
        if not isinstance(sub, dict) or not self.passthrough:
            return
        import torch
        prefix, where = self.passthrough[0], reader.path
        params, buffers = _tower_model(json.dumps(sub, sort_keys=True))
        want = {prefix + k: v for k, v in {**buffers, **params}.items()}  # a persistent buffer may be left out
        have = {k: tuple(reader.shape(k)) for k in reader.keys() if k.startswith(self.passthrough)}
        missing, unknown = sorted(prefix + k for k in params if prefix + k not in have), sorted(set(have) - set(want))
        if missing:
            raise RemodelError(f"{where}: tower tensor {missing[0]!r} is missing ({len(missing)} of the {len(params)} "
                               f"its {self.tower} builds in transformers)")
        if unknown:
            raise RemodelError(f"{where}: tower tensor {unknown[0]!r} is not one transformers builds from its "
                               f"{self.tower} ({len(unknown)} such)")
        for k in sorted(have):
            if have[k] != want[k]:
                raise RemodelError(f"{where}: tower tensor {k!r} has shape {list(have[k])}, its {self.tower} "
                                   f"builds {list(want[k])} in transformers")
        for k in sorted(have):
            t = reader.get(k)
            if t.is_floating_point():
                seen = t.float() if t.element_size() == 1 else t  # float8: no isfinite kernel
                bad = int((~torch.isfinite(seen)).sum())
                if bad:
                    raise RemodelError(f"{where}: tower tensor {k!r} holds {bad} non-finite value(s) (NaN or "
                                       "inf); nothing written")

    def upcycle_router(self):
        return self.text.upcycle_router()

    def upcycle_into(self, cfg, router, shared):
        self.text.upcycle_into(cfg, router, shared)  # the text model's refusal, if it has no target
        return self.upcycles_to or super().upcycle_into(cfg, router, shared)

    def upcycle_check(self, cfg, router):
        return self.text.upcycle_check(cfg, router)


def _with_tower(family: str):
    """The family `family` when it carries a vision tower through (WithTower), else None."""
    from . import FAMILIES
    fam = FAMILIES.get(family)
    return fam if isinstance(fam, WithTower) else None


def check_tower(reader, cfg, family: str):
    """The tower of checkpoint `reader` checked (WithTower.check_tower) when `family` carries one through;
    nothing for any other family."""
    if (fam := _with_tower(family)) is not None:
        fam.check_tower(reader, cfg)


def check_tower_at(model_dir, cfg, family: str):
    """check_tower on the checkpoint in model_dir, opened only when `family` carries a tower through."""
    if (fam := _with_tower(family)) is not None:
        from remodel.models.checkpoint import CheckpointReader
        with CheckpointReader(model_dir) as reader:
            fam.check_tower(reader, cfg)


@contextlib.contextmanager
def _quiet_modeling_import():
    """transformers' modeling code imports torchao when it is installed (for its quantizer): torchao logs a
    warning for each compiled extension this torch cannot load, and torch's pytree one for each Enum torchao
    registers. Noise for a tower built on the meta device (the text families never import it): those two
    loggers keep their errors only, while it is imported."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@lru_cache(maxsize=16)
def _tower_model(sub: str) -> tuple[dict, dict]:
    """({parameter: shape}, {persistent buffer: shape}) of transformers' model of the config JSON `sub`, built
    on the meta device (no memory)."""
    import torch
    with _quiet_modeling_import():
        from transformers import AutoConfig, AutoModel
        d = json.loads(sub)
        with torch.device("meta"):
            m = AutoModel.from_config(AutoConfig.for_model(d.pop("model_type"), **d))
    params = {k: tuple(v.shape) for k, v in m.named_parameters()}
    return params, {k: tuple(v.shape) for k, v in m.state_dict().items() if k not in params}


assert {f.name for f in fields(Family)} >= set(_COPIED)
