"""Train the embedded default checkpoint (data/embedded): a ~3.3M-parameter Nemotron-H hybrid on the
shipped KJV corpus, on CPU: ~10 minutes on an idle 2-core machine, training capped at --max-minutes.

    python data/train_embedded.py                      # writes data/embedded (overwrites it)
    python data/train_embedded.py --max-minutes 5 --out /tmp/emb

A self-contained loop (no dependency on pipelines/training/train.py): AdamW, linear warm-up then cosine decay,
grad clip 1.0, batch 16 x 256 tokens, seeded init and data order. The schedule follows
progress = max(tokens done / token budget, minutes spent / --max-minutes), so a slow machine still
anneals to the final learning rate instead of stopping mid-schedule (the run is reproducible only
when the token count alone set every step's learning rate: clock_governed_steps 0 in the log).
At the end the weights are saved in bfloat16 and reloaded, and the *shipped* weights are evaluated
in fp32 on the whole valid split (ours and transformers' NemotronHForCausalLM, which must agree
within 1e-3); data/embedded/train_log.json and README.md record the run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# OpenMP threads that spin while waiting burn CPU on a shared, oversubscribed machine; must be set
# before torch loads libgomp.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from remodel.models.config import ModelConfig  # noqa: E402
from remodel.models.load import load_model, save_model  # noqa: E402
from remodel.models.model import HybridLM, init_weights  # noqa: E402
from remodel.pipelines.data.data import batches, embedded_corpus, embedded_tokenizer_path, load_texts, pack  # noqa: E402

SLICE_TOKENS = 8192  # the fixed held-out slice tests/test_embedded.py re-evaluates: first 32 valid blocks


def embedded_config() -> ModelConfig:
    """4 Mamba-2 + 3 relu2 MLP + 1 attention layer; widths chosen so that 25%/50% pruning of Mamba heads
    (4 per group), FFN (768) and hidden (256) stays integral."""
    return ModelConfig(
        vocab_size=2048, hidden_size=256, pattern="M-M*M-M-", norm_eps=1e-5, tie_word_embeddings=False,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=None,
        intermediate_size=768, mlp_act="relu2",
        mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=32, conv_kernel=4, chunk_size=64,
        extra={"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "max_position_embeddings": 4096})


def lr_at(progress: float, peak: float, warmup: float, final_ratio: float) -> float:
    """Linear warm-up over the first `warmup` fraction of progress, then cosine to final_ratio * peak."""
    if progress < warmup:
        return peak * progress / warmup
    p = min((progress - warmup) / (1 - warmup), 1.0)
    return peak * (final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


@torch.no_grad()
def block_losses(forward, blocks: torch.Tensor, batch_size: int = 16, desc: str = "eval") -> torch.Tensor:
    """Summed next-token cross-entropy (nats) of each block [N] (seq_len - 1 predictions each), in order."""
    out = []
    for x in tqdm(list(batches(blocks, batch_size)), desc=desc, leave=False):
        logits = forward(x).float()
        loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
        out.append(loss.double().sum(1))
    return torch.cat(out)


def mean_loss(losses: torch.Tensor, seq_len: int) -> float:
    return losses.sum().item() / (len(losses) * (seq_len - 1))


def hf_forward(model):
    return lambda x: model(input_ids=x).logits


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "data" / "embedded"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-2,
                    help="peak learning rate (one epoch at 3e-3 / 6e-3 / 1e-2 gave held-out loss 4.25 / 4.16 / 4.10)")
    ap.add_argument("--final-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=float, default=0.05, help="warm-up, as a fraction of the run")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--tokens", type=int, default=None, help="token budget (default: one epoch of train)")
    ap.add_argument("--max-minutes", type=float, default=20.0, help="wall-clock budget of the training loop")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-hf-check", action="store_true", help="skip the transformers cross-check")
    return ap.parse_args(argv)


def train_model(model, train: torch.Tensor, args, total_steps: int) -> dict:
    """The training loop: AdamW, linear warm-up + cosine over whichever of the token budget and the
    wall-clock budget runs out first. -> the figures the log records."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "conv1d" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "conv1d" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    data = batches(train, args.batch, shuffle_seed=args.seed, epochs=None, drop_last=True)
    t0, step, tokens, ema, curve = time.time(), 0, 0, None, []
    bar = tqdm(total=total_steps, desc="train")
    stopped_by, clock_steps = "tokens", 0  # steps whose learning rate the clock (not the token count) set
    while step < total_steps:
        elapsed_min = (time.time() - t0) / 60
        if elapsed_min >= args.max_minutes:  # the clock-driven cosine has reached its end
            stopped_by = "time"
            break
        token_p, clock_p = (step + 1) / total_steps, elapsed_min / args.max_minutes  # this step counts
        progress = max(token_p, clock_p)
        clock_steps += clock_p > token_p
        lr = lr_at(progress, args.lr, args.warmup, args.final_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        x = next(data)
        logits = model(x)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, model.cfg.vocab_size), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        curve.append([step, round(loss.item(), 4)])
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.2e}", gn=f"{gnorm:.2f}")
        if not math.isfinite(loss.item()):
            raise SystemExit(f"loss is {loss.item()} at step {step}")
    bar.close()
    return {"steps": step, "tokens": tokens, "stopped_by": stopped_by, "clock_steps": clock_steps,
            "train_minutes": (time.time() - t0) / 60, "curve": curve}


