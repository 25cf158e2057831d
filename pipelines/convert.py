"""`remodel convert`: HF checkpoint -> shared model definition -> HF checkpoint, one tensor at a time."""
from __future__ import annotations

import time

from models.checkpoint import CheckpointReader, CheckpointWriter, atomic_output_dir
from models.errors import RemodelError
from models.hf import FAMILIES, check_exportable, config_from_hf, config_to_hf
from models.load import iter_hf_tensors, iter_our_tensors

from .report import write_report


def stream_getter(it):
    """Turn an ordered stream of (our_name, tensor) into the `get(name)` that iter_hf_tensors calls
    in the same order, so one tensor (one fused expert stack) is in memory at a time."""
    def get(name):
        got, t = next(it)
        if got != name:
            raise RemodelError(f"internal: tensor order mismatch ({got} != {name})")
        return t
    return get


def convert(model_dir, out, to: str | None = None, overwrite: bool = False, dtype=None,
            max_shard_bytes: int = 2 * 1024**3) -> dict:
    t0 = time.time()
    reader = CheckpointReader(model_dir)
    src = reader.config.get("model_type")
    cfg = config_from_hf(reader.config)
    family = to or src
    if family not in FAMILIES:
        raise RemodelError(f"unknown target {family!r} (supported: {', '.join(FAMILIES)})")
    check_exportable(cfg, family)
    hf_cfg = config_to_hf(cfg, family)
    tensors = iter_our_tensors(reader, cfg)  # validates every shape before reading data
    with atomic_output_dir(out, overwrite=overwrite, inputs=[model_dir]) as tmp:
        w = CheckpointWriter(tmp, max_shard_bytes=max_shard_bytes)
        n = 0
        for name, t in iter_hf_tensors(stream_getter(tensors), cfg, family, dtype):
            w.add(name, t)
            n += 1
        w.close(hf_cfg, aux_from=model_dir)
        report = {"command": "convert", "input": str(model_dir), "output": str(out), "from": src, "to": family,
                  "tensors_written": n, "bytes_written": w.total_size, "seconds": round(time.time() - t0, 3)}
        write_report(tmp, report)
    return report
