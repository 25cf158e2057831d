"""Checkpoint <-> model, through the per-family name table, one tensor at a time.

`iter_our_tensors` streams a HF checkpoint as our tensors (fused experts are assembled from their
per-expert rows); `iter_hf_tensors` streams our tensors out in a family's HF layout. Every shape is
checked against the config before it is used, so a mismatched checkpoint fails with one line.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import torch

from .checkpoint import CheckpointReader, cast_for_output
from .files import check_weight_dtype, read_json
from .config import ModelConfig
from .errors import RemodelError
from .families import FAMILIES
from .hf import config_from_hf, config_to_hf, default_family, our_shapes, to_hf_name, weight_table
from . import mxfp4
from .hf_adapter import to_hf_part
from .model import HybridLM


def read_config_dict(path) -> dict:
    """config.json from a checkpoint directory or a config.json path (no weights needed)."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.exists():
        raise RemodelError(f"no config.json at {path}")
    return read_json(f)


def load_config(path) -> ModelConfig:
    """The ModelConfig of a checkpoint or config.json; MTP layers only when the weights have them."""
    d = read_config_dict(path)
    if d.get("num_nextn_predict_layers") and Path(path).is_dir() and any(Path(path).glob("model*.safetensors*")):
        with CheckpointReader(path) as r:
            d = r.config
    return config_from_hf(d)


class _Source:
    """Finds each HF tensor in a checkpoint whatever its on-disk variant (backbone./model. prefix,
    per-expert or fused 3-D experts)."""

    def __init__(self, reader: CheckpointReader):
        self.r = reader
        self.keys = set(reader.keys())

    def _alias(self, name: str) -> str | None:
        if name in self.keys:
            return name
        if name.startswith("backbone.") and "model." + name[9:] in self.keys:
            return "model." + name[9:]
        return None

    def shape_and_get(self, hf: str, expert: int | None):
        k = self._alias(hf)
        if k is not None:
            check_weight_dtype(self.r.path, k, self.r.dtype(k))
            return tuple(self.r.shape(k)), (lambda: self.r.get(k))
        if (packed := mxfp4.shape_and_get(self.r, hf)) is not None:  # MXFP4 *_blocks / *_scales (gpt-oss)
            return packed
        if expert is not None:  # fused 3-D expert tensor, e.g. mixer.experts.up_proj
            base, leaf = hf.split(f".{expert}.", 1)
            fused = self._alias(base + "." + leaf.rsplit(".weight", 1)[0])
            if fused is not None:
                check_weight_dtype(self.r.path, fused, self.r.dtype(fused))
                shape = tuple(self.r.shape(fused))
                return shape[1:], (lambda: self.r.get(fused)[expert])
        raise RemodelError(f"checkpoint {self.r.path} has no tensor {hf!r}")


def _plan_row(src: _Source, shapes: dict, cfg: ModelConfig, family: str, ours: str, hf: str, e: int | None):
    """(None, read()) of one weight_table row, or (why its stored shape is wrong, None). A row whose HF
    tensor concatenates several of ours (models.hf_adapter.Part) reads its own part of it."""
    part = to_hf_part(cfg, family, ours, e)
    alt = FAMILIES[family].other_spelling(hf)
    if alt is not None and src._alias(hf) is None and src._alias(alt) is not None:
        hf = alt  # the name as the family's released checkpoints spell it (Family.other_spelling)
    shape, get = src.shape_and_get(hf, e)
    want = part.hf_shape(shapes[ours][1:] if e is not None else shapes[ours], e)
    if tuple(shape) != tuple(want):
        group = FAMILIES[family].regrouped(ours, hf)
        get = group and _regrouped(src, shapes, ours, *group)
        return (None, get) if get else (f"{hf} has shape {list(shape)} but the config implies {list(want)}", None)
    return None, (get if part.whole else lambda: part.narrow(get(), e).clone(memory_format=torch.contiguous_format))


def _regrouped(src: _Source, shapes: dict, ours: str, our_names: list, hf_names: list) -> Callable | None:
    """read() of our tensor `ours` as its rows of the concatenation of `hf_names` (Family.regrouped); None
    where those do not concatenate to our group's shape."""
    got = [src.shape_and_get(h, None) for h in hf_names]
    sizes, rest = [shapes[o][0] for o in our_names], tuple(shapes[ours][1:])
    if any(tuple(s[1:]) != rest for s, _ in got) or sum(s[0] for s, _ in got) != sum(sizes):
        return None
    start = sum(sizes[:our_names.index(ours)])
    return lambda: torch.cat([g() for _, g in got]).narrow(0, start, shapes[ours][0]).clone()


