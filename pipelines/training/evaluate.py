"""Next-token loss, perplexity and forward tokens/s of a model on data (`remodel eval`, and the
held-out figures of a training run)."""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from tqdm.auto import tqdm

from remodel.models.errors import RemodelError
from remodel.models.load import load_config, load_model

from .losses import lm_loss
from ..distributed.runtime import load_tokenizer, pick_device


class EvalRun(NamedTuple):
    """How the forward passes run: bf16 autocast on CUDA ("auto" or True: on, False: off) and the loss
    (None: losses.lm_loss; e.g. the vocab-parallel CE of a sharded model, whose ranks then all evaluate the
    same blocks together)."""
    bf16: bool | str = "auto"
    loss_fn: Callable | None = None


def _check_positive(**kw):
    for k, v in kw.items():
        if v is not None and not v > 0:
            raise RemodelError(f"{k} must be > 0, got {v}")


def _check_block(seq_len: int, max_tokens: int | None):
    """Rules that make an evaluation pointless, refused before a model is loaded: a block needs two tokens
    (one predicted), and --max-tokens at least one block."""
    if seq_len < 2:
        raise RemodelError(f"seq_len must be >= 2 (--seq-len): a block of {seq_len} token predicts nothing")
    if max_tokens is not None and max_tokens < seq_len:
        raise RemodelError(f"max_tokens {max_tokens} (--max-tokens) is less than one block of {seq_len} tokens "
                           "(--seq-len): nothing to evaluate")


@torch.no_grad()
def evaluate(model_or_dir, data, seq_len: int = 256, batch: int = 8, max_tokens: int | None = None,
             tokenizer=None, device="auto", run: EvalRun = EvalRun()) -> dict:
    """Next-token loss (nats/token), perplexity and forward tokens/s over packed blocks of `data`
    (a DATA path, a datasets.Dataset with 'text', or a LongTensor [N, L] of ids); run: autocast and loss.
    A model directory supplies its own tokenizer; a model object needs `tokenizer` for text data.
    The figures name their tokens: tokens (N * L), sequences N, seq_len L, predicted_tokens N * (L - 1),
    and data (a DATA path; other data is named by the caller)."""
    from ..data.data import load_texts, pack

    _check_positive(seq_len=seq_len, batch=batch, max_tokens=max_tokens)
    if not torch.is_tensor(data):
        _check_block(seq_len, max_tokens)
    if isinstance(model_or_dir, (str, Path)):
        dev = pick_device(device)
        load_config(model_or_dir)  # one-line error for a bad dir before anything heavy
        if tokenizer is None and not torch.is_tensor(data):
            tokenizer = load_tokenizer(model_or_dir)
        model = load_model(model_or_dir, device=dev)
    else:
        model = model_or_dir
        dev = next(model.parameters()).device
    if torch.is_tensor(data):
        blocks = data if max_tokens is None else data[: max(1, max_tokens // data.shape[1])]
    else:
        if tokenizer is None:
            raise RemodelError("evaluate: text data needs a tokenizer")
        ds = load_texts(data) if isinstance(data, (str, Path)) else data
        blocks = pack(ds, tokenizer, seq_len, max_tokens=max_tokens)
    if blocks.dim() != 2 or blocks.shape[0] == 0 or blocks.shape[1] < 2:
        raise RemodelError(f"evaluate: no full block of {seq_len} tokens (--seq-len) in the data "
                           f"({blocks.numel()} tokens): nothing to evaluate")
    if int(blocks.max()) >= model.cfg.vocab_size:
        raise RemodelError(f"token id {int(blocks.max())} is outside the model's vocabulary ({model.cfg.vocab_size})")
    use_bf16 = dev.type == "cuda" and (run.bf16 is True or run.bf16 == "auto")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    try:
        for i in tqdm(range(0, len(blocks), batch), desc="eval", unit="batch", leave=False):
            ids = blocks[i:i + batch].to(dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16):
                logits = model(ids)
            n = ids[:, 1:].numel()
            total += (run.loss_fn or lm_loss)(logits[:, :-1], ids[:, 1:]).item() * n
            count += n
        sync()
    finally:
        model.train(was_training)
    dt = time.perf_counter() - t0
    loss = total / count
    named = {"data": str(data)} if isinstance(data, (str, Path)) else {}  # token blocks: the caller names them
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": int(blocks.numel()),
            "sequences": int(blocks.shape[0]), "seq_len": int(blocks.shape[1]), "predicted_tokens": count,
            **named, "tokens_per_s": blocks.numel() / dt}


def describe(ev: dict, data=None) -> str:
    """'ppl 52.64 (loss 3.9634 nats/token) on 16,384 tokens (64 x 256, 16,320 predicted) of DATA': a
    perplexity with the tokens it was measured on (data: the source's name when `ev` carries none)."""
    src = ev.get("data", data)
    return (f"ppl {ev['ppl']:.4g} (loss {ev['loss']:.4f} nats/token) on {ev['tokens']:,} tokens "
            f"({ev['sequences']} x {ev['seq_len']}, {ev['predicted_tokens']:,} predicted)"
            + (f" of {src}" if src is not None else ""))
