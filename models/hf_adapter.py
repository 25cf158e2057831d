"""Tensor names between our model and each Hugging Face family: one declarative key map per family
(its module in models/families says it).

`KEY_MAPS[family]` maps our parameter names to the family's checkpoint names, with placeholders:
`{i}` a layer index kept as is; `{a}` / `{m}` our layer 2j / 2j+1 (the attention / MLP-or-MoE half
of a Llama-family decoder layer j: HF has one index j for both); `{s}` / `{t}` the same halves of our MTP block
2j / 2j+1, which HF numbers after the trunk's decoder layers (L + j, DeepSeek / GLM's `model.layers.{L}`);
`{e}` an expert, on the HF side only
(our routed experts are fused [E, ...] tensors that HF stores one tensor per expert; a map without `{e}`
names a fused HF tensor [E, ...] stored whole). A value may also be a `Part`: the HF tensor concatenates
several of ours along one dimension (granite's fused gate/up projections), ours is one equal part of it.
Those are the only transforms that need code. `to_hf_name` / `to_hf_part` and `from_hf_name` read the
same map in opposite directions, so export is the exact inverse of import (tests/test_hf_adapter.py).
"""
from __future__ import annotations

import re
from dataclasses import replace
from functools import lru_cache

from .config import ModelConfig
from .errors import RemodelError
from .families import FAMILIES
from .families.family import Part
from .kinds import KINDS
from .layout import shapes


