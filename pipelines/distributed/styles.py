"""Tensor parallelism as data: each layer kind's `tp_plan` ({submodule path: style word}) turned into DTensor
`ParallelStyle`s and applied from outside with torch's `parallelize_module` (torchtitan's route).

Stock styles where they express the layout: `ColwiseParallel` (q/k/v, MLP up/gate; DTensor weight Shard(0),
input replicated, output this rank's columns) and `RowwiseParallel` (o_proj, down_proj, Mamba out_proj;
Shard(1), partial sums all-reduced); torchao's Float8 versions for FP8 Linears. Custom styles where they
cannot: `SegmentShard` (Mamba's concatenated in_proj and conv1d are cut segment by segment, and
the mixer reads its local head counts from these plain shards), `SharedNorm` (q_norm / k_norm, the Gated
DeltaNet's gated head norm: one
replicated weight serving this rank's heads, gradient summed over the group), `ShardedNorm` (q/k norms over
all heads, OLMo 2 style: the weight sliced with the heads, the mean of squares summed over the group), `VocabParallel` and
`ParallelEntry` (the embedding's and lm_head's rows, the output projection's input; tied or not).

Every style's split is checked against the layout table (models.layout.tp_split): a plan and a table that
disagree raise before any weight moves.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from remodel.models.errors import RemodelError
from remodel.models.layout import layer_params, tp_split
from remodel.models.norm import scale_of

from .collectives import all_reduce_sum, copy_to_group, group_rank, group_size, reduce_from_group


def shard_tensor(t, dim: int, sizes, rank: int, n: int):
    """This rank's part: the rank-th of n equal chunks of every segment `sizes` along dim, concatenated
    (one segment = a plain block split; Mamba's in_proj has five)."""
    parts = []
    for seg in t.split(list(sizes), dim):
        c = seg.shape[dim] // n
        parts.append(seg.narrow(dim, rank * c, c))
    return torch.cat(parts, dim)


def _copy_input_hook(group):
    def hook(module, args):
        return (copy_to_group(args[0], group),) + tuple(args[1:])
    return hook


class SegmentShard(ParallelStyle):
    """The module's own parameters replaced by this rank's plain shards, each segment of the split dimension
    cut separately ({attr: (dim, segment sizes)}; `specs` records them for checkpoints and clipping); entry:
    its input enters the parallel region (identity forward, gradient all-reduced in backward); kind: the
    group recorded ('tp', or 'ep' for the experts)."""

    def __init__(self, splits: dict, prefix: str, specs: dict, entry: bool = False, kind: str = "tp"):
        super().__init__()
        self.splits, self.prefix, self.specs, self.entry, self.kind = splits, prefix, specs, entry, kind

    def _apply(self, module, mesh):
        group = mesh.get_group()
        r, n = group_rank(group), group_size(group)
        for attr, (dim, sizes) in self.splits.items():
            p = getattr(module, attr)
            local = shard_tensor(p.detach(), dim, sizes, r, n).clone()
            setattr(module, attr, nn.Parameter(local, requires_grad=p.requires_grad))
            self.specs[self.prefix + attr] = (self.kind, dim, tuple(sizes))
        if self.entry:
            module.register_forward_pre_hook(_copy_input_hook(group))
        return module


class SharedWeightRMSNorm(nn.Module):
    """An RMSNorm whose weight serves only this rank's heads (q_norm / k_norm): its gradient is summed."""

    def __init__(self, norm: nn.Module, group):
        super().__init__()
        self.weight, self.eps, self.group, self.offset = norm.weight, norm.eps, group, norm.offset

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((copy_to_group(self.weight, self.group).float() + self.offset) * x).to(dtype)


class SharedWeightNorm(nn.Module):
    """A kind's own norm (one that says how to apply another weight: `normed(weight, *inputs)`, e.g. the Gated
    DeltaNet's gated head norm) whose replicated weight serves only this rank's heads: its gradient is summed."""

    def __init__(self, norm: nn.Module, group):
        super().__init__()
        self.weight, self.normed, self.group = norm.weight, norm.normed, group

    def forward(self, *inputs):
        return self.normed(copy_to_group(self.weight, self.group), *inputs)


class SharedNorm(ParallelStyle):
    """A replicated norm weight applied to this rank's heads only: the module becomes SharedWeightRMSNorm, or
    SharedWeightNorm where the module applies a given weight itself (`normed`)."""

    def _apply(self, module, mesh):
        shared = SharedWeightNorm if hasattr(module, "normed") else SharedWeightRMSNorm
        return shared(module, mesh.get_group())


class ShardedWeightRMSNorm(nn.Module):
    """An RMSNorm over all heads (qk_norm_full) of which this rank holds its heads' channels and their slice
    of the weight: the sum of squares is all-reduced (both ways: the other ranks' outputs depend on this
    rank's channels), divided by the full width (local width x ranks), as the one-process mean."""

    def __init__(self, norm: nn.Module, group):
        super().__init__()
        self.weight, self.eps, self.group, self.offset = norm.weight, norm.eps, group, norm.offset

    def forward(self, x):
        dtype, cd = x.dtype, torch.promote_types(x.dtype, torch.float32)  # fp32 (float64 stays), as models.norm
        x = x.to(cd)
        sq = all_reduce_sum(x.pow(2).sum(-1, keepdim=True), self.group)
        x = x * torch.rsqrt(sq / (x.shape[-1] * group_size(self.group)) + self.eps)
        return (scale_of(self.weight, self.offset).to(cd) * x).to(dtype)


class ShardedNorm(ParallelStyle):
    """A norm over all heads whose weight the layout table splits with the heads: the weight becomes this
    rank's plain shard (recorded in `specs`, so checkpoints, clipping and export gather it) and the module a
    ShardedWeightRMSNorm."""

    def __init__(self, splits: dict, prefix: str, specs: dict):
        super().__init__()
        self.splits, self.prefix, self.specs = splits, prefix, specs

    def _apply(self, module, mesh):
        SegmentShard(self.splits, self.prefix, self.specs)._apply(module, mesh)
        return ShardedWeightRMSNorm(module, mesh.get_group())


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


class VocabParallel(ParallelStyle):
    """The embedding's rows split over the group (plain shards): it becomes VocabParallelEmbedding."""

    def __init__(self, specs: dict):
        super().__init__()
        self.specs = specs

    def _apply(self, module, mesh):
        group = mesh.get_group()
        r, n = group_rank(group), group_size(group)
        V = module.weight.shape[0]
        SegmentShard({"weight": (0, [V])}, "embeddings.", self.specs)._apply(module, mesh)
        return VocabParallelEmbedding(module, group, r * V // n)


class ParallelEntry(ParallelStyle):
    """A placeholder module (the model's logit_input) becomes the parallel region's entry."""

    def _apply(self, module, mesh):
        return CopyToGroup(mesh.get_group())


def vocab_plan(model, specs: dict) -> dict:
    """The vocabulary's plan: embedding rows, lm_head rows (the model returns this rank's vocab shard of the
    logits), the output projection's input entering the region (tied or not)."""
    plan = {"embeddings": VocabParallel(specs), "logit_input": ParallelEntry()}
    if model.lm_head is not None:
        plan["lm_head"] = SegmentShard({"weight": (0, [model.cfg.vocab_size])}, "lm_head.", specs)
    return plan


def _stock(word: str, module):
    """ColwiseParallel / RowwiseParallel, or torchao's Float8 versions for a Float8Linear (or a subclass:
    pipelines.training.fp8's compiled one; by name, so that torchao is imported only where it is used)."""
    if any(c.__name__ == "Float8Linear" for c in type(module).__mro__):
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel
        return Float8ColwiseParallel() if word == "colwise" else Float8RowwiseParallel()
    return ColwiseParallel() if word == "colwise" else RowwiseParallel()


STOCK_DIM = {"colwise": {"weight": 0, "bias": 0}, "rowwise": {"weight": 1}}  # the dims the stock styles split


def _check_stock(word: str, path: str, splits: dict):
    """The stock style must cut what the layout table says: its fixed dims, one segment, replicated row bias."""
    want = STOCK_DIM[word]
    got = {attr: dim for attr, (dim, sizes) in splits.items() if len(sizes) == 1}
    if got != {a: d for a, d in want.items() if a in splits} or set(splits) - set(want):
        raise RemodelError(f"tensor parallelism: the {word} plan of {path!r} disagrees with the layout table {splits}")


def _splits_by_module(cfg, kind_char: str) -> dict:
    """{module path: {attr: (dim, segment sizes)}} of one layer kind's tensor-parallel parameters."""
    out = {}
    for p in layer_params(cfg, kind_char):
        split = tp_split(cfg, p.axes)
        if split is not None:
            path, _, attr = p.leaf.rpartition(".")
            out.setdefault(path, {})[attr] = split
    return out


def layer_plan(cfg, spec, mixer, prefix: str, specs: dict) -> dict:
    """{submodule path: ParallelStyle} of one layer's mixer, from its kind's spec (the tp_plan restricted to
    the submodules the layer has: q_norm, gate_proj, ... are optional) and the layout table."""
    name, tp_plan = spec.name, _present_plan(mixer, spec.tp_plan)
    splits = _splits_by_module(cfg.view(spec), spec.char)  # the kind's splits from its own sections
    uncovered = set(splits) - set(tp_plan)
    if uncovered:
        raise RemodelError(f"tensor parallelism: {name} parameters under {sorted(uncovered)} are split by the "
                           "layout table but have no entry in the kind's tp_plan")
    plan = {}
    for path, word in tp_plan.items():
        module = mixer.get_submodule(path)  # '': the mixer itself
        here = splits.get(path, {})
        if word in STOCK_DIM:
            _check_stock(word, name + "." + path, here)
            plan[path] = _stock(word, module)
        elif word in ("shard", "shard_entry"):
            plan[path] = SegmentShard(here, prefix + (path + "." if path else ""), specs, entry=word == "shard_entry")
        elif word == "shared_norm":  # replicated; or, where the table splits it with the heads, over all heads
            plan[path] = _sharded_norm(name + "." + path, here, prefix + path + ".", specs) if here else SharedNorm()
        else:
            raise RemodelError(f"tensor parallelism: unknown style {word!r} in the {name} tp_plan")
    return plan


def _sharded_norm(where: str, splits: dict, prefix: str, specs: dict) -> ShardedNorm:
    """The style of a norm weight the layout table splits: one segment of dim 0 of its only parameter."""
    if set(splits) != {"weight"} or splits["weight"][0] != 0 or len(splits["weight"][1]) != 1:
        raise RemodelError(f"tensor parallelism: the shared_norm plan of {where!r} disagrees with the layout table "
                           f"{splits}")
    return ShardedNorm(splits, prefix, specs)


def _present(mixer, path: str) -> bool:
    m = mixer
    for part in filter(None, path.split(".")):
        m = getattr(m, part, None)
        if m is None:
            return False
    return True


def _present_plan(mixer, tp_plan: dict) -> dict:
    return {p: w for p, w in tp_plan.items() if _present(mixer, p)}


def apply_plan(mixer, plan: dict, mesh):
    """Each style on its submodule (parallelize_module); a style that returns a new module replaces it. Every
    rank holds the same full weights (or the meta device): each takes its own shard, nothing is scattered."""
    for path, style in plan.items():
        old = mixer.get_submodule(path)
        new = parallelize_module(old, mesh, style, src_data_rank=None)
        if new is not old:
            owner, _, leaf = path.rpartition(".")
            setattr(mixer.get_submodule(owner), leaf, new)


def tp_layer(mixer, spec, cfg, prefix: str, specs: dict, mesh):
    """The kind's tensor-parallel plan on one layer's mixer (absent optional submodules skipped)."""
    apply_plan(mixer, layer_plan(cfg, spec, mixer, prefix, specs), mesh)
