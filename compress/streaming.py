"""Layer streaming: the importance scores of compress.importance (same sites, same numbers as its
`score_model`) from a checkpoint with one layer's weights in memory at a time.

`score_streaming` keeps the calibration hidden states in a StateStore that spills to safetensors files
past a byte budget; loss_increase over k batches costs L(L-1)/2 layer passes (each layer loaded once),
keeping L+1 branches of states. `Streaming` holds how it runs (budget, spill folder, device, dtype).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from remodel.models.checkpoint import CheckpointReader
from remodel.models.config import ModelConfig
from remodel.models.hf import config_from_hf, our_shapes
from remodel.models.load import iter_our_tensors
from remodel.models.model import Block, final_hidden, init_buffers, scale_embedding
from remodel.models.mtp import MTPBlock, mtp_block_roles
from remodel.models.norm import trunk_norm

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


def _trunk_streaming(ps: _Pass, n: int, k: int, progress: bool):
    """The trunk's layers, one at a time, over store['main', b] (b < n), scored; the k loss batches'
    skipped-layer branches (store[i, b]: without layer i) go through every later layer too."""
    store, mask_of = ps.store, ps.mask_of
    for i in tqdm(range(ps.cfg.num_layers), desc="layers", disable=not progress):
        block = ps.block(i)
        ps.scorer.attach_layer(i, block)
        try:
            for b in range(n):
                x = store["main", b].to(ps.device)
                if b < k:
                    store[i, b] = x  # the branch without layer i starts from layer i's input
                store["main", b] = block(x, mask_of[b])
        finally:
            ps.scorer.detach()
        for j in range(i):  # branches that skipped an earlier layer go through this one
            for b in range(k):
                store[j, b] = block(store[j, b].to(ps.device), mask_of[b])
        del block


def _mtp_streaming(ps: _Pass, batches):
    """The MTP head on the trunk's outputs (store['mtp', b], after norm_f), one block at a time,
    as run_mtp does it whole: each block's units are scored from its own activations."""
    cfg, store, mask_of, device = ps.cfg, ps.store, ps.mask_of, ps.device
    emb = ps.load(["embeddings.weight"])["embeddings.weight"]
    P = len(cfg.mtp_pattern)
    for j in range(len(cfg.mtp_full_pattern)):
        k, block = j // P, ps.block(j, mtp=True)
        ps.scorer.attach_mtp(j, block)
        try:
            for b, ids in enumerate(batches):
                x = store["mtp", b].to(device)
                if j % P == 0:  # a step starts: drop the last row, fuse the tokens k + 1 further on
                    x = block(x[:, :-1], F.embedding(ids[:, k + 1:].to(device), emb), mtp_mask(mask_of[b], k))
                else:
                    x = block(x, None, mtp_mask(mask_of[b], k))
                store["mtp", b] = x
        finally:
            ps.scorer.detach()
        del block
    for b in range(len(batches)):
        store.pop(("mtp", b))


@torch.no_grad()
def score_streaming(path, batches, masks=None, loss_increase=True, loss_batches=4, run: Streaming = Streaming()):
    """Scores of a checkpoint with one layer's weights in memory at a time -> (scores, info).
    Hidden states of every calibration batch (and of the k loss batches for every skipped-layer
    branch) live in a StateStore of run.max_memory_bytes; the rest is spilled to run.spill_dir."""
    reader = path if isinstance(path, CheckpointReader) else CheckpointReader(path)
    cfg = config_from_hf(reader.config)
    L, dev, dtype = cfg.num_layers, torch.device(run.device), run.dtype
    k = min(loss_batches, len(batches)) if loss_increase else 0
    mask_of = [None if masks is None or masks[b] is None else masks[b].to(dev) for b in range(len(batches))]
    store, scorer = StateStore(run.max_memory_bytes, run.spill_dir), Scorer(cfg=cfg)
    ps = _Pass(reader, cfg, scorer, store, mask_of, dev, dtype)
    try:
        emb = ps.load(["embeddings.weight"])["embeddings.weight"]
        for b, ids in enumerate(batches):
            store["main", b] = scale_embedding(cfg, F.embedding(ids.to(dev), emb))
        del emb
        _trunk_streaming(ps, len(batches), k, run.progress)
        final = ["norm_f.weight", "embeddings.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        w = ps.load(final)
        norm_f = trunk_norm(cfg).to(dev)
        norm_f.weight.data = w["norm_f.weight"]
        W = w[final[1]]
        scorer.attach_final(norm_f)
        sums = []
        try:
            for b, ids in enumerate(batches):
                scorer.update(mask_of[b])
                h = final_hidden(cfg, norm_f, store["main", b].to(dev))
                store.pop(("main", b))
                sums.append(lm_loss_sums(h, W, ids, mask_of[b]))
                if cfg.mtp_layers:
                    store["mtp", b] = h
        finally:
            scorer.detach()
        if cfg.mtp_layers:
            _mtp_streaming(ps, batches)
        scores = scorer.result()
        if k:
            base = mean_loss(sums[:k])
            scores["loss_increase"] = torch.tensor(
                [mean_loss([lm_loss_sums(final_hidden(cfg, norm_f, store[j, b].to(dev)), W,
                                         batches[b], mask_of[b])
                            for b in range(k)]) - base
                 for j in range(L)], dtype=torch.float32)
        info = {"baseline_loss": mean_loss(sums), "tokens": int(scorer.tokens), "loss_batches": k,
                "spilled_bytes": store.spilled}
    finally:
        store.close()
    return scores, info
