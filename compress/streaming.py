"""Layer streaming: the importance scores of compress.importance (same sites, same numbers as its
`score_model`) from a checkpoint with one layer's weights in memory at a time.

`score_streaming` keeps the calibration hidden states in a StateStore that spills to safetensors files
past a byte budget; loss_increase over k batches costs L(L-1)/2 layer passes (each layer loaded once),
keeping L+1 branches of states. `Streaming` holds how it runs (budget, spill folder, device, dtype).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from remodel.models.checkpoint import CheckpointReader
from remodel.models.config import ModelConfig
from remodel.models.hf import config_from_hf, our_shapes
from remodel.models.load import iter_our_tensors
from remodel.models.model import Block, init_buffers
from remodel.models.mtp import MTPBlock, mtp_block_roles
from remodel.models.norm import trunk_norm
from remodel.models.trunk import finish, start, walk, walk_mtp

from .head_loo import HeadMask, loo_scores, loo_units
from .importance import Scorer, lm_loss_sums, mean_loss, mtp_mask
from .state_store import StateStore


@dataclass(frozen=True)
class Streaming:
    """How score_streaming runs: hidden states held in memory up to max_memory_bytes (None: no bound),
    the rest spilled to spill_dir; the layers run on `device` in `dtype`; progress shows a bar."""
    max_memory_bytes: int | None = None
    spill_dir: object = None
    device: object = "cpu"
    dtype: torch.dtype = torch.float32
    progress: bool = False


def _load(reader, cfg, names, device, dtype) -> dict[str, torch.Tensor]:
    return {n: t.to(device=device, dtype=dtype if t.is_floating_point() and not n.endswith("correction_bias")
                    else t.dtype) for n, t in iter_our_tensors(reader, cfg, names=set(names))}


def load_block(reader: CheckpointReader, cfg: ModelConfig, i: int, device="cpu", dtype=torch.float32,
               mtp: bool = False) -> Block:
    """Layer i alone (MTP block i when mtp): built on the meta device, then given exactly its own
    tensors from the checkpoint."""
    prefix = f"mtp.layers.{i}." if mtp else f"layers.{i}."
    state = _load(reader, cfg, [n for n in our_shapes(cfg) if n.startswith(prefix)], device, dtype)
    with torch.device("meta"):
        block = (MTPBlock(cfg, cfg.mtp_full_pattern[i], *mtp_block_roles(cfg, i)) if mtp
                 else Block(cfg, cfg.pattern[i]))
    block.load_state_dict({n[len(prefix):]: t for n, t in state.items()}, assign=True)
    return init_buffers(block, device).eval()


@dataclass
class _Pass:
    """What every layer pass of one streaming run shares: the checkpoint and its config, the scorer, the
    store of hidden states, each batch's padding mask on the device, the device and the dtype."""
    reader: CheckpointReader
    cfg: ModelConfig
    scorer: Scorer
    store: StateStore
    mask_of: list
    device: torch.device
    dtype: torch.dtype

    def load(self, names) -> dict[str, torch.Tensor]:
        return _load(self.reader, self.cfg, names, self.device, self.dtype)

    def block(self, i: int, mtp: bool = False) -> Block:
        return load_block(self.reader, self.cfg, i, self.device, self.dtype, mtp=mtp)


class _OnDevice:
    """The store's streams as the walker reads them: each moved to the device when a slot takes it."""

    def __init__(self, store: StateStore, device):
        self.store, self.device = store, device

    def __getitem__(self, key):
        return self.store[key].to(self.device)

    def __setitem__(self, key, value):
        self.store[key] = value


@contextlib.contextmanager
def _scored(scorer: Scorer, i: int, block, mtp: bool = False):
    """A pass under the scorer's hooks on block i (MTP block i when mtp)."""
    (scorer.attach_mtp if mtp else scorer.attach_layer)(i, block)
    try:
        yield
    finally:
        scorer.detach()


def _trunk_streaming(ps: _Pass, n: int, k: int, progress: bool, units=(), km: int = 0):
    """The trunk's layers, one at a time, over store['main', b] (b < n), scored; the k loss batches'
    skipped-layer branches (store[i, b]: without layer i) go through every later layer too, as do the km loss
    batches' branches of each measured unit (store['u', i, name, u, b]: layer i run with unit u removed;
    `units` as head_loo.loo_units(cfg, measured=True))."""
    store, bar = ps.store, tqdm(total=ps.cfg.num_layers, desc="layers", disable=not progress)
    later = []  # the measured branches made so far: they go through every later layer

    def passes(i, block):
        for b in range(k):
            store[i, b] = store["main", b]  # the branch without layer i starts from layer i's input
        mine = [(name, u, c) for j, name, chans in units if j == i for u, c in enumerate(chans)]
        for name, u, c in mine:
            keys = [("u", i, name, u, b) for b in range(km)]
            for key in keys:
                store[key] = store["main", key[-1]]
            yield keys, HeadMask(block, c)  # attached as the pass starts, removed as it ends
        yield [("main", b) for b in range(n)], _scored(ps.scorer, i, block)
        yield [(j, b) for j in range(i) for b in range(k)] + later, contextlib.nullcontext()  # through it too
        later.extend(("u", i, name, u, b) for name, u, _ in mine for b in range(km))
        bar.update()

    walk(ps.cfg.num_layers, ps.block, _OnDevice(store, ps.device), passes, lambda key: (ps.mask_of[key[-1]],))
    bar.close()