def evaluate_shipped(model, out: Path, valid: torch.Tensor, args) -> dict:
    """Held-out losses of the saved bf16 weights (ours, the whole split and the fixed slice), of the fp32
    model before saving, and of transformers' load of OUT (must agree within 1e-3)."""
    shipped = load_model(out)  # fp32 copy of the bf16 weights
    n_slice = SLICE_TOKENS // args.seq_len
    losses = block_losses(shipped, valid, desc="valid (ours)")
    valid_loss, slice_loss = mean_loss(losses, args.seq_len), mean_loss(losses[:n_slice], args.seq_len)
    fp32_loss = mean_loss(block_losses(model, valid, desc="valid (fp32 before save)"), args.seq_len)
    print(f"held-out loss {valid_loss:.4f} ppl {math.exp(valid_loss):.3f} (before bf16: {fp32_loss:.4f}); "
          f"slice of {n_slice * args.seq_len} tokens: ppl {math.exp(slice_loss):.3f}")
    hf_loss = None
    if not args.no_hf_check:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, trust_remote_code=False).eval()
        hf_loss = mean_loss(block_losses(hf_forward(hf), valid, desc="valid (transformers)"), args.seq_len)
        print(f"transformers held-out loss {hf_loss:.4f} (diff {abs(hf_loss - valid_loss):.2e})")
        if abs(hf_loss - valid_loss) > 1e-3:
            raise SystemExit(f"transformers disagrees: {hf_loss} vs {valid_loss}")
    return {"valid": valid_loss, "slice": slice_loss, "fp32": fp32_loss, "hf": hf_loss, "n_slice": n_slice}


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoTokenizer
    tok_dir = embedded_tokenizer_path()
    tok = AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=False)
    train_path, valid_path = embedded_corpus()
    train = pack(load_texts(train_path), tok, args.seq_len)
    valid = pack(load_texts(valid_path), tok, args.seq_len)
    budget = args.tokens or train.numel()
    total_steps = math.ceil(budget / (args.batch * args.seq_len))
    print(f"train {train.numel():,} tokens ({len(train)} blocks), valid {valid.numel():,} tokens; "
          f"budget {budget:,} tokens = {total_steps} steps of {args.batch}x{args.seq_len}")
    cfg = embedded_config()
    model = init_weights(HybridLM(cfg), seed=args.seed).train()
    n_params = sum(p.numel() for p in model.parameters())
    run = train_model(model, train, args, total_steps)
    curve = run["curve"]
    final_train = sum(v for _, v in curve[-20:]) / len(curve[-20:])
    print(f"trained {run['steps']} steps, {run['tokens']:,} tokens in {run['train_minutes']:.1f} min (stopped by "
          f"{run['stopped_by']}); train loss (last 20 steps) {final_train:.4f}")

    # save in bf16, reload, and evaluate exactly what ships
    out = Path(args.out)
    save_model(model.eval(), out, aux_from=tok_dir, dtype=torch.bfloat16, overwrite=True)
    ev = evaluate_shipped(model, out, valid, args)
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    log = {
        "config": cfg.to_dict(),
        "params": n_params,
        "seed": args.seed,
        "command": "python " + " ".join([str(Path(sys.argv[0]).as_posix())] + sys.argv[1:]),
        "hyperparameters": {"lr": args.lr, "final_lr_ratio": args.final_lr_ratio, "warmup_fraction": args.warmup,
                            "weight_decay": args.weight_decay, "betas": [0.9, 0.95], "grad_clip": 1.0,
                            "batch": args.batch, "seq_len": args.seq_len, "schedule": "linear warm-up + cosine",
                            "max_minutes": args.max_minutes, "threads": args.threads},
        "steps": run["steps"],
        "tokens_trained": run["tokens"],
        "token_budget": budget,
        "stopped_by": run["stopped_by"],
        "clock_governed_steps": run["clock_steps"],
        "train_minutes": round(run["train_minutes"], 2),
        "final_train_loss": round(final_train, 4),
        "saved_dtype": "bfloat16",
        "valid_tokens": valid.numel(),
        "valid_loss": round(ev["valid"], 5),
        "valid_ppl": round(math.exp(ev["valid"]), 4),
        "valid_loss_fp32_before_save": round(ev["fp32"], 5),
        "valid_loss_transformers": None if ev["hf"] is None else round(ev["hf"], 5),
        "slice": {"tokens": ev["n_slice"] * args.seq_len, "seq_len": args.seq_len, "blocks": ev["n_slice"],
                  "loss": round(ev["slice"], 5), "ppl": round(math.exp(ev["slice"]), 4)},
        "files": files,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "loss_curve": curve,
    }
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    (out / "README.md").write_text(readme(log))
    print(f"wrote {out}")


