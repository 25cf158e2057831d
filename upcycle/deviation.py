"""Initial deviation of an upcycled checkpoint from its dense source, measured while the weights stream by.

The writer hands each group of tensors (embeddings, one layer, norm_f, lm_head) to `StreamCheck.feed`
once, in model order, with the MoE tensors of an upcycled layer exactly as they are written (scaled
and rounded to the checkpoint dtype). The check keeps two residual streams for a fixed sample of
random tokens, dense and upcycled, stacked in one fp32 batch, and runs every layer on both with our
model code (models.model.Block, the MoE with its router; the experts are `ShardExperts`, which run
each of the G scaled shards once on the tokens routed to any of its N/G copies). It never builds
either model nor holds a layer's projections in fp32: every Linear reads the checkpoint's tensor and
casts a cache-sized block of rows at a time (`linear_f32`), so the check reads each weight once, at
its stored width, like the writer does. It costs one such pass over the weights plus two small
forwards of the sample (pipeline.DEVIATION_TOKENS), and runs on its own thread beside the writer.
Reported: the final logit difference (max abs, relative Frobenius) -- the figure a whole-model forward
of both checkpoints on these tokens gives -- and, per upcycled layer, the difference between its MoE
and dense MLP outputs on the same inputs (the upcycled stream's).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from remodel.models.kinds import KINDS
from remodel.models.mlp import ACT, ffn
from remodel.models.model import Block, init_buffers
from remodel.models.norm import trunk_norm
from remodel.models.trunk import finish, one_pass, start, walker

from .virtual_groups import LazyExperts

CAST_BYTES = 1024 * 1024  # fp32 weight rows cast at a time: stays in a core's L2 cache (2 MiB here)


def linear_f32(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w.float(), bias) for fp32 x, without an fp32 copy of w in memory: rows of w are cast
    a cache-sized block at a time into one reused buffer (exact: every float format widens exactly)."""
    if w.dtype == x.dtype:
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))
    x2 = x.reshape(-1, x.shape[-1])
    rows = max(1, CAST_BYTES // (4 * w.shape[1]))
    buf, out = torch.empty(min(rows, w.shape[0]), w.shape[1]), torch.empty(w.shape[0], x2.shape[0])
    for r in range(0, w.shape[0], rows):
        c = w[r:r + rows]
        torch.mm(buf[:len(c)].copy_(c), x2.t(), out=out[r:r + len(c)])
    y = out.t().reshape(*x.shape[:-1], w.shape[0])
    return y if bias is None else y + bias.to(x.dtype)


class StreamLinear(torch.nn.Module):
    """Stands in for an nn.Linear in the check's blocks: weight and bias are the streamed tensors
    themselves (any float dtype), applied with linear_f32."""

    def __init__(self):
        super().__init__()
        self.w = self.b = None

    @property
    def weight(self) -> torch.Tensor:  # the mixers read their Linears' shapes (models.mamba's _local)
        return self.w

    def forward(self, x):
        return linear_f32(x, self.w, self.b)


class ShardExperts(torch.nn.Module):
    """Stands in for models.moe.Experts in an upcycled layer, whose expert e is the scaled shard
    e mod G: each shard's FFN runs once on the tokens routed to any of its N/G copies and is added with
    the sum of those routing weights. Equal to dropless per-expert dispatch up to fp32 reassociation,
    but it reads each shard once instead of N/G times."""

    def __init__(self, act: str):
        super().__init__()
        self.act, self.up, self.gate, self.down = ACT[act], None, None, None

    def forward(self, x, weights, idx):
        G = len(self.up.shards)
        out = torch.zeros(x.shape[0], self.down.shards.shape[1])
        shard = idx % G
        for g in range(G):
            hit = shard == g
            w = torch.where(hit, weights.float(), 0.0).sum(1)
            tok = hit.any(1).nonzero().squeeze(1)
            if len(tok):
                h = x[tok]
                gate = None if self.gate is None else self.gate.shards[g]
                _, y = ffn(h, self.up.shards[g], gate, self.down.shards[g], self.act, linear_f32)
                out.index_add_(0, tok, y * w[tok, None])
        return out.to(x.dtype)


def _materialise(module: torch.nn.Module):
    """Uninitialised CPU storage for a meta module (Module.to_empty goes through a Python reference
    implementation that imports torch.fx and sympy, ~1 s, on first use)."""
    for m in module.modules():
        for n, t in m._parameters.items():
            if t is not None:
                m._parameters[n] = torch.nn.Parameter(torch.empty(t.shape, dtype=t.dtype), requires_grad=False)
        for n, t in m._buffers.items():
            if t is not None:
                m._buffers[n] = torch.empty(t.shape, dtype=t.dtype)


class Paired(torch.nn.Module):
    """An upcycled layer's mixer in the deviation check: the dense mixer on both streams, the MoE on the
    upcycled one, which continues from the MoE's output; `record` gets their gap on the upcycled inputs."""

    def __init__(self, dense, moe, b: int, record):
        super().__init__()
        self.dense, self.moe, self.b, self.record = dense, moe, b, record

    def forward(self, h, *inputs):
        d = self.dense(h, *inputs)
        m = self.moe(h[self.b:], *inputs)
        diff = (m - d[self.b:]).float()
        self.record({"max_abs_out_diff": diff.abs().max().item(),
                     "rel_out_diff": (diff.norm() / d[self.b:].norm().clamp_min(1e-30)).item()})
        return torch.cat([d[:self.b], m])


class StreamCheck:
    def __init__(self, cfg, moe_cfg, seed: int, sequences: int = 1, seq_len: int = 32):
        self.cfg, self.moe_cfg, self.b = cfg, moe_cfg, sequences
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, cfg.vocab_size, (sequences, seq_len), generator=g)
        self.todo = (["embeddings.weight"] + [f"layers.{i}" for i in range(len(cfg.pattern))] + ["norm_f.weight"]
                     + ([] if cfg.tie_word_embeddings else ["lm_head.weight"]))
        self.pending, self.blocks, self.layers = {}, {}, []
        self.stream = self.walk = self.emb = self.norm_f = self.result = None

    def feed(self, key: str, tensors: dict, moe: dict | None = None):
        """tensors: our names -> tensors of group `key` (an upcycled layer's dense MLP included);
        moe: upcycle_mlp's output for an upcycled layer. Inputs are not modified."""
        self.pending[key] = (tensors, moe)
        while self.todo and self.todo[0] in self.pending:
            k = self.todo.pop(0)
            self._step(k, *self.pending.pop(k))

    def _block(self, cfg, kind: str) -> Block:
        """One fp32 module per layer kind, reused: its Linears are StreamLinears that reference each
        layer's tensors, the small rest (norms, conv, A, D) is copied into it, so after the first layer
        of a kind nothing is allocated (fresh pages cost as much as the copies)."""
        if kind not in self.blocks:
            with torch.device("meta"):  # no init: the weights are the streamed ones
                b = Block(cfg, kind)
            for name, m in list(b.named_modules()):  # before materialising: no storage for them
                if isinstance(m, torch.nn.Linear):
                    parent, _, leaf = name.rpartition(".")
                    setattr(b.get_submodule(parent), leaf, StreamLinear())
            if KINDS[kind].routed:
                b.mixer.experts = ShardExperts(cfg.mlp.mlp_act)
            _materialise(b)
            init_buffers(b, "cpu")
            self.blocks[kind] = b.eval()
        return self.blocks[kind]

    def _load(self, cfg, kind: str, prefix: str, tensors: dict) -> Block:
        b = self._block(cfg, kind)
        sd = {k[len(prefix):]: v for k, v in tensors.items() if not isinstance(v, LazyExperts)}
        for name, m in b.named_modules():
            if isinstance(m, StreamLinear):  # referenced, not copied
                m.w, m.b = sd.pop(name + ".weight", None), sd.pop(name + ".bias", None)
                if m.w is None:
                    raise RuntimeError(f"deviation check: {prefix}{name}.weight missing")
        res = b.load_state_dict(sd, strict=False)  # copies (and casts) the small rest into fp32
        missing = [k for k in res.missing_keys if not k.startswith("mixer.experts.")]
        if missing or res.unexpected_keys:
            raise RuntimeError(f"deviation check: {prefix} missing {missing}, unexpected {res.unexpected_keys}")
        if KINDS[kind].routed:  # the G scaled shards stand for the N experts, read in place
            ex = b.mixer.experts
            ex.up, ex.gate, ex.down = (tensors.get(prefix + f"mixer.experts.{leaf}")
                                       for leaf in ("up_proj", "gate_proj", "down_proj"))
            if not all(isinstance(v, LazyExperts) for v in (ex.up, ex.down)):
                raise RuntimeError(f"deviation check: {prefix} experts are not upcycled shards")
        return b

    @torch.no_grad()
    def _step(self, key: str, tensors: dict, moe: dict | None):
        if key == "embeddings.weight":
            self.emb = tensors[key]
            x = start(self.cfg, self.emb[self.ids].float())
            self.stream = {"x": torch.cat([x, x])}  # [dense stream; upcycled stream]
            self.walk = walker(len(self.cfg.pattern), self.stream, one_pass(("x",)))
            next(self.walk)
        elif key.startswith("layers."):
            i = int(key.split(".")[1])
            kind, p = self.cfg.pattern[i], key + "."
            block = self._load(self.cfg, kind, p, tensors)
            dense = block.mixer
            if KINDS[kind].upcycles_to:  # the dense MLP on the dense stream, the MoE on the upcycled one
                moe_t = {k: v for k, v in tensors.items() if k.startswith(p + "norm.")}
                moe_t.update((p + "mixer." + k, v) for k, v in moe.items())
                m = self._load(self.moe_cfg, KINDS[kind].upcycles_to, p, moe_t).mixer
                block.mixer = Paired(dense, m, self.b, lambda d: self.layers.append({"layer": i, **d}))
            try:
                with contextlib.suppress(StopIteration):  # the last layer ends the walk
                    self.walk.send(block)
            finally:
                block.mixer = dense
        elif key == "norm_f.weight":
            self.norm_f = tensors[key].float()
            if self.cfg.tie_word_embeddings:
                self._finish(self.emb)
        else:
            self._finish(tensors[key])

    def _finish(self, head: torch.Tensor):
        norm = trunk_norm(self.cfg)
        norm.weight.data = self.norm_f
        finish(self.cfg, norm, self.stream.pop("x"), lambda h: self._compare(h, head))

    def _compare(self, h: torch.Tensor, head: torch.Tensor):
        """The dense and upcycled streams' logits, compared a vocab block at a time."""
        b = self.b
        dmax = dense_max = sq_diff = sq_ref = 0.0
        for w in head.split(max(1, CAST_BYTES * 8 // (4 * head.shape[1]))):  # vocab rows of 8 MiB in fp32
            z = linear_f32(h, w)
            ref, diff = z[:b], z[b:] - z[:b]
            dmax = max(dmax, diff.abs().max().item())
            dense_max = max(dense_max, ref.abs().max().item())
            sq_diff += diff.pow(2).sum().item()
            sq_ref += ref.pow(2).sum().item()
        self.result = {"max_abs_logit_diff": dmax, "rel_diff": (sq_diff / max(sq_ref, 1e-60)) ** 0.5,
                       "max_abs_dense_logit": dense_max, "sequences": b, "seq_len": self.ids.shape[1],
                       "dtype": "float32", "layers": self.layers,
                       "method": "dense and upcycled forwards of random tokens, layer by layer as the weights "
                                 "stream (MoE weights as written); per-layer figures compare MoE and dense MLP "
                                 "outputs on the upcycled stream's inputs"}