def _mtp_streaming(ps: _Pass, batches):
    """The MTP head on the trunk's outputs (store['mtp', b], after norm_f), one block at a time,
    as run_mtp does it whole: each block's units are scored from its own activations."""
    store, device = ps.store, ps.device
    emb = ps.load(["embeddings.weight"])["embeddings.weight"]
    keys = [("mtp", b) for b in range(len(batches))]
    walk_mtp(ps.cfg, lambda j: ps.block(j, mtp=True), _OnDevice(store, device), keys,
             lambda key, k: F.embedding(batches[key[1]][:, k + 1:].to(device), emb),
             lambda key, k: mtp_mask(ps.mask_of[key[1]], k),
             around=lambda j, block: (_scored(ps.scorer, j, block, mtp=True), None))
    for key in keys:
        store.pop(key)


def _final(ps: _Pass):
    """-> (the final norm on the device, the LM head's weight: the tied embeddings or lm_head)."""
    cfg = ps.cfg
    final = ["norm_f.weight", "embeddings.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    w = ps.load(final)
    norm_f = trunk_norm(cfg).to(ps.device)
    norm_f.weight.data = w["norm_f.weight"]
    return norm_f, w[final[1]]


def _unit_costs(units, km: int, branch, base: float) -> dict:
    """{`layers.i.<unit>_loo`: each measured unit's loss increase}: the mean loss of its km batches' branches
    (store['u', i, name, u, b]) minus the base's on the same batches."""
    return {f"layers.{i}.{name}": torch.tensor([mean_loss([branch(("u", i, name, u, b)) for b in range(km)]) - base
                                                for u in range(len(chans))], dtype=torch.float32)
            for i, name, chans in units}


@torch.no_grad()
def score_streaming(path, batches, masks=None, loss_increase=True, loss_batches=4, run: Streaming = Streaming(),
                    in_sites=False, measured=False):
    """Scores of a checkpoint with one layer's weights in memory at a time -> (scores, info); in_sites as Scorer's;
    measured: the default criterion's measured units ranked by their LOO cost over the loss batches, as
    head_loo.measured_scores does it whole. Hidden states of every calibration batch (and of the loss batches for
    every skipped-layer and measured-unit branch) live in a StateStore of run.max_memory_bytes; the rest is
    spilled to run.spill_dir."""
    reader = path if isinstance(path, CheckpointReader) else CheckpointReader(path)
    cfg = config_from_hf(reader.config)
    L, dev, dtype = cfg.num_layers, torch.device(run.device), run.dtype
    k = min(loss_batches, len(batches)) if loss_increase else 0
    units = loo_units(cfg, measured=True) if measured else []
    km = min(loss_batches, len(batches)) if units else 0
    mask_of = [None if masks is None or masks[b] is None else masks[b].to(dev) for b in range(len(batches))]
    store, scorer = StateStore(run.max_memory_bytes, run.spill_dir), Scorer(cfg=cfg, in_sites=in_sites)
    ps = _Pass(reader, cfg, scorer, store, mask_of, dev, dtype)
    try:
        emb = ps.load(["embeddings.weight"])["embeddings.weight"]
        for b, ids in enumerate(batches):
            store["main", b] = start(cfg, F.embedding(ids.to(dev), emb))
        del emb
        _trunk_streaming(ps, len(batches), k, run.progress, units, km)
        norm_f, W = _final(ps)

        def head(b, ids, keep=True):
            def loss_sums(h):
                if keep and cfg.mtp_layers:
                    store["mtp", b] = h  # the MTP head reads the trunk's output
                return lm_loss_sums(h, W, ids, mask_of[b])
            return loss_sums

        scorer.attach_final(norm_f)
        sums = []
        try:
            for b, ids in enumerate(batches):
                scorer.update(mask_of[b])
                x = store["main", b].to(dev)
                store.pop(("main", b))
                sums.append(finish(cfg, norm_f, x, head(b, ids)))
        finally:
            scorer.detach()
        if cfg.mtp_layers:
            _mtp_streaming(ps, batches)
        scores = scorer.result()

        def branch(key):  # a branch's loss sums on its batch (the batch is the key's last part)
            return finish(cfg, norm_f, store[key].to(dev), head(key[-1], batches[key[-1]], keep=False))

        if k:
            base = mean_loss(sums[:k])
            scores["loss_increase"] = torch.tensor([mean_loss([branch((j, b)) for b in range(k)]) - base
                                                    for j in range(L)], dtype=torch.float32)
        if units:
            scores = loo_scores(cfg, scores, _unit_costs(units, km, branch, mean_loss(sums[:km])))
        info = {"baseline_loss": mean_loss(sums), "tokens": int(scorer.tokens), "loss_batches": k,
                "spilled_bytes": store.spilled}
    finally:
        store.close()
    return scores, info
