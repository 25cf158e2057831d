"""Tensor, expert and data parallelism applied to a HybridLM from outside, over a DeviceMesh.

The model definition (models/*.py) knows nothing of ranks (torchtitan's principle): `parallelize` applies
each layer kind's `tp_plan` (its spec: {submodule: style}) as DTensor ParallelStyles with torch's
`parallelize_module` (pipelines.distributed.styles), an `ExpertParallel` style to the routed experts, and
FSDP2 for data parallelism. No method is rebound on an instance and no module's config changes (the mixers
read their local head counts from their shards' or their activations' shapes). Same code on gloo/CPU and
NCCL/GPU.

Tensor parallelism (Megatron layout; every activation between layers is replicated over 'tp'):
  attention  q/k/v ColwiseParallel (contiguous rows = whole KV groups with their query heads), o_proj
             RowwiseParallel, q_norm/k_norm one shared weight (norms over all heads, qk_norm_full: the weight
             split with the heads, the mean of squares all-reduced)
  MLP        up/gate ColwiseParallel, down RowwiseParallel (also the MoE shared expert)
  Mamba-2    in_proj and conv1d cut segment by segment (a custom style: a concatenation cannot be one DTensor
             placement), heads, norm, plain shards by group; out_proj RowwiseParallel
  vocab      embedding rows (out-of-shard ids masked, all-reduced); lm_head rows, so the model returns
             this rank's vocab shard of the logits: use pipelines.training.vocab_parallel for the losses
  routers, latent projections, block norms: replicated
The stock styles' parameters are DTensors; the custom styles' plain shards are listed in ParallelInfo.specs.
Checkpoints, clipping and export read both (pipelines.distributed.sharded.local_index).

Expert parallelism: E/ep experts per rank, tokens exchanged with uneven `all_to_all_single` (autograd
version), dropless; router replicated. The dispatch is models.moe.Experts' own; an ExpertExchange set
as its `exchange` moves the rows. Folded over 'dp' (each rank routes its own micro-batch) or
over 'tp' (the replicated tokens are split over the ranks first and gathered after).

Data parallelism: FSDP2 `fully_shard` over 'dp' (per block, then the root; over TP's DTensors it makes 2-D
ones); experts sharded by an EP folded over 'dp' are left out of FSDP and their gradients scaled by 1/dp,
matching FSDP's mean.

Training contract: every tp rank computes the same (replicated) loss from its logits shard with
pipelines.training.vocab_parallel; each dp rank uses the mean over its own micro-batch; FSDP averages. Then
`clip_grad_norm_(model, max_norm)` here (global norm over all shards), `optimizer.step()`, and
`full_state_dict(model)` / `gather_model(model)` for a checkpoint in the single-process format.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from remodel.models.errors import RemodelError
from remodel.models.kinds import routed, used

from .collectives import chunk_bounds, gather_rows, group_rank, group_size, scale_grad, split_rows
from .styles import SegmentShard, apply_plan, tp_layer, vocab_plan


# ---- sharding layouts ------------------------------------------------------------------------

def unshard_tensor(parts, dim: int, sizes):
    """Inverse of `shard_tensor` given every rank's part, in rank order."""
    n = len(parts)
    pieces = [p.split([s // n for s in sizes], dim) for p in parts]
    return torch.cat([pieces[r][i] for i in range(len(sizes)) for r in range(n)], dim)


@dataclass
class ParallelInfo:
    """What `parallelize` did. Parameters of the stock styles (and FSDP2's) are DTensors that carry their own
    placements; the plain shards are listed in `specs[name] = (group_kind 'tp'|'ep', dim, segment sizes)`."""
    mesh: object = None
    tp_group: object = None
    ep_group: object = None
    dp_group: object = None
    tp: int = 1
    ep: int = 1
    dp: int = 1
    ep_over: str | None = None  # 'tp' or 'dp'
    fsdp: bool = False
    specs: dict = field(default_factory=dict)  # the plain shards (Mamba segments, vocab, experts)
    dims: dict = field(default_factory=dict)  # {mesh dimension name: 'tp' | 'dp'}

    @property
    def dp_rank(self) -> int:
        return group_rank(self.dp_group)

    @property
    def tp_rank(self) -> int:
        return group_rank(self.tp_group)

    @property
    def vocab_group(self):
        """Group the logits' vocabulary is sharded over (pass to pipelines.training.vocab_parallel)."""
        return self.tp_group


def parallel_info(model) -> ParallelInfo:
    """The model's ParallelInfo (a trivial one for a model that was never parallelized)."""
    return getattr(model, "_parallel", None) or ParallelInfo()


# ---- expert parallelism: the experts' exchange and its style ----------------------------------------

class ExpertExchange:
    """Expert parallelism as the exchange of models.moe.Experts' one dispatch (the arithmetic stays
    there): tokens replicated over the group (EP folded over tp) are split first and gathered after; the
    sorted rows go to the rank holding their expert and back with uneven all_to_all (autograd); the
    experts' gradients are scaled by grad_scale (EP folded over dp: FSDP's mean)."""

    def __init__(self, group, n_experts: int, tokens_replicated: bool, grad_scale: float):
        self.group, self.n_experts, self.replicated, self.grad_scale = group, n_experts, tokens_replicated, grad_scale
        self.n = group_size(group)

    def enter(self, x, weights, idx):
        T_all = x.shape[0]
        if self.replicated:
            _, a, b = chunk_bounds(T_all, self.n, group_rank(self.group))
            x, weights, idx = split_rows(x, self.group), split_rows(weights, self.group), idx[a:b]
        return x, weights, idx, T_all

    def weights(self, w: tuple) -> tuple:
        if self.grad_scale == 1.0:
            return w
        return tuple(None if p is None else scale_grad(p, self.grad_scale) for p in w)

    def dispatch(self, rows, counts):
        """rows sorted by global expert, counts [E] -> (the rows this rank's experts get, sorted by local
        expert; their counts; what combine needs)."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd
        n, El = self.n, self.n_experts // self.n
        send = counts.view(n, El)  # rows for (dest rank, its expert)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # recv[src, local expert]
        send_splits, recv_splits = torch.stack([send.sum(1), recv.sum(1)]).tolist()  # the one host sync: NCCL's splits
        xr = all_to_all_single_autograd(rows.contiguous(), recv_splits, send_splits, self.group)
        local_e = torch.repeat_interleave(torch.arange(El, device=rows.device).repeat(n), recv.reshape(-1))
        perm = local_e.argsort(stable=True)
        return xr[perm], recv.sum(0), (perm, send_splits, recv_splits)

    def combine(self, y, back):
        """The local experts' outputs back to the ranks and order their rows came from."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd
        perm, send_splits, recv_splits = back
        yr = torch.empty_like(y).index_copy(0, perm, y)  # back to arrival order
        return all_to_all_single_autograd(yr.contiguous(), send_splits, recv_splits, self.group)

    def leave(self, out, T_all: int):
        return gather_rows(out, self.group, T_all) if self.replicated else out


# ---- the plan ----------------------------------------------------------------------------------

def _group_of(mesh, dim):
    if dim is None or mesh is None or dim not in (mesh.mesh_dim_names or ()):
        return None
    return mesh.get_group(dim)


def check_layout(cfg, tp: int, ep: int, ep_dim, tp_dim, dp_dim, mesh):
    def need(ok, msg):
        if not ok:
            raise RemodelError(msg)

    names = tuple(mesh.mesh_dim_names or ())
    for label, d in (("tp_dim", tp_dim), ("ep_dim", ep_dim), ("dp_dim", dp_dim)):
        need(d is None or d in names or label == "tp_dim", f"{label}={d!r} is not a dimension of the mesh {names}")
    if ep_dim is not None:
        need(ep_dim in (tp_dim, dp_dim), f"ep_dim={ep_dim!r} must be the tp or the dp mesh dimension "
             "(expert parallelism is folded over one of them)")
    if tp > 1:
        for k in used(cfg):  # each kind's widths that tp must divide (its spec)
            k.check_tp(cfg.view(k), tp, need)
        need(cfg.vocab_size % tp == 0, f"tensor parallelism: vocab_size={cfg.vocab_size} is not divisible by tp={tp}")
    if ep > 1 and routed(cfg):
        need(cfg.moe.n_routed_experts % ep == 0, f"expert parallelism: n_routed_experts={cfg.moe.n_routed_experts} is not "
             f"divisible by ep={ep}")


class ExpertParallel(ParallelStyle):
    """The routed experts split by expert over the group (plain [E/ep, ...] shards, recorded in `specs`), the
    tokens moved by an ExpertExchange plugged into the one dispatch of models.moe.Experts."""

    def __init__(self, prefix, specs, n_experts, tokens_replicated, grad_scale):
        super().__init__()
        self.prefix, self.specs, self.n_experts = prefix, specs, n_experts
        self.replicated, self.grad_scale = tokens_replicated, grad_scale

    def _apply(self, experts, mesh):
        splits = {a: (0, [self.n_experts]) for a in ("up_proj", "gate_proj", "down_proj", "up_proj_bias", "gate_proj_bias",
                                                     "down_proj_bias") if getattr(experts, a, None) is not None}
        SegmentShard(splits, self.prefix, self.specs, kind="ep")._apply(experts, mesh)
        experts.exchange = ExpertExchange(mesh.get_group(), self.n_experts, self.replicated, self.grad_scale)
        return experts


def parallelize(model, mesh, tp_dim: str | None = "tp", ep_dim: str | None = None, dp_dim: str | None = None):
    """Shard a (full, identical on every rank) HybridLM in place over `mesh`; returns the model.

    tp_dim: tensor parallelism (skipped when the mesh has no such dimension); ep_dim: expert
    parallelism folded over the tp or the dp dimension; dp_dim: FSDP2 data parallelism. Raises
    RemodelError (one line, nothing changed) when a width cannot be split."""
    if getattr(model, "_parallel", None) is not None:
        raise RemodelError("model is already parallelized")
    cfg = model.cfg
    tp_group, ep_group, dp_group = _group_of(mesh, tp_dim), _group_of(mesh, ep_dim), _group_of(mesh, dp_dim)
    tp, ep, dp = group_size(tp_group), group_size(ep_group), group_size(dp_group)
    check_layout(cfg, tp, ep, ep_dim, tp_dim, dp_dim, mesh)
    info = ParallelInfo(mesh=mesh, tp_group=tp_group if tp > 1 else None, ep_group=ep_group if ep > 1 else None,
                        dp_group=dp_group if dp > 1 else None, tp=tp, ep=ep, dp=dp,
                        dims={d: role for d, role in ((tp_dim, "tp"), (dp_dim, "dp")) if d is not None})
    specs = info.specs

    if tp > 1:
        tp_mesh = mesh[tp_dim]
        apply_plan(model, vocab_plan(model, specs), tp_mesh)
        for i, layer in enumerate(model.layers):  # each kind's plan of DTensor parallel styles (models/*.py)
            tp_layer(layer.mixer, layer.spec, cfg, f"layers.{i}.mixer.", specs, tp_mesh)

    expert_params = set()
    if ep > 1:
        info.ep_over = "tp" if ep_dim == tp_dim else "dp"
        scale = 1.0 / dp if info.ep_over == "dp" else 1.0
        for i, layer in enumerate(model.layers):
            if layer.spec.routed:
                style = ExpertParallel(f"layers.{i}.mixer.experts.", specs, cfg.moe.n_routed_experts,
                                       info.ep_over == "tp", scale)
                parallelize_module(layer.mixer.experts, mesh[ep_dim], style)
                if info.ep_over == "dp":
                    expert_params |= set(layer.mixer.experts.parameters())

    if dp > 1:
        from torch.distributed.fsdp import fully_shard
        dp_mesh = mesh[dp_dim]
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh, ignored_params=(expert_params & set(layer.parameters())) or None)
        fully_shard(model, mesh=dp_mesh, ignored_params=expert_params or None)
        info.fsdp = True
    model._parallel = info
    return model


# ---- training helpers ----------------------------------------------------------------------

def local_tensor(t):
    """This rank's part of a DTensor (FSDP2's dim-0 shard, a TP shard); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def sharded_dims(t) -> list:
    """[(mesh dimension index, tensor dim)] that a DTensor's placements split (Shard, FSDP2's _StridedShard)."""
    from torch.distributed.tensor import DTensor
    if not isinstance(t, DTensor):
        return []
    return [(i, p.dim) for i, p in enumerate(t.placements) if hasattr(p, "dim")]


def dtensor_shards(t) -> int:
    """Into how many pieces a DTensor's placements cut it (1: a plain tensor or replicated)."""
    n = 1
    for i, _ in sharded_dims(t):
        n *= t.device_mesh.size(i)
    return n


def _mesh_sum(x, info):
    """Sum of x over every rank of the mesh (one all-reduce per mesh dimension)."""
    if info.mesh is None:
        return x
    for name in info.mesh.mesh_dim_names:
        if info.mesh[name].size() > 1:
            dist.all_reduce(x, group=info.mesh.get_group(name))
    return x


@torch.no_grad()
def clip_grad_norm_(model, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (L2) for a parallelized model: the norm of the whole, unsharded
    gradient, identical on every rank; grads scaled in place by min(1, max_norm / (norm + 1e-6)). As torch's:
    one foreach norm over the local shards (fp32 per tensor; the squares weighted and summed in fp64) and one
    foreach scale, where a per-parameter fp64 copy of every gradient had cost the 8B window's step on the GPU
    an estimated 75 GB of memory traffic (not measured: the benchmarks had timed torch's clip)."""
    info = parallel_info(model)
    world = 1 if info.mesh is None else info.mesh.size()
    grads, weights = [], []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        shards = dtensor_shards(p.grad) * {"tp": info.tp, "ep": info.ep}.get(info.specs.get(name, ("",))[0], 1)
        grads.append(local_tensor(p.grad))
        weights.append(shards / world)  # each element lives on world / shards ranks
    if not grads:
        return torch.zeros(())
    squares = torch.stack(torch._foreach_norm(grads, 2)).double().square()
    total = (squares * torch.tensor(weights, dtype=torch.float64, device=squares.device)).sum()
    norm = _mesh_sum(total, info).sqrt().float()
    coef = min(1.0, max_norm / (norm.item() + 1e-6))
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    return norm


def dp_mean(x: torch.Tensor, model) -> torch.Tensor:
    """Mean of a (detached) per-rank value over the data-parallel ranks, e.g. the logged loss."""
    info = parallel_info(model)
    x = x.detach().clone()
    if info.dp_group is not None:
        dist.all_reduce(x, group=info.dp_group)
        x /= info.dp
    return x


@torch.no_grad()
def unshard_all(model, named, rank0_only: bool) -> dict:
    from torch.distributed.tensor import DTensor
    info = parallel_info(model)
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    for name, t in named:
        if isinstance(t, DTensor):  # FSDP shard over dp
            t = t.full_tensor()
        spec = info.specs.get(name)
        if spec is not None:  # TP or EP shard
            kind, dim, sizes = spec
            group = info.tp_group if kind == "tp" else info.ep_group
            parts = [torch.empty_like(t) for _ in range(group_size(group))]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = unshard_tensor(parts, dim, sizes)
        if keep:
            out[name] = t.detach().to("cpu", copy=True)
    return out


def full_state_dict(model, rank0_only: bool = True) -> dict:
    """The unsharded state dict (same names and shapes as the single-process HybridLM), on CPU.
    Collective: every rank must call it; with rank0_only the other ranks get {}."""
    return unshard_all(model, model.state_dict().items(), rank0_only)


def full_grads(model, rank0_only: bool = True) -> dict:
    """The unsharded gradients {param name: grad} (as after a single-process backward). Collective."""
    return unshard_all(model, [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None], rank0_only)


def gather_model(model):
    """A plain single-process HybridLM holding the full weights on rank 0 (None elsewhere), ready for
    models.load.save_model. Collective."""
    from remodel.models.model import HybridLM
    sd = full_state_dict(model)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    full = HybridLM(model.cfg)
    full.load_state_dict(sd, strict=True)
    return full
