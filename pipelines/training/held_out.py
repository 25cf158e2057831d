"""The held-out figures of a training run: the blocks of --eval-data, the teacher's and the student's
perplexity on those same blocks, and the description the report gives of them (data, sequence length,
token count and the `remodel eval` command that measures the written model on the same tokens)."""
from __future__ import annotations

import shlex

from .evaluate import EvalRun, evaluate
from ..distributed.parallel import parallel_info
from .vocab_parallel import parallel_loss_fns

LOSS_TERMS = {
    "total": "the sum minimised: kl_weight * kl + lm_loss_weight * lm + hidden_loss_weight * hidden + lb_coeff * lb "
             "+ z_coeff * z (weights in args)",
    "kl": "KL(teacher || student) of the next-token distributions at the temperature, nats/token",
    "lm": "next-token cross-entropy of the student on the training tokens, nats/token",
    "hidden": "1 - cosine of the mapped hidden states (student projected to the teacher's width)",
    "lb": "MoE load-balancing loss (unweighted)", "z": "router z-loss (unweighted)",
}


def held_out_blocks(cfg, tokenizer):
    """LongTensor [N, seq_len]: --eval-data packed as `remodel eval --data D --seq-len L --max-tokens
    eval_tokens` packs it (pipelines.data.data.pack), so both measure the same tokens."""
    from ..data.data import load_texts, pack
    return pack(load_texts(cfg.eval_data), tokenizer, cfg.seq_len, max_tokens=cfg.eval_tokens)


def evaluate_on(model, blocks, batch: int, use_bf16) -> dict:
    """Loss and perplexity of `model` (whole or sharded: its own vocab-parallel loss) on `blocks`."""
    fns = parallel_loss_fns(parallel_info(model))
    return evaluate(model, blocks, batch=batch, run=EvalRun(use_bf16, fns.get("lm_loss")))


def held_out(cfg, blocks, out_dir) -> dict:
    """The report's "held_out": what the eval figures were measured on, and the eval command that
    measures the written model on the same tokens."""
    cmd = ["remodel", "eval", str(out_dir), "--data", str(cfg.eval_data), "--seq-len", str(cfg.seq_len),
           "--max-tokens", str(cfg.eval_tokens)]
    return {"data": str(cfg.eval_data), "seq_len": int(blocks.shape[1]), "sequences": int(blocks.shape[0]),
            "tokens": int(blocks.numel()), "max_tokens": cfg.eval_tokens,
            "eval_command": " ".join(map(shlex.quote, cmd))}


def last_losses(history: list[dict]) -> dict | None:
    """The last step's loss terms by name ("total" is the history's "loss"), None before a step."""
    if not history:
        return None
    row = history[-1]
    return {("total" if k == "loss" else k): row[k] for k in ("loss", "kl", "lm", "hidden", "lb", "z")
            if row.get(k) is not None}
