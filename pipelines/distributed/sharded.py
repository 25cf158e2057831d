"""Sharded from load to export: no rank ever holds a full copy of a model.

`load_sharded` builds the model on the meta device, applies `parallelize` (TP / EP / FSDP2 over the
mesh) while it is still empty, allocates only this rank's shards and fills each from the safetensors
files with `models.regions.RegionReader` (safe_open(...).get_slice of exactly the rows, columns and
experts this rank owns). `local_index` says which region of the full tensor a rank's shard is: the
plain split of its spec (segments split separately, e.g. Mamba's in_proj) or its DTensor placements (TP's
stock styles), composed with FSDP2's dim-0 chunk over dp. `export_sharded` writes the HF checkpoint from a sharded model tensor by tensor:
each is gathered to rank 0, written, dropped (peak about one tensor above a rank's shard).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from remodel.models.checkpoint import CheckpointWriter, atomic_output_dir
from remodel.models.errors import RemodelError
from remodel.models.hf import config_to_hf, default_family, weight_table
from remodel.models.load import iter_hf_tensors
from remodel.models.model import HybridLM
from remodel.models.regions import RegionReader

from .collectives import group_rank, group_size
from .parallel import local_tensor, parallel_info, parallelize, sharded_dims, unshard_all
from .styles import shard_tensor


def local_index(model, name: str, t, full_shape) -> list:
    """Per dimension, None (all) or the LongTensor of full-tensor indices that this rank's shard of
    parameter `name` holds (its local tensor is full[idx0][:, idx1]...): a plain shard's split (ParallelInfo.specs,
    segments cut separately), then a DTensor's placements from the innermost mesh dimension out (TP's
    Shard, then FSDP2's dim-0 chunk of what TP left, Shard or _StridedShard alike)."""
    info = parallel_info(model)
    idx = [None] * len(full_shape)
    spec = info.specs.get(name)
    if spec is not None:
        kind, dim, sizes = spec
        g = info.tp_group if kind == "tp" else info.ep_group
        idx[dim] = shard_tensor(torch.arange(full_shape[dim]), 0, sizes, group_rank(g), group_size(g))
    dims = sharded_dims(t)
    coord = t.device_mesh.get_coordinate() if dims else None
    for i, d in reversed(dims):
        cur = idx[d] if idx[d] is not None else torch.arange(full_shape[d])
        parts = torch.chunk(cur, t.device_mesh.size(i))
        idx[d] = parts[coord[i]] if coord[i] < len(parts) else cur[:0]
    return idx


def local_part(full: torch.Tensor, idx: list) -> torch.Tensor:
    """full[idx] for a local_index (gathers along each restricted dimension)."""
    for d, i in enumerate(idx):
        if i is not None:
            full = full.index_select(d, i.to(full.device))
    return full


@torch.no_grad()
def load_sharded(path, mesh, tp_dim, ep_dim, dp_dim, device, layouts=None, prepare=None) -> tuple[HybridLM, dict]:
    """This rank's shards of the checkpoint at `path` as a parallelized HybridLM (fp32 weights).

    layouts: (tp_dim, ep_dim) pairs tried in order until the widths allow one (the teacher falls back
    from TP + EP to TP to none); prepare(model): applied to the empty model before it is sharded (e.g.
    the FP8 module swap); -> (model, {"tp": used, "ep": used})."""
    reader = RegionReader(path)
    tried = layouts or [(tp_dim, ep_dim)]
    for i, (t_tp, t_ep) in enumerate(tried):
        with torch.device("meta"):
            model = HybridLM(reader.cfg)
        if prepare is not None:
            prepare(model)
        try:
            parallelize(model, mesh, tp_dim=t_tp, ep_dim=t_ep, dp_dim=dp_dim)
            break
        except RemodelError:
            if i == len(tried) - 1:
                raise
    model.to_empty(device=device)
    state = dict(model.named_parameters())
    state.update(dict(model.named_buffers()))
    for name, t in state.items():
        if name not in reader.shapes:
            continue  # non-persistent buffers (RoPE) are rebuilt below
        idx = local_index(model, name, t, reader.shapes[name])
        local = local_tensor(t)
        part = reader.read(name, idx, dtype=local.dtype if local.is_floating_point() else torch.float32)
        if tuple(part.shape) != tuple(local.shape):
            raise AssertionError(f"{name}: region {tuple(part.shape)} != local shard {tuple(local.shape)}")
        local.copy_(part)
    missing = [n for n in state if n not in reader.shapes and "inv_freq" not in n]
    if missing:
        raise RemodelError(f"{path}: checkpoint is missing tensors: {missing[:3]}")
    model.init_buffers(device)
    reader.close()
    info = parallel_info(model)
    return model, {"tp": info.tp, "ep": info.ep}


def gather_tensor(model, name: str, t) -> torch.Tensor | None:
    """The full tensor `name` on rank 0 (None elsewhere). Collective: every rank calls it, same order."""
    return unshard_all(model, [(name, t)], rank0_only=True).get(name)


def export_sharded(model, out, family: str | None = None, aux_from=None, overwrite=False, dtype=None,
                   inputs=(), finish=None):
    """Write a (possibly parallelized) model as a HF checkpoint from rank 0, one gathered tensor at a
    time. Collective. finish(tmp): rank 0 adds its files (report, plots) before the atomic rename."""
    cfg = model.cfg
    family = family or default_family(cfg)
    state = model.state_dict()
    lead = not dist.is_initialized() or dist.get_rank() == 0

    def get(name):
        return gather_tensor(model, name, state[name])

    if not lead:  # the other ranks only take part in the gathers, in iter_hf_tensors' order
        last = None
        for ours, _, _ in weight_table(cfg, family):
            if ours != last:
                get(ours)
                last = ours
        return None
    hf_cfg = config_to_hf(cfg, family)
    with atomic_output_dir(out, overwrite=overwrite, inputs=inputs) as tmp:
        w = CheckpointWriter(tmp)
        for name, t in iter_hf_tensors(get, cfg, family, dtype, source=aux_from):
            w.add(name, t)
        if dtype is not None:
            hf_cfg["dtype"] = str(dtype).replace("torch.", "")
        w.close(hf_cfg, aux_from=aux_from)
        if finish is not None:
            finish(tmp)
    return out
