"""Tensor, expert and data parallelism applied to a HybridLM from outside, over a DeviceMesh.

The model definition (models/*.py) knows nothing of ranks (torchtitan's principle): `parallelize`
replaces parameters by this rank's shards (the mixers read their local head counts from the shapes),
puts modules with autograd-aware collectives in place of a few (RowParallelLinear,
VocabParallelEmbedding, ...), all as each layer kind's spec says (its tp_* fields), and hands data
parallelism to FSDP2. No method is rebound on an instance and no module's config changes. The same
code runs on gloo/CPU and NCCL/GPU.

Tensor parallelism (Megatron layout, plain local shards; every activation between layers is
replicated over 'tp'): each parameter is split along its first tensor-parallel axis of the layout
table (the kinds' tp_axes / models.layout.tp_split), a concatenated axis piece by piece (its segments), so:
  attention  q/k/v column-parallel by KV groups (whole KV heads with their query heads), o_proj row
  MLP        up/gate column, down row (also the MoE shared expert)
  Mamba-2    split by group: each in_proj and conv1d segment in rank pieces, heads, inner channels,
             out_proj row
  vocab      embedding rows (out-of-shard ids masked, all-reduced); lm_head rows, so the model returns
             this rank's vocab shard of the logits: use pipelines.training.vocab_parallel for the losses
  norms, router, latent projections: replicated
A column block's input passes `copy_to_group` (identity forward, all-reduce backward), a row block's
output `reduce_from_group` (all-reduce forward, identity backward). The DTensor plans cannot express
the piecewise Mamba in_proj split, so one mechanism (plain shards) serves every layer.

Expert parallelism: E/ep experts per rank, tokens exchanged with uneven `all_to_all_single` (autograd
version), dropless; router replicated. The dispatch is models.moe.Experts' own; an ExpertExchange set
as its `exchange` moves the rows. Folded over 'dp' (each rank routes its own micro-batch) or
over 'tp' (the replicated tokens are split over the ranks first and gathered after).

Data parallelism: FSDP2 `fully_shard` over 'dp' (per block, then the root); experts sharded by an
EP folded over 'dp' are left out of FSDP and their gradients scaled by 1/dp, matching FSDP's mean.

Training contract: every tp rank computes the same (replicated) loss from its logits shard with
pipelines.training.vocab_parallel; each dp rank uses the mean over its own micro-batch; FSDP averages. Then
`clip_grad_norm_(model, max_norm)` here (global norm over all shards), `optimizer.step()`, and
`full_state_dict(model)` / `gather_model(model)` for a checkpoint in the single-process format.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from remodel.models.errors import RemodelError
from remodel.models.kinds import routed, used
from remodel.models.layout import layer_params, tp_split

from .collectives import (chunk_bounds, copy_to_group, gather_rows, group_rank, group_size,
                          reduce_from_group, scale_grad, split_rows)


# ---- sharding layouts ------------------------------------------------------------------------

def shard_tensor(t, dim: int, sizes, rank: int, n: int):
    """This rank's part: the rank-th of n equal chunks of every segment `sizes` along dim, concatenated
    (one segment = a plain block split; Mamba's in_proj has five)."""
    parts = []
    for seg in t.split(list(sizes), dim):
        c = seg.shape[dim] // n
        parts.append(seg.narrow(dim, rank * c, c))
    return torch.cat(parts, dim)


def unshard_tensor(parts, dim: int, sizes):
    """Inverse of `shard_tensor` given every rank's part, in rank order."""
    n = len(parts)
    pieces = [p.split([s // n for s in sizes], dim) for p in parts]
    return torch.cat([pieces[r][i] for i in range(len(sizes)) for r in range(n)], dim)


@dataclass
class ParallelInfo:
    """What `parallelize` did; `specs[name] = (group_kind 'tp'|'ep', dim, segment sizes)`."""
    mesh: object = None
    tp_group: object = None
    ep_group: object = None
    dp_group: object = None
    tp: int = 1
    ep: int = 1
    dp: int = 1
    ep_over: str | None = None  # 'tp' or 'dp'
    fsdp: bool = False
    specs: dict = field(default_factory=dict)

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


# ---- the modules tensor parallelism puts in place, and the experts' exchange ------------------------

class RowParallelLinear(nn.Module):
    """A Linear over this rank's share of the input features: the partial products are summed over the
    group (all-reduce forward, identity backward), then the bias is added once."""

    def __init__(self, linear: nn.Module, group):
        super().__init__()
        self.weight, self.bias, self.group = linear.weight, linear.bias, group

    def forward(self, x):
        y = reduce_from_group(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class SharedWeightRMSNorm(nn.Module):
    """An RMSNorm whose weight serves only this rank's heads (q_norm / k_norm): its gradient is summed."""

    def __init__(self, norm: nn.Module, group):
        super().__init__()
        self.weight, self.eps, self.group = norm.weight, norm.eps, group

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (copy_to_group(self.weight, self.group).float() * x).to(dtype)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + n) of the embedding: out-of-shard ids give zeros, then all-reduce."""

    def __init__(self, emb: nn.Module, group, start: int):
        super().__init__()
        self.weight, self.group, self.start = emb.weight, group, start

    def forward(self, ids):
        n = self.weight.shape[0]
        local = ids - self.start
        inside = (local >= 0) & (local < n)
        e = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        return reduce_from_group(e.masked_fill(~inside[..., None], 0.0), self.group)


class CopyToGroup(nn.Module):
    """Enters the tensor-parallel region: identity forward, gradient all-reduced in backward."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x):
        return copy_to_group(x, self.group)


def _copy_input_hook(group):
    def hook(module, args):
        return (copy_to_group(args[0], group),) + tuple(args[1:])
    return hook


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
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
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
            k.check_tp(cfg, tp, need)
        need(cfg.vocab_size % tp == 0, f"tensor parallelism: vocab_size={cfg.vocab_size} is not divisible by tp={tp}")
    if ep > 1 and routed(cfg):
        need(cfg.n_routed_experts % ep == 0, f"expert parallelism: n_routed_experts={cfg.n_routed_experts} is not "
             f"divisible by ep={ep}")


def _shard_param(module, attr, prefix, specs, dim, sizes, rank, n, kind="tp"):
    p = getattr(module, attr)
    if p is None:
        return
    local = shard_tensor(p.detach(), dim, sizes, rank, n).clone()
    setattr(module, attr, nn.Parameter(local, requires_grad=p.requires_grad))
    specs[f"{prefix}{attr}"] = (kind, dim, tuple(sizes))


def tp_shard_layer(mixer, kind, cfg, prefix, specs, rank, n):
    """Shard every parameter of one layer's mixer as the layout table says: the dimension of its first
    tensor-parallel axis, cut piece by piece (models.layout.tp_split); the rest stays replicated."""
    for p in layer_params(cfg, kind):
        split = tp_split(cfg, p.axes)
        if split is not None:
            path, _, attr = p.leaf.rpartition(".")
            module = mixer.get_submodule(path) if path else mixer
            _shard_param(module, attr, prefix + (path + "." if path else ""), specs, *split, rank, n)


def _swap(mixer, path: str, make):
    """Put make(old) in place of the submodule at `path` (parameter names unchanged); None: absent."""
    owner, _, leaf = path.rpartition(".")
    parent = _sub(mixer, owner)
    old = None if parent is None else getattr(parent, leaf, None)
    if old is not None:
        setattr(parent, leaf, make(old))


def _sub(mixer, path: str):
    """The submodule at `path` under the mixer ('' : the mixer itself), None when the layer has none."""
    m = mixer
    for part in filter(None, path.split(".")):
        m = getattr(m, part, None)
        if m is None:
            return None
    return m


def tp_forward(mixer, kind, group, n):
    """The kind's tensor-parallel plan (its spec's tp_* fields) on one layer's sharded mixer: row-parallel
    outputs all-reduced, norms of shared weight, the parallel region's entry. The mixers read their local
    head counts from their shards' shapes; nothing of their config changes."""
    for path in kind.tp_row:
        _swap(mixer, path, lambda m: RowParallelLinear(m, group))
    for path in kind.tp_shared_norms:
        _swap(mixer, path, lambda m: SharedWeightRMSNorm(m, group))
    if kind.tp_entry is not None and (m := _sub(mixer, kind.tp_entry)) is not None:
        m.register_forward_pre_hook(_copy_input_hook(group))


def _tp_layers(model, cfg, specs, group, r, tp):
    """Tensor-parallel plan of every trunk layer: shards from the layout table, then the forwards."""
    for i, layer in enumerate(model.layers):
        tp_shard_layer(layer.mixer, layer.kind, cfg, f"layers.{i}.mixer.", specs, r, tp)
        tp_forward(layer.mixer, layer.spec, group, tp)


def _ep_experts(experts, prefix, specs, group, n_experts, tokens_replicated, grad_scale):
    rank, n = group_rank(group), group_size(group)
    for attr in ("up_proj", "gate_proj", "down_proj"):
        _shard_param(experts, attr, prefix, specs, 0, [n_experts], rank, n, kind="ep")
    experts.exchange = ExpertExchange(group, n_experts, tokens_replicated, grad_scale)


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
                        dp_group=dp_group if dp > 1 else None, tp=tp, ep=ep, dp=dp)
    specs = info.specs

    if tp > 1:
        r = group_rank(tp_group)
        V = cfg.vocab_size
        _shard_param(model.embeddings, "weight", "embeddings.", specs, 0, [V], r, tp)
        model.embeddings = VocabParallelEmbedding(model.embeddings, tp_group, r * V // tp)
        if model.lm_head is not None:
            _shard_param(model.lm_head, "weight", "lm_head.", specs, 0, [V], r, tp)
        model.logit_input = CopyToGroup(tp_group)
        _tp_layers(model, cfg, specs, tp_group, r, tp)

    expert_params = set()
    if ep > 1:
        info.ep_over = "tp" if ep_dim == tp_dim else "dp"
        scale = 1.0 / dp if info.ep_over == "dp" else 1.0
        for i, layer in enumerate(model.layers):
            if layer.spec.routed:
                _ep_experts(layer.mixer.experts, f"layers.{i}.mixer.experts.", specs, ep_group,
                            cfg.n_routed_experts, info.ep_over == "tp", scale)
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
    gradient, identical on every rank; grads scaled in place by min(1, max_norm / (norm + 1e-6))."""
    info = parallel_info(model)
    world = 1 if info.mesh is None else info.mesh.size()
    total, grads = None, []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g, fsdp = local_tensor(p.grad), local_tensor(p.grad) is not p.grad
        shards = (info.dp if fsdp else 1) * {"tp": info.tp, "ep": info.ep}.get(info.specs.get(name, ("",))[0], 1)
        s = g.double().pow(2).sum() * (shards / world)  # each element is held by world/shards ranks
        total = s if total is None else total + s
        grads.append(p.grad)
    if total is None:
        return torch.zeros(())
    norm = _mesh_sum(total, info).sqrt().float()
    coef = min(1.0, max_norm / (norm.item() + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
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
