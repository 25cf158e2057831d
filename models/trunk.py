"""The one walk of the trunk: embedding rows -> every layer slot in order -> final norm -> a head.

HybridLM, streaming scoring, the upcycle deviation check and the head leave-one-out scorer all walk
through here; what differs between them is where a slot's weights come from (resident blocks, a
checkpoint read one layer at a time, tensors the upcycle writer streams) and which hidden streams pass
each slot (one batch; every calibration batch and its skipped-layer branches; the dense and upcycled
streams side by side). The slot's block is the one thing that applies norm -> mixer -> residual join.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, MutableMapping


def start(cfg, rows):
    """The residual stream's start from the embedding rows: times cfg.scales.embedding_multiplier (Granite,
    Falcon-H1)."""
    return rows if cfg.scales.embedding_multiplier == 1 else rows * cfg.scales.embedding_multiplier


def finish(cfg, norm_f, x, head: Callable | None = None):
    """The walked stream x through the final norm, times cfg.scales.lm_head_multiplier, divided by
    cfg.scales.logits_scaling (what any output projection reads to give the model's logits), then through `head`
    (the logits' projection, a loss over vocab chunks, two streams' logits compared; None: the final hidden
    states themselves). The one place the final norm meets a head."""
    h = norm_f(x)
    if cfg.scales.lm_head_multiplier != 1:
        h = h * cfg.scales.lm_head_multiplier
    h = h if cfg.scales.logits_scaling == 1 else h / cfg.scales.logits_scaling
    return h if head is None else head(h)


Passes = Callable[[int, object], Iterable[tuple[Iterable, contextlib.AbstractContextManager]]]


def one_pass(keys) -> Passes:
    """Every slot applied to the streams `keys`, nothing around it."""
    return lambda i, block: ((keys, contextlib.nullcontext()),)


def walker(num_layers: int, states: MutableMapping, passes: Passes, args: Callable = lambda key: ()) -> Iterator[int]:
    """A generator over the slots: it yields slot i's index and is sent that slot's block; the block is then
    applied, in order, to every stream of every pass `passes(i, block)` gives (keys into `states`, the context
    the pass runs under: a scorer's hooks), each stream as block(states[key], *args(key)). Code a pass
    generator runs after its yield sees the slot's outputs. Pull (walk) and push (a writer that hands over
    one layer at a time) both drive it."""
    for i in range(num_layers):
        block = yield i
        for keys, ctx in passes(i, block):
            with ctx:
                for key in keys:
                    states[key] = block(states[key], *args(key))
        del block


def walk(num_layers: int, block_of: Callable, states: MutableMapping, passes: Passes,
         args: Callable = lambda key: ()) -> MutableMapping:
    """Every slot's block_of(i) applied to the streams in `states` (see walker); returns states."""
    g = walker(num_layers, states, passes, args)
    with contextlib.suppress(StopIteration):
        i = next(g)
        while True:
            i = g.send(block_of(i))
    return states


def walk_mtp(cfg, block_of: Callable, states: MutableMapping, keys, rows: Callable, mask_of: Callable = lambda key, k: None,
             around: Callable | None = None) -> MutableMapping:
    """The MTP head over the trunk's outputs in `states` (after the final norm), through the same walker:
    block j belongs to step k = j // len(cfg.mtp_pattern); a step's first block drops each stream's last row
    and fuses the embedding rows of the tokens k + 1 further on (rows(key, k)); mask_of(key, k) is the step's
    padding mask; around(j, block) -> (the context block j's pass runs under, a callback after it) (a scorer's
    hooks; a step's logits)."""
    P, at = len(cfg.mtp_pattern), {}

    def passes(j, block):
        at.update(k=j // P, start=j % P == 0)
        if at["start"]:
            for key in keys:
                states[key] = states[key][:, :-1]
        ctx, after = around(j, block) if around else (contextlib.nullcontext(), None)
        yield keys, ctx
        if after is not None:
            after(j)

    return walk(len(cfg.mtp_full_pattern), block_of, states, passes,
                lambda key: (rows(key, at["k"]) if at["start"] else None, mask_of(key, at["k"])))