def readme(log: dict) -> str:
    c = log["config"]
    size = sum(log["files"].values())
    return f"""# Embedded default checkpoint

A tiny Nemotron-H-format hybrid (Mamba-2 + attention + relu2 MLP) trained from scratch on the shipped
King James Bible corpus (`data/corpus`, public domain) with the shipped 2048-token BPE (`data/tokenizer`).
It is the default MODEL of `remodel demo` and the subject of the pruning, distillation and upcycling tests.
Loads with `transformers.AutoModelForCausalLM.from_pretrained("data/embedded")` (no trust_remote_code).

| | |
|---|---|
| pattern | `{c["pattern"]}` (M Mamba-2, * attention, - MLP): 4 Mamba, 1 attention, 3 MLP |
| hidden | {c["hidden_size"]}, vocab {c["vocab_size"]}, untied lm_head, RMSNorm eps {c["norm_eps"]} |
| Mamba-2 | {c["mamba_num_heads"]} heads x {c["mamba_head_dim"]}, {c["n_groups"]} groups, state {c["ssm_state_size"]}, conv {c["conv_kernel"]}, chunk {c["chunk_size"]} |
| attention | {c["num_attention_heads"]} query / {c["num_key_value_heads"]} KV heads x {c["head_dim"]}, no positional encoding |
| MLP | {c["intermediate_size"]}, relu2, not gated |
| parameters | {log["params"]:,} |
| weights | bfloat16, {size / 1e6:.2f} MB on disk in all |
| training | {log["tokens_trained"]:,} tokens ({log["steps"]} steps of {log["hyperparameters"]["batch"]}x{log["hyperparameters"]["seq_len"]}), {log["train_minutes"]} min on CPU ({log["hyperparameters"]["threads"]} threads), seed {log["seed"]} |
| optimiser | AdamW lr {log["hyperparameters"]["lr"]} (betas 0.9/0.95, wd {log["hyperparameters"]["weight_decay"]}), linear warm-up over the first {log["hyperparameters"]["warmup_fraction"]:.0%} of the run, then cosine to {log["hyperparameters"]["final_lr_ratio"]}x, grad clip 1.0 |
| final train loss | {log["final_train_loss"]} (mean of the last 20 steps) |
| held-out loss / perplexity | {log["valid_loss"]} / {log["valid_ppl"]} on all {log["valid_tokens"]:,} valid tokens (seq 256, shipped bf16 weights evaluated in fp32) |
| via transformers | {log["valid_loss_transformers"]} |
| test slice | first {log["slice"]["tokens"]:,} valid tokens: perplexity {log["slice"]["ppl"]} (checked by tests/test_embedded.py) |

Reproduce (about 6 minutes of training plus 3 of evaluation on an idle 2-core machine; on a busy one
training stops at `--max-minutes`, default 20, after annealing on the clock):

    {log["command"]}

The peak learning rate was picked from one-epoch runs at 3e-3 / 6e-3 / 1e-2 (held-out loss
4.25 / 4.16 / 4.10). Widths suit structured-pruning experiments: 4 Mamba heads per group (25% / 50%
head pruning stays integral and group-balanced), FFN 768 and hidden 256 divisible by 4, GQA 4/2.

`train_log.json` holds the full config, hyperparameters, figures and the per-step loss curve.
The schedule follows max(token progress, clock progress), so the run is reproducible only when the
token count alone set every step's learning rate (`clock_governed_steps: 0` in the log; this run: {log["clock_governed_steps"]}).
"""


if __name__ == "__main__":
    main()
