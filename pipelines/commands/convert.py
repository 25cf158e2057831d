"""`remodel convert`: HF checkpoint -> shared model definition -> HF checkpoint, one tensor at a time."""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from remodel.models.checkpoint import (CheckpointReader, CheckpointWriter, atomic_output_dir, cast_for_output,
                                       output_format)
from remodel.models.errors import RemodelError
from remodel.models.families.tower import check_tower_at
from remodel.models.hf import FAMILIES, check_exportable, config_from_hf, config_to_hf, weight_table
from remodel.models.load import extra_hf_tensors, join_parts, passthrough_names, passthrough_tensors, source_plan

from .report import write_report


def source_shard_bytes(model_dir) -> int:
    """Shard size of the input when it is sharded (outputs keep its layout), else 2 GiB."""
    from pathlib import Path

    shards = list(Path(model_dir).glob("model-*-of-*.safetensors"))
    return max(f.stat().st_size for f in shards) if len(shards) > 1 else 2 * 1024**3


def _dcp_checkpoint(path: Path) -> Path | None:
    """The DCP training checkpoint at `path`: a step-N directory, or the newest one in an OUT.run/."""
    from ..training.train_state import META, STEP_DIR, latest_checkpoint
    if STEP_DIR.match(path.name) and (path / META).is_file():
        return path
    return latest_checkpoint(path) if path.is_dir() and any(path.glob(f"step-*/{META}")) else None


def _open_source(model_dir: Path):
    """-> (HF config dict, plan rows, aux-files folder or None, input label, HF reader or None) for a HF checkpoint
    or a DCP training checkpoint (`OUT.run/` or one of its step-N directories)."""
    ckpt = _dcp_checkpoint(model_dir)
    if ckpt is None:
        reader = CheckpointReader(model_dir)
        cfg = config_from_hf(reader.config)
        return reader.config, source_plan(reader, cfg), model_dir, cfg, reader  # validates every shape first
    from ..training.train_state import read_meta
    meta = read_meta(ckpt)
    hf = meta.get("hf_config")
    if hf is None:
        raise RemodelError(f"{ckpt}: training checkpoint without its model config (written by an older remodel)")
    cfg = config_from_hf(hf)
    rows = [(ours, e, r) for ours, e, r in _dcp_plan_rows(ckpt, cfg, hf["model_type"])]
    return hf, rows, _run_aux(ckpt), cfg, None


def _run_aux(ckpt: Path) -> Path | None:
    """The tokenizer files a training run copied into its checkpoint (train_state.AUX), or None (a run of
    an older remodel: no tokenizer is exported). A path recorded in meta.json is never followed: it could
    name any folder. Each file there must be a regular file, not a link out of the run."""
    import stat

    from remodel.models.checkpoint import AUX_FILES

    from ..training.train_state import AUX
    aux = ckpt / AUX
    if not aux.exists() and not aux.is_symlink():
        return None
    if not stat.S_ISDIR(aux.lstat().st_mode):
        raise RemodelError(f"{aux}: not a directory inside the checkpoint (a link out of the run?)")
    for name in AUX_FILES:
        f = aux / name
        if (f.exists() or f.is_symlink()) and not stat.S_ISREG(f.lstat().st_mode):
            raise RemodelError(f"{f}: not a regular file inside the checkpoint (a link out of the run?)")
    return aux


def _dcp_plan_rows(ckpt: Path, cfg, family: str):
    """Plan rows reading a DCP checkpoint; every tensor's stored shape is checked against the config
    (and its dtype for a float) before anything is read."""
    from remodel.models.hf import our_shapes

    from ..training.dcp_storage import RawReader
    from ..training.train_state import read_tensor
    src, cache = RawReader(ckpt), {}
    stored = src.read_metadata().state_dict_metadata
    for ours, shape in our_shapes(cfg).items():
        md = stored.get("model." + ours)
        if md is None or tuple(md.size) != tuple(shape) or not md.properties.dtype.is_floating_point:
            got = "missing" if md is None else f"{tuple(md.size)} {md.properties.dtype}"
            raise RemodelError(f"{ckpt}: tensor {ours!r} is {got}, its config wants a float of {tuple(shape)}")

    def reader(ours, e):
        def read():
            if ours not in cache:
                cache.clear()
                cache[ours] = read_tensor(ckpt, "model." + ours, src)
            return cache[ours] if e is None else cache[ours][e]
        return read
    return [(ours, e, reader(ours, e)) for ours, _, e in weight_table(cfg, family)]


def convert(model_dir, out, to: str | None = None, overwrite: bool = False, dtype=None,
            max_shard_bytes: int | None = None) -> dict:
    """MODEL (a HF checkpoint, or a DCP training checkpoint: OUT.run/ or its step-N) -> HF checkpoint in
    OUT, one tensor at a time."""
    t0 = time.time()
    model_dir = Path(model_dir)
    src_cfg, plan, aux_from, cfg, reader = _open_source(model_dir)
    max_shard_bytes = max_shard_bytes or source_shard_bytes(model_dir)
    src = src_cfg.get("model_type")
    family = to or src
    if family not in FAMILIES:
        raise RemodelError(f"unknown target {family!r} (supported: {', '.join(FAMILIES)})")
    check_exportable(cfg, family)
    hf_cfg = config_to_hf(cfg, family)
    carried = passthrough_names(aux_from, family)  # a family carrying tensors through: the source holds them
    if carried:  # a vision tower: transformers' names and shapes for its config, finite values; before writing
        check_tower_at(aux_from, cfg, family)
    rows = weight_table(cfg, family)  # same order as the plan: (our_name, expert) pairs line up
    with atomic_output_dir(out, overwrite=overwrite, inputs=[model_dir]) as tmp:
        fmt = output_format(reader, dtype) if reader is not None else None  # a quantized source's own format
        w = CheckpointWriter(tmp, max_shard_bytes=max_shard_bytes, fmt=fmt)
        progress = tqdm(zip(plan, rows, strict=True), total=len(rows), desc="convert", unit="tensor")

        def stream():
            for (ours, e, read), (ours2, hf, e2) in progress:
                if (ours, e) != (ours2, e2):
                    raise RemodelError(f"internal: tensor order mismatch ({ours} != {ours2})")
                t = read()
                yield ours, hf, e, cast_for_output(ours, t, dtype)
        for hf, t in join_parts(cfg, family, stream()):  # a family tensor made of several of ours: once, whole
            w.add(hf, t)
        for hf, shape in extra_hf_tensors(cfg, family).items():
            w.add(hf, torch.zeros(shape, dtype=dtype or torch.float32))
        for hf, t in passthrough_tensors(aux_from, carried):  # as stored (a vision tower: byte-identical)
            w.add(hf, t)
        n = len(rows)
        w.close(hf_cfg, aux_from=aux_from)
        report = {"command": "convert", "input": str(model_dir), "output": str(out), "from": src, "to": family,
                  "tensors_written": n, "bytes_written": w.total_size, "seconds": round(time.time() - t0, 3)}
        write_report(tmp, report)
    return report
