"""Training engine for `remodel train` (LM loss) and `remodel distill` (logit KD from a frozen teacher).

train(): student (and teacher) from HF checkpoint dirs, packed data, AdamW with linear warm-up and
cosine decay to min_lr, grad clipping and accumulation, bf16 autocast on CUDA only. Resumable:
every `checkpoint_every` steps the whole training state goes to `<out>.run/step-NNNNNN/` (written
atomically; safetensors for tensors, JSON for the rest, no pickle), the last `keep_last` are kept,
and `resume=True` continues from the newest complete one at the exact data position. The end
result is a HF checkpoint in OUT with remodel_report.json, metrics.csv and loss.png.
evaluate(): next-token loss / perplexity / tokens/s of a model on data (`remodel eval`).

Loss = kl_weight * KL(teacher||student) + lm_loss_weight * CE + hidden_loss_weight * (1 - cos)
       + lb_coeff * load balancing (student MoE layers) + z_coeff * router z-loss.
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from models.checkpoint import atomic_output_dir, read_header
from models.errors import RemodelError
from models.load import load_config, load_model, read_config_dict, save_model

from .losses import hidden_cosine_loss, kl_div, lm_loss, load_balancing_loss, topk_kl, z_loss

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_TENSORS, STATE_JSON = "state.safetensors", "state.json"
# arguments that must match for a resumed run to continue the same trajectory
RESUME_KEYS = ("student_dir", "teacher_dir", "data", "steps", "seq_len", "batch", "grad_accum", "lr", "min_lr",
               "warmup", "weight_decay", "grad_clip", "temperature", "kl_weight", "lm_loss_weight",
               "hidden_loss_weight", "layer_map", "topk", "lb_coeff", "z_coeff", "seed")


# ---- small helpers -----------------------------------------------------------------------------

def pick_device(device="auto") -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer
    d = Path(model_dir)
    if not any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise RemodelError(f"{d}: no tokenizer files (tokenizer.json / tokenizer_config.json) in the model directory")
    try:
        return AutoTokenizer.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is a bad input
        raise RemodelError(f"{d}: cannot load the tokenizer ({type(e).__name__}: {e})".splitlines()[0]) from None


def run_dir_for(out) -> Path:
    """Where the resumable checkpoints of a run writing OUT live: `<out>.run/`."""
    out = Path(out).absolute()
    return out.parent / (out.name + ".run")


def lr_at(step: int, steps: int, lr: float, min_lr: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps (step 0 gets lr/warmup), then cosine from lr to min_lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def default_layer_map(n_student: int, n_teacher: int) -> list[tuple[int, int]]:
    """Pairs (student state, teacher state) over the residual-stream states (0 = embeddings, i = after
    layer i): every student layer i to teacher layer round(i * Lt / Ls), so the last maps to the last."""
    return [(i, round(i * n_teacher / n_student)) for i in range(1, n_student + 1)]


def build_projections(student, teacher, layer_map) -> nn.ModuleList | None:
    """A Linear(student width -> teacher width) per mapped pair when the widths differ, else None."""
    hs, ht = student.cfg.hidden_size, teacher.cfg.hidden_size
    if hs == ht:
        return None
    return nn.ModuleList(nn.Linear(hs, ht, bias=False) for _ in layer_map)


def build_optimizer(params: dict[str, nn.Parameter], lr: float, weight_decay: float, betas=(0.9, 0.95)):
    """AdamW; weight decay on matrices (ndim >= 2) only, not on norms, biases, A_log, D, dt_bias."""
    decay = [p for p in params.values() if p.ndim >= 2]
    other = [p for p in params.values() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8)


def matmul_params(model) -> int:
    """Parameters used in matmuls per token: active experts only, the untied embedding table excluded."""
    cfg, n = model.cfg, 0
    for name, p in model.named_parameters():
        if name == "embeddings.weight" and not cfg.tie_word_embeddings:
            continue
        if ".experts." in name:
            n += p.numel() * cfg.num_experts_per_tok // cfg.n_routed_experts
        else:
            n += p.numel()
    return n


def forward_flops_per_token(model, seq_len: int) -> float:
    """2 * matmul params + attention scores/values (4 * seq * heads * head_dim per attention layer,
    no causal discount); the Mamba scan and elementwise work are not counted."""
    cfg = model.cfg
    attn = cfg.count("*") * 4 * seq_len * cfg.num_attention_heads * cfg.head_dim
    return 2.0 * matmul_params(model) + attn


_PEAK: dict = {}


def measure_matmul_flops(device: torch.device, dtype=torch.float32, n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of one n x n matmul on `device` (the reference for the MFU estimate; measured once per
    process, device and dtype)."""
    key = (str(device), dtype, n)
    if key in _PEAK:
        return _PEAK[key]
    g = torch.Generator().manual_seed(0)  # leaves the global RNG alone
    a = torch.randn(n, n, generator=g).to(device, dtype)
    b = torch.randn(n, n, generator=g).to(device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    inner = 50 if device.type == "cuda" else 1
    a @ b
    sync()
    best = float("inf")
    for _ in range(reps):  # best of reps: the machine may be shared
        t = time.perf_counter()
        for _ in range(inner):
            a @ b
        sync()
        best = min(best, time.perf_counter() - t)
    _PEAK[key] = 2.0 * n**3 * inner / best
    return _PEAK[key]


# ---- the loss of one micro-batch --------------------------------------------------------------

LOSS_FNS = {"kl_div": kl_div, "topk_kl": topk_kl, "lm_loss": lm_loss, "load_balancing_loss": load_balancing_loss}


def compute_losses(student, teacher, ids, w: dict, layer_map=None, projections=None, autocast=None, fns=None):
    """-> (total loss tensor, {name: float}) for one batch of token ids [B, L].
    w: weights {kl, lm, hidden, lb, z, temperature, topk}. The teacher runs under no_grad.
    fns: replacements for the loss functions {kl_div, topk_kl, lm_loss, load_balancing_loss} (same
    signatures; pipelines.train_parallel passes vocab-parallel ones)."""
    fns = {**LOSS_FNS, **(fns or {})}
    autocast = autocast or torch.autocast("cpu", enabled=False)
    need_states = teacher is not None and w["hidden"] > 0
    with autocast:
        out = student(ids, output_hidden_states=need_states)
        s_logits, s_states = out if need_states else (out, None)
        if teacher is not None:
            with torch.no_grad():
                t_out = teacher(ids, output_hidden_states=need_states)
            t_logits, t_states = t_out if need_states else (t_out, None)
    total = s_logits.new_zeros((), dtype=torch.float32)
    parts = {}
    if teacher is not None:
        kl = (fns["topk_kl"](s_logits, t_logits, w["topk"], w["temperature"]) if w["topk"]
              else fns["kl_div"](s_logits, t_logits, w["temperature"]))
        total = total + w["kl"] * kl
        parts["kl"] = kl.item()
    lm = fns["lm_loss"](s_logits[:, :-1] if w["lm"] > 0 else s_logits[:, :-1].detach(), ids[:, 1:])
    if w["lm"] > 0:
        total = total + w["lm"] * lm
    parts["lm"] = lm.item()
    if need_states:
        with autocast:
            hid = hidden_cosine_loss(s_states, t_states, layer_map, projections)
        total = total + w["hidden"] * hid
        parts["hidden"] = hid.item()
    moe = student.moe_layers()
    if moe and (w["lb"] > 0 or w["z"] > 0):
        cfg = student.cfg
        logits = [m.router_logits for m in moe]
        if w["lb"] > 0:
            lb = fns["load_balancing_loss"](logits, cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.router)
            total = total + w["lb"] * lb
            parts["lb"] = lb.item()
        if w["z"] > 0:
            z = z_loss(logits)
            total = total + w["z"] * z
            parts["z"] = z.item()
    parts["loss"] = total.item()
    return total, parts


# ---- checkpoints ------------------------------------------------------------------------------

def _fsync(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_state(tmp: Path, tensors: dict, meta: dict):
    """The files of one checkpoint: tensors first, the JSON (which marks it readable) last."""
    save_file(tensors, tmp / STATE_TENSORS)
    (tmp / STATE_JSON).write_text(json.dumps(meta) + "\n")
    for f in (STATE_TENSORS, STATE_JSON):
        _fsync(tmp / f)


def optimizer_state(opt: torch.optim.Optimizer, sd: dict | None = None) -> tuple[dict, dict]:
    """Optimizer state_dict (`opt`'s, or `sd`) split into ({'optim.<param>.<key>': tensor}, JSON-able rest)."""
    sd = opt.state_dict() if sd is None else sd
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"optim.{pid}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{k}"] = v
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def load_optimizer_state(opt: torch.optim.Optimizer, tensors: dict, meta: dict):
    state: dict = {}
    for name, t in tensors.items():
        if name.startswith("optim."):
            _, pid, k = name.split(".", 2)
            state.setdefault(int(pid), {})[k] = t
    for key, v in meta["scalars"].items():
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
              for g in meta["param_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})


def rng_state(device: torch.device) -> dict:
    out = {"rng.torch": torch.get_rng_state()}
    if device.type == "cuda":
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = s
    return out


def set_rng_state(tensors: dict, device: torch.device):
    torch.set_rng_state(tensors["rng.torch"])
    cuda = sorted((k for k in tensors if k.startswith("rng.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1]))
    if device.type == "cuda" and cuda:
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])


def save_checkpoint(run_dir: Path, step: int, tensors: dict, meta: dict, keep_last: int) -> Path:
    """Write `run_dir/step-NNNNNN/` atomically, then delete all but the newest `keep_last`."""
    final = run_dir / f"step-{step:06d}"
    with atomic_output_dir(final, overwrite=True) as tmp:
        _write_state(tmp, tensors, meta)
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        gone = old.parent / f".{old.name}.del-{os.getpid()}"
        old.rename(gone)  # a kill during rmtree leaves a hidden dir, never a half checkpoint
        shutil.rmtree(gone, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """step-* dirs, oldest first (complete by construction: they appear by rename)."""
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def _readable(ckpt: Path) -> bool:
    try:
        json.loads((ckpt / STATE_JSON).read_text())
        read_header(ckpt / STATE_TENSORS)
        return True
    except (OSError, ValueError, RemodelError):
        return False


def latest_checkpoint(run_dir: Path) -> Path | None:
    for ckpt in reversed(list_checkpoints(run_dir)):
        if _readable(ckpt):
            return ckpt
        tqdm.write(f"skipping unreadable checkpoint {ckpt}")
    return None


def load_checkpoint(ckpt: Path) -> tuple[dict, dict]:
    return load_file(ckpt / STATE_TENSORS), json.loads((ckpt / STATE_JSON).read_text())


def clean_stale(run_dir: Path):
    """Remove temporaries left by a killed writer (hidden .step-* dirs)."""
    if run_dir.is_dir():
        for p in run_dir.iterdir():
            if p.name.startswith(".step-"):
                shutil.rmtree(p, ignore_errors=True)


# ---- reports ----------------------------------------------------------------------------------

METRIC_COLUMNS = ("step", "loss", "kl", "lm", "hidden", "lb", "z", "lr", "grad_norm", "tokens_per_s")


def write_metrics(history: list[dict], path: Path):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(METRIC_COLUMNS)
        for row in history:
            w.writerow(["" if row.get(c) is None else row.get(c) for c in METRIC_COLUMNS])


def plot_losses(history: list[dict], path: Path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in history]
    ax.plot(steps, [r["loss"] for r in history], label="loss")
    for key in ("kl", "lm", "hidden"):
        ys = [r.get(key) for r in history]
        if any(y is not None for y in ys) and ys != [r["loss"] for r in history]:
            ax.plot(steps, [math.nan if y is None else y for y in ys], "--", label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- argument checks (before any heavy work, nothing written) ----------------------------------

def _check_out(out: Path, overwrite: bool, inputs):
    real = out.resolve()
    for inp in inputs:
        inp = Path(inp).resolve()
        if real == inp or inp in real.parents or real in inp.parents:
            raise RemodelError(f"{out}: output overlaps input directory {inp}; write the output elsewhere")
    if out.exists() and not out.is_dir():
        raise RemodelError(f"{out}: output exists and is not a directory")
    if out.is_dir() and not overwrite and any(out.iterdir()):
        raise RemodelError(f"{out}: output directory exists and is not empty (pass overwrite to replace it)")


def _budget(steps, tokens, tokens_per_step: int) -> int:
    if (steps is None) == (tokens is None):
        raise RemodelError("give exactly one of steps or tokens as the training budget")
    if steps is not None:
        if steps < 1:
            raise RemodelError(f"steps must be >= 1, got {steps}")
        return int(steps)
    if tokens < 1:
        raise RemodelError(f"tokens must be >= 1, got {tokens}")
    return max(1, math.ceil(tokens / tokens_per_step))


def _check_positive(**kw):
    for k, v in kw.items():
        if v is not None and not v > 0:
            raise RemodelError(f"{k} must be > 0, got {v}")


# ---- evaluation -------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model_or_dir, data, seq_len: int = 256, batch: int = 8, max_tokens: int | None = None,
             tokenizer=None, device="auto", bf16="auto") -> dict:
    """Next-token loss (nats/token), perplexity and forward tokens/s over packed blocks of `data`
    (a DATA path, a datasets.Dataset with 'text', or a LongTensor [N, L] of ids).
    A model directory supplies its own tokenizer; a model object needs `tokenizer` for text data."""
    from .data import load_texts, pack

    if isinstance(model_or_dir, (str, Path)):
        dev = pick_device(device)
        load_config(model_or_dir)  # one-line error for a bad dir before anything heavy
        if tokenizer is None and not torch.is_tensor(data):
            tokenizer = load_tokenizer(model_or_dir)
        model = load_model(model_or_dir, device=dev)
    else:
        model = model_or_dir
        dev = next(model.parameters()).device
    _check_positive(seq_len=seq_len, batch=batch, max_tokens=max_tokens)
    if torch.is_tensor(data):
        blocks = data if max_tokens is None else data[: max(1, max_tokens // data.shape[1])]
    else:
        if tokenizer is None:
            raise RemodelError("evaluate: text data needs a tokenizer")
        ds = load_texts(data) if isinstance(data, (str, Path)) else data
        blocks = pack(ds, tokenizer, seq_len, max_tokens=max_tokens)
    if int(blocks.max()) >= model.cfg.vocab_size:
        raise RemodelError(f"token id {int(blocks.max())} is outside the model's vocabulary ({model.cfg.vocab_size})")
    use_bf16 = dev.type == "cuda" and (bf16 is True or bf16 == "auto")
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
            total += lm_loss(logits[:, :-1], ids[:, 1:]).item() * n
            count += n
        sync()
    finally:
        model.train(was_training)
    dt = time.perf_counter() - t0
    loss = total / count
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": int(blocks.numel()),
            "tokens_per_s": blocks.numel() / dt}


# ---- training ---------------------------------------------------------------------------------

TRAIN_ARGS = ("student_dir", "out", "data", "teacher_dir", "steps", "tokens", "seq_len", "batch", "lr", "min_lr",
              "warmup", "weight_decay", "grad_clip", "grad_accum", "temperature", "kl_weight", "lm_loss_weight",
              "hidden_loss_weight", "layer_map", "topk", "lb_coeff", "z_coeff", "checkpoint_every", "keep_last",
              "resume", "seed", "eval_data", "eval_tokens", "overwrite", "device", "bf16")
PREPARED = ("t_start", "out", "student_dir", "teacher_dir", "distill", "lm_loss_weight", "kl_weight", "tokens_per_step",
            "steps", "min_lr", "warmup", "checkpoint_every", "layer_map", "s_cfg", "family", "inputs", "run_dir",
            "tokenizer", "dev", "use_bf16", "args")


def _prepare(kw: dict) -> dict:
    """train()'s argument checks (before any heavy work, nothing written) and derived settings, from
    train()'s arguments `kw`: the names in PREPARED (`args` is what checkpoints and the report record)."""
    (student_dir, out, data, teacher_dir, steps, tokens, seq_len, batch, lr, min_lr, warmup, weight_decay,
     grad_clip, grad_accum, temperature, kl_weight, lm_loss_weight, hidden_loss_weight, layer_map, topk,
     lb_coeff, z_coeff, checkpoint_every, keep_last, resume, seed, eval_data, eval_tokens, overwrite, device,
     bf16) = (kw[k] for k in TRAIN_ARGS)
    t_start = time.time()
    out = Path(out).absolute()
    student_dir = Path(student_dir).absolute()
    teacher_dir = Path(teacher_dir).absolute() if teacher_dir is not None else None
    distill = teacher_dir is not None
    lm_loss_weight = (0.0 if distill else 1.0) if lm_loss_weight is None else float(lm_loss_weight)
    kl_weight = float(kl_weight) if distill else 0.0
    tokens_per_step = batch * grad_accum * seq_len

    # -- checks before heavy work --------------------------------------------------------------
    _check_positive(seq_len=seq_len, batch=batch, grad_accum=grad_accum, lr=lr, temperature=temperature,
                    checkpoint_every=checkpoint_every, eval_tokens=eval_tokens)
    if seq_len < 2:
        raise RemodelError(f"seq_len must be >= 2 for next-token training, got {seq_len}")
    steps = _budget(steps, tokens, tokens_per_step)
    min_lr = lr / 10 if min_lr is None else float(min_lr)
    warmup = min(100, steps // 10) if warmup is None else int(warmup)
    checkpoint_every = checkpoint_every or max(1, steps // 10)
    if min_lr < 0 or min_lr > lr or warmup < 0 or weight_decay < 0 or keep_last < 0:
        raise RemodelError(f"need 0 <= min_lr <= lr, warmup >= 0, weight_decay >= 0, keep_last >= 0 "
                           f"(got min_lr={min_lr}, lr={lr}, warmup={warmup}, weight_decay={weight_decay}, "
                           f"keep_last={keep_last})")
    if topk is not None and topk < 1:
        raise RemodelError(f"topk must be >= 1, got {topk}")
    if not distill and (hidden_loss_weight or topk):
        raise RemodelError("hidden_loss_weight and topk need a teacher (distillation)")
    if kl_weight == 0 and lm_loss_weight == 0 and not hidden_loss_weight:
        raise RemodelError("every loss weight is zero: nothing to train")
    s_cfg = load_config(student_dir)
    family = read_config_dict(student_dir)["model_type"]
    if distill:
        t_cfg = load_config(teacher_dir)
        if t_cfg.vocab_size != s_cfg.vocab_size:
            raise RemodelError(f"teacher vocab_size {t_cfg.vocab_size} != student vocab_size {s_cfg.vocab_size}: "
                               "logit distillation needs the same tokenizer")
        st, tt = student_dir / "tokenizer.json", teacher_dir / "tokenizer.json"
        if st.is_file() and tt.is_file() and st.read_bytes() != tt.read_bytes():
            raise RemodelError(f"{teacher_dir} and {student_dir} have different tokenizers")
        if hidden_loss_weight:
            layer_map = [tuple(p) for p in (layer_map or default_layer_map(s_cfg.num_layers, t_cfg.num_layers))]
            bad = [p for p in layer_map if not (0 <= p[0] <= s_cfg.num_layers and 0 <= p[1] <= t_cfg.num_layers)]
            if bad:
                raise RemodelError(f"layer_map pairs {bad} are outside the student ({s_cfg.num_layers}) or "
                                   f"teacher ({t_cfg.num_layers}) layers")
    inputs = [student_dir] + ([teacher_dir] if distill else [])
    _check_out(out, overwrite, inputs)
    run_dir = run_dir_for(out)
    if list_checkpoints(run_dir) and not resume and not overwrite:
        raise RemodelError(f"{run_dir} holds checkpoints of an earlier run: pass resume to continue it "
                           "or overwrite to start over")
    tokenizer = load_tokenizer(student_dir)
    dev = pick_device(device)
    use_bf16 = dev.type == "cuda" and (bf16 is True or (bf16 == "auto" and torch.cuda.is_bf16_supported()))
    args = {"student_dir": str(student_dir), "teacher_dir": str(teacher_dir) if distill else None,
            "data": str(Path(data).absolute()) if isinstance(data, (str, Path)) else repr(data),
            "out": str(out), "steps": steps, "seq_len": seq_len, "batch": batch, "grad_accum": grad_accum,
            "lr": lr, "min_lr": min_lr, "warmup": warmup, "weight_decay": weight_decay, "grad_clip": grad_clip,
            "temperature": temperature, "kl_weight": kl_weight, "lm_loss_weight": lm_loss_weight,
            "hidden_loss_weight": hidden_loss_weight, "layer_map": [list(p) for p in layer_map or []] or None,
            "topk": topk, "lb_coeff": lb_coeff if "E" in s_cfg.pattern else 0.0, "z_coeff": z_coeff,
            "checkpoint_every": checkpoint_every, "keep_last": keep_last, "seed": seed,
            "eval_data": str(eval_data) if eval_data is not None else None, "eval_tokens": eval_tokens,
            "device": str(dev), "bf16": use_bf16}
    return {k: v for k, v in locals().items() if k in PREPARED}


def _resume_state(resume: bool, run_dir: Path, args: dict):
    """-> (checkpoint dir, its tensors, its meta) to continue from, or Nones; refuses a checkpoint of
    another trajectory (RESUME_KEYS)."""
    ckpt, ck_tensors, ck_meta = None, None, None
    if resume:
        clean_stale(run_dir)
        ckpt = latest_checkpoint(run_dir)
        if ckpt is not None:
            ck_tensors, ck_meta = load_checkpoint(ckpt)
            diff = [k for k in RESUME_KEYS if ck_meta["args"].get(k) != json.loads(json.dumps(args[k]))]
            if diff:
                was = ", ".join(f"{k}={ck_meta['args'].get(k)!r}" for k in diff)
                raise RemodelError(f"cannot resume from {ckpt}: {', '.join(diff)} differ from that run ({was})")
    return ckpt, ck_tensors, ck_meta


def _pack_data(data, eval_data, tokenizer, seq_len: int, max_tokens: int, eval_tokens: int, vocab_size: int):
    """-> (training blocks [N, seq_len] of at most max_tokens, held-out blocks or None)."""
    from .data import load_texts, pack
    blocks = pack(load_texts(data), tokenizer, seq_len, max_tokens=max_tokens)
    if int(blocks.max()) >= vocab_size:
        raise RemodelError(f"token id {int(blocks.max())} from the tokenizer is outside the model's vocabulary "
                           f"({vocab_size})")
    eval_blocks = pack(load_texts(eval_data), tokenizer, seq_len, max_tokens=eval_tokens) if eval_data else None
    return blocks, eval_blocks


def train(student_dir, out, data, teacher_dir=None, steps=None, tokens=None, seq_len=256, batch=8,
          lr=1e-4, min_lr=None, warmup=None, weight_decay=0.1, grad_clip=1.0, grad_accum=1,
          temperature=1.0, kl_weight=1.0, lm_loss_weight=None, hidden_loss_weight=0.0, layer_map=None,
          topk=None, lb_coeff=1e-2, z_coeff=0.0, checkpoint_every=None, keep_last=2, resume=False, seed=0,
          eval_data=None, eval_tokens=65536, overwrite=False, log_every=50, device="auto", bf16="auto",
          save_dtype=None, tp=1, ep=1) -> dict:
    """Train `student_dir` (distil from `teacher_dir` when given) on `data`; write the result to `out`.

    Budget: `steps`, or `tokens` (steps = ceil(tokens / (batch * grad_accum * seq_len))); the data is
    packed up to that many tokens and repeated (reshuffled per epoch) when it holds fewer.
    Defaults: min_lr = lr / 10; warmup = min(100, steps // 10); lm_loss_weight 0 with a teacher, 1
    without; checkpoint_every = max(1, steps // 10) (a checkpoint is also written after the last
    step); keep_last=0 keeps every checkpoint. hidden_loss_weight > 0 adds 1 - cos between the
    residual states of `layer_map` pairs (default `default_layer_map`), through trainer-owned
    Linear projections when the widths differ. bf16: autocast on CUDA only ('auto' = when supported);
    weights, optimizer state and losses stay fp32. resume=True with no checkpoint starts fresh.
    tp / ep > 1 (or several processes, WORLD_SIZE > 1): pipelines.train_parallel, run under torchrun.
    Returns the report dict (also in OUT/remodel_report.json)."""
    if (tp or 1) * (ep or 1) > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:  # several processes
        kw = dict(locals())
        from .train_parallel import train_parallel
        return train_parallel(**kw)

    s = _prepare(locals())
    (t_start, out, student_dir, teacher_dir, distill, lm_loss_weight, kl_weight, tokens_per_step, steps,
     min_lr, warmup, checkpoint_every, layer_map, s_cfg, family, inputs, run_dir, tokenizer, dev, use_bf16,
     args) = (s[k] for k in PREPARED)

    # -- resume state, data -------------------------------------------------------------------
    ckpt, ck_tensors, ck_meta = _resume_state(resume, run_dir, args)
    blocks, eval_blocks = _pack_data(data, eval_data, tokenizer, seq_len, steps * tokens_per_step, eval_tokens,
                                     s_cfg.vocab_size)

    # -- models, optimizer ---------------------------------------------------------------------
    torch.manual_seed(seed)
    student = load_model(student_dir, device=dev).train()
    teacher = None
    if distill:
        teacher = load_model(teacher_dir, device=dev).eval()
        teacher.requires_grad_(False)
    projections = build_projections(student, teacher, layer_map) if hidden_loss_weight else None
    if projections is not None:
        projections.to(dev)
    params = dict(student.named_parameters())
    if projections is not None:
        params.update({f"proj.{k}": p for k, p in projections.named_parameters()})
    opt = build_optimizer(params, lr, weight_decay)

    start, history, resumed_from, evals = 0, [], None, {}
    if ck_meta is not None:
        student.load_state_dict({k[6:]: v.to(dev) for k, v in ck_tensors.items() if k.startswith("model.")},
                                strict=True)
        if projections is not None:
            projections.load_state_dict({k[5:]: v.to(dev) for k, v in ck_tensors.items() if k.startswith("proj.")})
        load_optimizer_state(opt, ck_tensors, ck_meta["optimizer"])
        set_rng_state(ck_tensors, dev)
        start, history, evals = ck_meta["step"], ck_meta["history"], ck_meta.get("eval", {})
        resumed_from = str(ckpt)
        tqdm.write(f"resuming from {ckpt} (step {start} of {steps})")
        del ck_tensors

    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16)
    w = {"kl": kl_weight, "lm": lm_loss_weight, "hidden": hidden_loss_weight, "lb": args["lb_coeff"],
         "z": z_coeff, "temperature": temperature, "topk": topk}
    peak = measure_matmul_flops(dev, torch.bfloat16 if use_bf16 else torch.float32)
    flops_tok = 3 * forward_flops_per_token(student, seq_len)
    if distill:
        flops_tok += forward_flops_per_token(teacher, seq_len)
    if eval_blocks is not None and "before" not in evals:
        evals["before"] = evaluate(student, eval_blocks, batch=batch, bf16=use_bf16)
        student.train()

    def snapshot(step):
        tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in student.state_dict().items()}
        if projections is not None:
            tensors.update({f"proj.{k}": v.detach().cpu().contiguous() for k, v in projections.state_dict().items()})
        opt_t, opt_meta = optimizer_state(opt)
        tensors.update(opt_t)
        tensors.update(rng_state(dev))
        meta = {"step": step, "consumed_batches": step * grad_accum, "args": args, "optimizer": opt_meta,
                "history": history, "eval": evals}
        return tensors, meta

    # -- loop ----------------------------------------------------------------------------------
    if not resume and run_dir.exists():
        shutil.rmtree(run_dir)  # overwrite: start over (only now that every input has loaded)
    from .data import batches
    it = batches(blocks, batch, shuffle_seed=seed, start=start * grad_accum, epochs=None, drop_last=True)
    train_params = list(params.values())
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    step_time, step_tokens = 0.0, 0
    bar = tqdm(total=steps, initial=start, desc="distill" if distill else "train", unit="step", dynamic_ncols=True)
    for step in range(start, steps):
        t0 = time.perf_counter()
        cur_lr = lr_at(step, steps, lr, min_lr, warmup)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        sums: dict[str, float] = {}
        for _ in range(grad_accum):
            ids = next(it).to(dev, non_blocking=True)
            loss, parts = compute_losses(student, teacher, ids, w, layer_map, projections, autocast)
            (loss / grad_accum).backward()
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v / grad_accum
        gnorm = torch.nn.utils.clip_grad_norm_(train_params, grad_clip if grad_clip else float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t0
        step_time += dt
        step_tokens += tokens_per_step
        if not math.isfinite(sums["loss"]):
            bar.close()
            last = list_checkpoints(run_dir)
            raise RemodelError(f"loss became {sums['loss']} at step {step + 1}"
                               + (f"; last checkpoint {last[-1]}" if last else ""))
        row = {"step": step + 1, **sums, "lr": cur_lr, "grad_norm": float(gnorm), "tokens_per_s": tokens_per_step / dt}
        history.append(row)
        bar.update(1)
        bar.set_postfix(loss=f"{sums['loss']:.4f}", lr=f"{cur_lr:.2e}")
        if log_every and (step + 1) % log_every == 0:
            tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        if (step + 1) % checkpoint_every == 0 or step + 1 == steps:
            save_checkpoint(run_dir, step + 1, *snapshot(step + 1), keep_last=keep_last)
    bar.close()

    # -- final model and report ----------------------------------------------------------------
    if eval_blocks is not None:
        evals["after"] = evaluate(student, eval_blocks, batch=batch, bf16=use_bf16)
    tok_s = step_tokens / step_time if step_time else None
    n_params = {"student": sum(p.numel() for p in student.parameters()),
                "teacher": sum(p.numel() for p in teacher.parameters()) if distill else None,
                "trainable_extra": sum(p.numel() for p in projections.parameters()) if projections else 0}
    report = _report(args, family, n_params, steps, tokens_per_step, blocks, resumed_from, run_dir, history, evals,
                     tok_s, flops_tok, peak, t_start)
    _write_outputs(out, overwrite, inputs, student, student_dir, family, save_dtype, report)
    return report


def _report(args, family, n_params, steps, tokens_per_step, blocks, resumed_from, run_dir, history, evals,
            tok_s, flops_tok, peak, t_start) -> dict:
    """remodel_report.json of a training run. peak: matmul FLOP/s of all the devices used together."""
    return {
        "command": "distill" if args["teacher_dir"] else "train", "args": args, "family": family,
        "params": n_params,
        "steps": steps, "tokens_per_step": tokens_per_step, "tokens": steps * tokens_per_step,
        "data_tokens": int(blocks.numel()), "epochs": steps * tokens_per_step / blocks.numel(),
        "resumed_from": resumed_from, "run_dir": str(run_dir),
        "final_loss": history[-1]["loss"] if history else None,
        "eval": {k: v for k, v in evals.items()},
        "eval_ppl": evals["after"]["ppl"] if "after" in evals else None,
        "tokens_per_s": tok_s, "flops_per_token": flops_tok, "matmul_flops_per_s": peak,
        "mfu": flops_tok * tok_s / peak if tok_s else None,
        "mfu_note": "model FLOPs (6N student + 2N teacher + attention) over one measured 1024^3 matmul",
        "time_s": time.time() - t_start, "history": history,
    }


def _write_outputs(out: Path, overwrite: bool, inputs, student, student_dir: Path, family: str, save_dtype, report):
    """OUT: the HF checkpoint of `student` (a plain HybridLM), remodel_report.json, metrics.csv, loss.png."""
    history = report["history"]
    dtype = save_dtype or _source_dtype(student_dir)
    with atomic_output_dir(out, overwrite=overwrite, inputs=inputs) as tmp:
        save_model(student, tmp, family=family, aux_from=student_dir, overwrite=True, dtype=dtype)
        (tmp / "remodel_report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        write_metrics(history, tmp / "metrics.csv")
        plot_losses(history, tmp / "loss.png", f"{report['command']}: {student_dir.name}")


def _source_dtype(model_dir: Path):
    """The dtype the student checkpoint was stored in (so the output matches it), fp32 if unknown."""
    d = read_config_dict(model_dir)
    name = d.get("dtype") or d.get("torch_dtype")
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    return dt if isinstance(dt, torch.dtype) and dt.is_floating_point else None