def source_plan(reader: CheckpointReader, cfg: ModelConfig, family: str | None = None,
                names: set[str] | None = None) -> list[tuple[str, int | None, Callable]]:
    """Rows (our_name, expert_index|None, read()) of the checkpoint in table order. Every shape is
    checked against the config here, before any data is read; `names` restricts the rows."""
    family = family or reader.config.get("model_type")
    shapes = our_shapes(cfg)
    src = _Source(reader)
    plan = []
    for ours, hf, e in weight_table(cfg, family):
        if names is not None and ours not in names:
            continue
        bad, get = _plan_row(src, shapes, cfg, family, ours, hf, e)
        if bad:
            raise RemodelError(f"tensor {bad}")
        plan.append((ours, e, get))
    return plan


def shape_mismatches(reader: CheckpointReader, cfg: ModelConfig, family: str | None = None) -> list[str]:
    """Every tensor the config implies that the checkpoint lacks or holds in another shape, as one
    short sentence each (source_plan stops at the first; inspect lists them all). Reads no data."""
    family = family or reader.config.get("model_type")
    shapes, src, bad = our_shapes(cfg), _Source(reader), []
    for ours, hf, e in weight_table(cfg, family):
        try:
            why, _ = _plan_row(src, shapes, cfg, family, ours, hf, e)
        except RemodelError:
            why = f"{hf} is missing"
        if why and why not in bad:
            bad.append(why)
    return bad