# (cfg, our index) -> HF index (None: not this placeholder's layer), (cfg, HF index) -> our index (None: not ours)
_INDEX = {"i": (lambda c, n: n, lambda c, n: n),
          "a": (lambda c, n: n // 2 if n % 2 == 0 else None, lambda c, j: 2 * j),
          "m": (lambda c, n: n // 2 if n % 2 == 1 else None, lambda c, j: 2 * j + 1),
          "s": (lambda c, n: _after(c) + n // 2 if n % 2 == 0 else None, lambda c, j: _mtp(c, j, 0)),
          "t": (lambda c, n: _after(c) + n // 2 if n % 2 == 1 else None, lambda c, j: _mtp(c, j, 1))}
_SLOT = re.compile(r"\{([iamste])\}")


def _after(cfg: ModelConfig) -> int:
    """The HF decoder layers of the trunk (two of our layers each): the first MTP layer's HF index."""
    return len(cfg.pattern) // 2


def _mtp(cfg: ModelConfig, j: int, half: int) -> int | None:
    """Our MTP block of half `half` of HF decoder layer j (None: j is a trunk layer)."""
    return 2 * (j - _after(cfg)) + half if j >= _after(cfg) else None


KEY_MAPS = {name: f.key_map() for name, f in FAMILIES.items()}  # each family's declarative map


class _Pattern:
    """One key-map pattern, matched and filled in on one side (ours or HF)."""

    def __init__(self, text: str):
        self.text = text
        self.slots = _SLOT.findall(text)
        parts = _SLOT.split(text)  # literal, slot, literal, slot, ..., literal
        self.regex = re.compile("".join(re.escape(p) if k % 2 == 0 else rf"(?P<{p}>\d+)"
                                        for k, p in enumerate(parts)))
        self.skeleton = _skeleton(_SLOT.sub("0", text))

    def match(self, name: str) -> dict[str, int] | None:
        m = self.regex.fullmatch(name)
        return None if m is None else {k: int(v) for k, v in m.groupdict().items()}

    def fill(self, values: dict[str, int]) -> str:
        return _SLOT.sub(lambda m: str(values[m.group(1)]), self.text)


def _skeleton(name: str) -> str:
    """A name with every number replaced: the bucket its candidate patterns are looked up in."""
    return re.sub(r"\d+", "#", name)


@lru_cache(maxsize=None)
def _compiled(family: str, side: int) -> dict[str, list[tuple[_Pattern, _Pattern, Part]]]:
    """{skeleton: [(pattern on `side`, pattern on the other side, the map's Part)]}; side 0: ours, 1: HF."""
    if family not in KEY_MAPS:
        raise RemodelError(f"unknown Hugging Face family {family!r} (supported: {', '.join(KEY_MAPS)})")
    out: dict[str, list] = {}
    for ours, hf in KEY_MAPS[family].items():
        part = hf if isinstance(hf, Part) else Part(hf)
        pair = (_Pattern(ours), _Pattern(part.name))
        src, dst = pair[side], pair[1 - side]
        out.setdefault(src.skeleton, []).append((src, dst, part))
    return out


def kind_view(cfg: ModelConfig, our_name: str):
    """What the key map of our tensor `our_name` reads of the config: its layer kind's view (that kind's sections
    and the trunk), or the config itself for a tensor of no layer (embeddings, norm_f, lm_head)."""
    parts = our_name.split(".")
    if parts[0] == "layers" and len(parts) > 2 and parts[1].isdigit() and int(parts[1]) < len(cfg.pattern):
        return cfg.view(KINDS[cfg.pattern[int(parts[1])]])
    if parts[:2] == ["mtp", "layers"] and len(parts) > 3 and parts[2].isdigit() and int(parts[2]) < len(
            cfg.mtp_full_pattern):
        return cfg.view(KINDS[cfg.mtp_full_pattern[int(parts[2])]])
    return cfg


def _check_expert(cfg, family: str, name: str, expert, wants: bool):
    if wants != (expert is not None):
        raise RemodelError(f"{family} tensor {name!r} {'needs' if wants else 'takes no'} expert index")
    n = (cfg.moe.n_routed_experts or 0) if cfg.reads("moe") else 0  # a layer of a kind without experts: none
    if wants and not 0 <= expert < n:
        raise RemodelError(f"expert {expert} of {name!r} is out of range (the layer has {n} experts)")


def _lookup(cfg: ModelConfig, family: str, our_name: str):
    """(HF pattern, its slot values, the map's Part) of our tensor `our_name`."""
    for ours, hf, part in _compiled(family, 0).get(_skeleton(our_name), ()):
        got = ours.match(our_name)
        if got is None:
            continue
        values = {k: _INDEX[k][0](cfg, v) for k, v in got.items()}
        if None in values.values():  # e.g. an odd layer index for an attention-half slot
            continue
        return hf, values, part
    raise RemodelError(f"{family} has no tensor for our {our_name!r}")


def to_hf_part(cfg: ModelConfig, family: str, our_name: str, expert: int | None = None) -> Part:
    """Where our tensor `our_name` (its expert `expert`, for a fused expert tensor that HF stores per
    expert) lies in the family's checkpoint: the HF tensor's name and, when that tensor concatenates
    several of ours, which part of it. RemodelError when the family has no such tensor."""
    hf, values, part = _lookup(cfg, family, our_name)
    own = kind_view(cfg, our_name)  # the tensor's kind reads its own sections (issue 54)
    _check_expert(own, family, our_name, expert, "e" in hf.slots)
    blocks = own.get(part.blocks) if isinstance(part.blocks, str) else part.blocks
    return replace(part, name=hf.fill({**values, "e": expert}), blocks=blocks,
                   sizes=_sibling_sizes(cfg, family, hf, values, part) if part.sized else ())


def _sibling_sizes(cfg: ModelConfig, family: str, hf, values: dict, part: Part) -> tuple:
    """The sizes along part.dim of every one of our tensors that the HF tensor concatenates, in part order."""
    have, sizes = shapes(cfg), [0] * part.count
    ours_values = {k: _INDEX[k][1](cfg, v) for k, v in values.items()}
    for entries in _compiled(family, 0).values():
        for ours, other, p in entries:
            if other.text == hf.text and p.count == part.count:
                name = ours.fill(ours_values)
                sizes[p.index] = have[name][part.dim] if name in have else 0
    return tuple(sizes)


def to_hf_name(cfg: ModelConfig, family: str, our_name: str, expert: int | None = None) -> str:
    """The family's checkpoint name of our tensor `our_name` (see to_hf_part)."""
    return to_hf_part(cfg, family, our_name, expert).name


def from_hf_name(cfg: ModelConfig, family: str, hf_name: str, part: int = 0) -> tuple[str, int | None]:
    """(our name, expert index or None) of part `part` of a checkpoint tensor of the family (0: a tensor
    that is one of ours): the inverse of to_hf_part. Where the map names one HF tensor from two of our
    layer kinds (granite's shared MLP is our dense MLP or the MoE's shared expert), the config picks."""
    cands = _compiled(family, 1).get(_skeleton(hf_name), ())
    found = []
    for hf, ours, p in cands:
        got = hf.match(hf_name)
        if got is None or p.index != part:
            continue
        expert = got.pop("e", None)
        values = {k: _INDEX[k][1](cfg, v) for k, v in got.items()}
        if None in values.values():  # e.g. a trunk layer's index for an MTP slot
            continue
        name = ours.fill(values)
        _check_expert(kind_view(cfg, name), family, hf_name, expert, "e" in hf.slots)
        found.append((name, expert))
    if len(found) > 1:
        have = shapes(cfg)
        found = [f for f in found if f[0] in have] or found
    if found:
        return found[0]
    raise RemodelError(f"{hf_name!r} is not a {family} tensor remodel knows" + (f" (part {part})" if part else ""))


def weight_table(cfg: ModelConfig, family: str) -> list[tuple[str, str, int | None]]:
    """Rows (our_name, hf_name, expert_index or None) covering every tensor of the HF checkpoint, in
    our storage order (models.layout), each fused expert tensor that HF stores per expert expanded into
    its experts in order. Import stacks a fused tensor's rows; export slices `ours[our_name][expert]`.
    Rows whose HF tensor concatenates several of ours share its name (to_hf_part says which part)."""
    rows = []
    for ours, shape in shapes(cfg).items():
        hf = _lookup(cfg, family, ours)[0]
        if "e" in hf.slots:  # fused [E, ...]: one HF tensor per expert
            rows += [(ours, to_hf_name(cfg, family, ours, e), e) for e in range(shape[0])]
        else:
            rows.append((ours, to_hf_name(cfg, family, ours), None))
    return rows
