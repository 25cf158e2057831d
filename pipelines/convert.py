"""`remodel convert`: HF checkpoint -> shared model definition -> HF checkpoint, one tensor at a time."""
from __future__ import annotations

import time

import torch
from tqdm import tqdm

from models.checkpoint import CheckpointReader, CheckpointWriter, atomic_output_dir
from models.errors import RemodelError
from models.hf import FAMILIES, check_exportable, config_from_hf, config_to_hf, weight_table
from models.load import extra_hf_tensors, source_plan

from .report import write_report


def source_shard_bytes(model_dir) -> int:
    """Shard size of the input when it is sharded (outputs keep its layout), else 2 GiB."""
    from pathlib import Path

    shards = list(Path(model_dir).glob("model-*-of-*.safetensors"))
    return max(f.stat().st_size for f in shards) if len(shards) > 1 else 2 * 1024**3


def convert(model_dir, out, to: str | None = None, overwrite: bool = False, dtype=None,
            max_shard_bytes: int | None = None) -> dict:
    t0 = time.time()
    reader = CheckpointReader(model_dir)
    max_shard_bytes = max_shard_bytes or source_shard_bytes(model_dir)
    src = reader.config.get("model_type")
    cfg = config_from_hf(reader.config)
    family = to or src
    if family not in FAMILIES:
        raise RemodelError(f"unknown target {family!r} (supported: {', '.join(FAMILIES)})")
    check_exportable(cfg, family)
    hf_cfg = config_to_hf(cfg, family)
    plan = source_plan(reader, cfg)  # validates every shape before reading data
    rows = weight_table(cfg, family)  # same order as the plan: (our_name, expert) pairs line up
    with atomic_output_dir(out, overwrite=overwrite, inputs=[model_dir]) as tmp:
        w = CheckpointWriter(tmp, max_shard_bytes=max_shard_bytes)
        progress = tqdm(zip(plan, rows, strict=True), total=len(rows), desc="convert", unit="tensor")
        for (ours, e, read), (ours2, hf, e2) in progress:
            if (ours, e) != (ours2, e2):
                raise RemodelError(f"internal: tensor order mismatch ({ours} != {ours2})")
            t = read()
            w.add(hf, t.to(dtype) if dtype is not None and t.is_floating_point()
                  and not ours.endswith("e_score_correction_bias") else t)
        for hf, shape in extra_hf_tensors(cfg, family).items():
            w.add(hf, torch.zeros(shape, dtype=dtype or torch.float32))
        n = len(rows)
        w.close(hf_cfg, aux_from=model_dir)
        report = {"command": "convert", "input": str(model_dir), "output": str(out), "from": src, "to": family,
                  "tensors_written": n, "bytes_written": w.total_size, "seconds": round(time.time() - t0, 3)}
        write_report(tmp, report)
    return report