def iter_our_tensors(reader: CheckpointReader, cfg: ModelConfig, family: str | None = None,
                     names: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (our_name, tensor) in table order (per-expert rows stacked into fused tensors).
    Shapes are validated when this is called, before any data is read."""
    return _assemble(source_plan(reader, cfg, family, names))


def _assemble(plan):
    i = 0
    while i < len(plan):
        ours, e, get = plan[i]
        if e is None:
            yield ours, get()
            i += 1
            continue
        parts = []
        while i < len(plan) and plan[i][0] == ours:
            parts.append(plan[i][2]())
            i += 1
        yield ours, torch.stack(parts)


def load_model(path, dtype=torch.float32, device="cpu") -> HybridLM:
    """Whole model in memory (for models that fit; streaming paths use iter_our_tensors)."""
    reader = CheckpointReader(path)
    cfg = config_from_hf(reader.config)
    with torch.device("meta"):
        model = HybridLM(cfg)
    state = {k: v.to(dtype=dtype if v.is_floating_point() else v.dtype, device=device)
             for k, v in iter_our_tensors(reader, cfg)}
    for name, buf in model.named_buffers():
        if name not in state:  # non-persistent buffers (RoPE frequencies) are rebuilt
            state[name] = None
    model.load_state_dict({k: v for k, v in state.items() if v is not None}, strict=False, assign=True)
    _materialise_buffers(model, device)
    _keep_fp32(model)
    return model.eval()


def _materialise_buffers(model: HybridLM, device):
    model.init_buffers(device)
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        raise RemodelError(f"checkpoint is missing tensors: {missing[:3]}")


def _blocks(model: HybridLM) -> list:
    """The trunk's blocks and the MTP head's (when the model has one)."""
    return list(model.layers) + (list(model.mtp.layers) if hasattr(model, "mtp") else [])


def _keep_fp32(model: HybridLM):
    for m in [b.mixer for b in _blocks(model) if b.spec.routed]:
        if hasattr(m.gate, "e_score_correction_bias"):
            m.gate.e_score_correction_bias.data = m.gate.e_score_correction_bias.data.float()


def extra_hf_tensors(cfg: ModelConfig, family: str) -> dict[str, tuple]:
    """{HF name: shape} of the tensors the family needs but our model lacks (its spec's extra_tensors,
    e.g. a size-1 zero shared expert standing for 'none'), named through the key map."""
    return {to_hf_name(cfg, family, ours): shape for ours, shape in FAMILIES[family].extra_tensors(cfg).items()}


def head_copy(cfg: ModelConfig, family: str) -> tuple[str, str] | None:
    """(HF name of the embedding, HF name of lm_head) where tied `cfg` exports to a family whose transformers class
    never ties (Family.ties_head False): every writer (join_parts) stores lm_head as a copy of the embedding, else
    transformers builds a random head. config.json keeps tie_word_embeddings true, so remodel reads the model back
    tied (round trips exact; count_params' total is ours, hf_total counts the copy), a stored head unread, as it
    always was (transformers' own save of a tied model stores its random head: tests/data/legacy). None: no copy."""
    if not cfg.tie_word_embeddings or FAMILIES[family].ties_head:
        return None
    return to_hf_name(cfg, family, "embeddings.weight"), to_hf_name(cfg, family, "lm_head.weight")


def join_parts(cfg: ModelConfig, family: str, rows) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) of rows (our_name, hf_name, expert or None, our tensor or its expert's) in
    weight_table order: an HF tensor that concatenates several of ours (models.hf_adapter.Part) comes
    once, joined, when its last part has come; every other row passes as it is, the embedding followed by
    its copy as lm_head where the family cannot tie (head_copy): the one place every writer passes."""
    parts, copy = {}, head_copy(cfg, family)
    for ours, hf, e, t in rows:
        part = to_hf_part(cfg, family, ours, e)
        if not part.whole:
            got = parts.setdefault(hf, [None] * part.count)
            got[part.index] = t
            if any(x is None for x in got):
                continue
            t = part.join(parts.pop(hf), part.dim - (e is not None))
        yield hf, t
        if copy and hf == copy[0]:
            yield copy[1], t.clone()
    if parts:
        raise RemodelError(f"internal: HF tensors left without all their parts: {sorted(parts)[:3]}")


def passthrough_names(source, family: str) -> list[str]:
    """The tensors of checkpoint `source` (a directory or an open CheckpointReader) that `family` carries through
    byte-identical (Family.passthrough: a vision tower and its merger); [] for a family without any. One line
    when the family has them and `source` holds none (nothing written yet)."""
    prefixes = FAMILIES[family].passthrough
    if not prefixes:
        return []
    if source is None:
        raise RemodelError(f"{family} checkpoints hold tensors remodel carries through ({', '.join(prefixes)}*) "
                           f"from the source checkpoint, and none was given")
    reader = source if isinstance(source, CheckpointReader) else CheckpointReader(source)
    names = [k for k in reader.keys() if k.startswith(prefixes)]
    if not names:
        raise RemodelError(f"{reader.path} holds no {', '.join(prefixes)}* tensors, which {family} carries through "
                           f"from its source: export the text model to another family")
    return names


def passthrough_tensors(source, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor as stored) of the carried-through tensors `names` of `source` (passthrough_names)."""
    if names and isinstance(source, CheckpointReader):
        yield from ((k, source.get(k)) for k in names)
    elif names:
        with CheckpointReader(source) as reader:
            yield from ((k, reader.get(k)) for k in names)


def iter_hf_tensors(get: Callable[[str], torch.Tensor], cfg: ModelConfig, family: str,
                    dtype: torch.dtype | None = None, source=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) for a family, reading our tensors through `get(our_name)` once each, in
    weight_table order (join_parts: an HF tensor concatenating several of ours comes with its last part), then
    the tensors the family carries through from checkpoint `source` as stored (checked here, before any)."""
    names = passthrough_names(source, family)
    return _iter_hf_tensors(get, cfg, family, dtype, (source, names))


def _iter_hf_tensors(get, cfg: ModelConfig, family: str, dtype, carried) -> Iterator[tuple[str, torch.Tensor]]:
    def rows():
        cur_name, cur = None, None
        for ours, hf, e in weight_table(cfg, family):
            if ours != cur_name:
                cur_name, cur = ours, get(ours)
            t = cur if e is None else cur[e]
            if not isinstance(t, torch.Tensor):  # a lazy [E, ...] sequence (upcycling's experts), stored whole
                t = torch.stack([t[i] for i in range(len(t))])
            yield ours, hf, e, cast_for_output(ours, t, dtype)

    for hf, t in join_parts(cfg, family, rows()):
        yield hf, t.contiguous()
    for hf, shape in extra_hf_tensors(cfg, family).items():
        yield hf, torch.zeros(shape, dtype=dtype or torch.float32)
    yield from passthrough_tensors(*carried)


def save_model(model: HybridLM, out, family: str | None = None, aux_from=None, overwrite=False,
               dtype=None, max_shard_bytes: int = 2 * 1024**3, inputs=()) -> Path:
    """Write a HF checkpoint atomically (temporary sibling renamed at the end); a family that carries tensors
    through takes them from `aux_from` (the source checkpoint)."""
    cfg = model.cfg
    family = family or default_family(cfg)
    state = model.state_dict()
    tensors = iter_hf_tensors(lambda n: state[n].detach().cpu(), cfg, family, dtype, source=aux_from)
    return write_hf(out, tensors, config_to_hf(cfg, family), dtype, aux_from, overwrite, inputs, max_shard_bytes)


def write_hf(out, tensors, hf_cfg: dict, dtype=None, aux_from=None, overwrite=False, inputs=(),
             max_shard_bytes: int = 2 * 1024**3) -> Path:
    """The (HF name, tensor) stream `tensors` and config.json `hf_cfg` written atomically to `out` (a temporary
    sibling renamed at the end), `dtype` named in the config where given; the tokenizer files from `aux_from`."""
    from .checkpoint import CheckpointWriter, atomic_output_dir

    with atomic_output_dir(out, overwrite=overwrite, inputs=inputs) as tmp:
        w = CheckpointWriter(tmp, max_shard_bytes=max_shard_bytes)
        for name, t in tensors:
            w.add(name, t)
        if dtype is not None:
            hf_cfg["dtype"] = str(dtype).replace("torch.", "")
        w.close(hf_cfg, aux_from=aux_from)
    return Path(out)
