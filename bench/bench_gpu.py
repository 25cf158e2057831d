"""GPU checks and throughput (run on a CUDA machine; `--smoke` runs every part on CPU at tiny shapes).

1. Parity in fp32 on CUDA (TF32 off): our model (pure-PyTorch path) against transformers'
   NemotronHForCausalLM with the same weights, logits and gradients of a loss; and our model with the
   GPU extras' kernels (models.mamba.gpu_kernels: mamba-ssm's fused scan and Triton gated norm,
   causal-conv1d's conv; whichever import) against our pure-PyTorch path.
2. bf16 train step (the trainer's own code: compute_losses + backward + clip + AdamW, autocast bf16,
   fp32 master weights) of a ~1.3B Nemotron-H-style hybrid: tokens/s and MFU = train FLOPs (3x the
   trainer's forward count: 2 x matmul params + attention) x tokens/s over (a) the bf16 matmul rate
   measured in this process (8192^3) and (b) the H100 SXM dense bf16 spec, 989 TFLOP/s.
   Variants: ours with the GPU kernels ("+ mamba-ssm scan"), ours pure-PyTorch, transformers' own
   model at a length it fits in memory. Then the distillation step (teacher = the same 1.3B, frozen,
   bf16 forward) over the plain step, same process.
   `--parts mfu`: only our plain bf16 step of the 1.3B hybrid (tokens/s, MFU).
3. Windows (`--parts windows`): the 1.3B hybrid, an 8B-shaped window (models/configs/nemotron-h-8b.json's
   widths, its first --layers-8b layers) and a Nemotron 3 Nano-shaped MoE window
   (nemotron-3-nano-30b-a3b.json's widths, its first --layers-nano layers), each in bf16 and in FP8
   (pipelines.training.fp8.convert: torchao Float8Linear under the Nemotron-H recipe's exceptions): the plain step
   and the distill step (frozen teacher of the same shape, forward in the same precision, + fused KL,
   fused CE), and transformers' train step in the same process with its fastest available path (whatever
   mamba-ssm / causal-conv1d kernels import; FP8: the same torchao swap of its Linear layers but lm_head).
   MFU over the bf16 spec (989 TFLOP/s) also for FP8; distill FLOPs = 3 x student + 1 x teacher forward.
4. FP8 loss gap (`--parts gap`): --gap-steps (200) train steps of one window from the same init on the
   same learnable synthetic batches (a fixed random successor table, 10% random jumps), bf16 and FP8;
   relative gap of the final loss (mean of the last 10 steps).

    python bench/bench_gpu.py [--parts parity legacy windows gap] [--seq-len 4096] [--batch 2] [--reps 5]
                              [--json OUT.json]   (default on a GPU: bench/gpu_<device>_<parts>.json)
    python bench/bench_gpu.py --smoke --json /tmp/smoke.json   (CPU, tiny shapes, minutes)
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import remodel.models.mamba as mamba  # noqa: E402
from remodel.models.config import ModelConfig  # noqa: E402
from remodel.models.hf import config_from_hf  # noqa: E402
from remodel.models.load import load_model  # noqa: E402
from remodel.models.model import HybridLM, init_weights  # noqa: E402
from remodel.pipelines.distributed.parallel import clip_grad_norm_  # noqa: E402
from remodel.pipelines.training.metrics import forward_flops_per_token  # noqa: E402
from remodel.pipelines.training.objective import compute_losses  # noqa: E402
from remodel.pipelines.training.trainer import build_optimizer  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
H100_BF16_DENSE = 989e12
# a 26-layer window of the real 8B pattern; 8B Mamba sizes (head dim 64, 8 groups, state 128), hidden 2048
BIG = dict(vocab_size=131072, hidden_size=2048, pattern="M-M-M-M*-M-M-M-M*-M-M-M-M*-", num_attention_heads=16,
           num_key_value_heads=4, head_dim=128, intermediate_size=8192, mamba_num_heads=64, mamba_head_dim=64,
           n_groups=8, ssm_state_size=128, chunk_size=128, conv_kernel=4)
TINY_HF = dict(vocab_size=512, hidden_size=128, hybrid_override_pattern="M-M*-ME", num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, intermediate_size=256, mamba_num_heads=8, mamba_head_dim=32,
               n_groups=2, ssm_state_size=32, chunk_size=32, conv_kernel=4, n_routed_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=64, moe_shared_expert_intermediate_size=64,
               n_group=1, topk_group=1, layer_norm_epsilon=1e-5)
# --smoke: every width shrunk (the patterns kept), so each part runs on CPU in seconds
SMOKE_WIDTHS = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
                    chunk_size=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    moe_shared_expert_intermediate_size=32)
WINDOWS = ("hybrid_1.3b", "nemotron_h_8b_window", "nano_moe_window")
SMOKE = False
WARMUP = 2  # untimed calls before the timed ones (--smoke: none)


T0 = time.perf_counter()


def say(*parts):
    """A progress line with the seconds since start (device calls are cut at a limit: the log shows where)."""
    print(f"[{time.perf_counter() - T0:7.1f} s]", *parts, flush=True)


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def autocast():
    return torch.autocast(DEV.type, dtype=torch.bfloat16)


def reset_peak():
    if DEV.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gb():
    return torch.cuda.max_memory_allocated() / 2**30 if DEV.type == "cuda" else None


def failed(e) -> str:
    """A variant's exception as a report entry (its traceback printed)."""
    import traceback
    traceback.print_exc()
    return f"error: {type(e).__name__}: {str(e)[:300]}"


def free():
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


def timed(fn, reps, warmup=None):
    """Median wall seconds of fn() over reps calls after `warmup` (default WARMUP) untimed ones, GPU synchronised."""
    times, warmup = [], WARMUP if warmup is None else warmup
    for i in range(warmup + reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_rate(dtype, n=8192, reps=10):
    a = torch.randn(n, n, device=DEV, dtype=dtype)
    b = torch.randn(n, n, device=DEV, dtype=dtype)
    for _ in range(3):
        a @ b
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - t)


def hf_kw(kw):
    """Our BIG-style kwargs (pattern) -> transformers' nemotron_h config kwargs."""
    kw = dict(kw)
    kw["hybrid_override_pattern"] = kw.pop("pattern")
    kw.setdefault("layer_norm_epsilon", 1e-5)
    return kw


def hf_and_ours(kw):
    """transformers' NemotronHForCausalLM (fp32, seed 0) and ours loaded from its saved weights, on DEV."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(DEV):  # initialised on the device (the 1.3B comparison); saved and loaded through the host
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("nemotron_h", **kw)).float()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = load_model(tmp).to(DEV)
    return hf.to(DEV), ours


def grads(model):
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def kernels_present():
    """Which GPU extras' kernels import here (models.mamba.gpu_kernels)."""
    return {k: v is not None for k, v in mamba.gpu_kernels()._asdict().items()}


def parity():
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # restored at the end
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf, ours = hf_and_ours(TINY_HF)
    ids = torch.randint(0, TINY_HF["vocab_size"], (2, 200), device=DEV)  # 200: not a multiple of 32
    out = {}

    def run(fn, model):
        model.zero_grad(set_to_none=True)
        logits = fn(ids)
        F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)).backward()
        return logits.detach().float(), grads(model)

    mamba.USE_KERNEL = False
    l_ours, g_ours = run(ours, ours)
    l_hf, g_hf = run(lambda x: hf(x).logits, hf)
    out["logits_max_abs_ours_torch_vs_transformers"] = (l_ours - l_hf).abs().max().item()
    # gradient check on the parameters whose names map one to one (embeddings, lm_head, norms)
    emb = next(k for k in g_hf if k.endswith("embeddings.weight"))
    hf_g = {"embeddings.weight": g_hf[emb], "lm_head.weight": g_hf["lm_head.weight"]}
    out["grad_max_rel_ours_torch_vs_transformers"] = max(
        ((g_ours[k] - v).abs().max() / v.abs().max()).item() for k, v in hf_g.items())
    mamba.USE_KERNEL = True
    out["gpu_kernels"] = kernels_present()
    out["mamba_ssm_kernel"] = out["gpu_kernels"]["scan"]
    if DEV.type == "cuda" and any(out["gpu_kernels"].values()):
        l_k, g_k = run(ours, ours)
        out["logits_max_abs_ours_kernel_vs_torch"] = (l_k - l_ours).abs().max().item()
        out["grad_max_rel_ours_kernel_vs_torch"] = max(
            ((g_k[k] - v).abs().max() / v.abs().max().clamp(min=1e-30)).item() for k, v in g_ours.items())
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return out


def loss_weights(distill: bool, fused: bool = False):
    return dict(kl=1.0 if distill else 0.0, lm=0.0 if distill else 1.0, hidden=0.0, lb=0.0, z=0.0,
                temperature=1.0, topk=None, fused=fused)


def train_step(model, teacher, ids, opt, fused=False):
    """One trainer step: compute_losses (bf16 autocast) + backward + the trainer's clip + AdamW. -> the loss."""
    loss, _ = compute_losses(model, teacher, ids, loss_weights(teacher is not None, fused), autocast=autocast())
    loss.backward()
    clip_grad_norm_(model, 1.0)  # the trainer's (torch's had been timed here, not the trainer's slower one)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def step_time(model, teacher, ids, reps, opt, fused=False):
    return timed(lambda: train_step(model, teacher, ids, opt, fused), reps)


def throughput(big, seq_len, batch, reps, peak):
    res = {}
    say("1.3B train step: building the model")
    torch.manual_seed(0)
    with torch.device(DEV):  # built and initialised on the device: seconds for 1.3B, not a minute of host init
        model = init_weights(HybridLM(ModelConfig(**big)))
    n = sum(p.numel() for p in model.parameters())
    opt = build_optimizer(dict(model.named_parameters()), 1e-5, 0.1)
    ids = torch.randint(0, big["vocab_size"], (batch, seq_len), device=DEV)
    f_tok = 3 * forward_flops_per_token(model, seq_len)
    tok = batch * seq_len
    for name, kern in (("ours + mamba-ssm scan", True), ("ours, pure-PyTorch scan", False)):
        say("timing", name)
        mamba.USE_KERNEL = kern
        if kern and not any(mamba._kernels()):
            continue
        reset_peak()
        try:
            s = step_time(model, None, ids, reps, opt)
        except torch.OutOfMemoryError:
            res[name] = "out of memory"
            continue
        res[name] = dict(params=n, seq_len=seq_len, batch=batch, step_s=s, tok_s=tok / s,
                         mfu_measured=f_tok * tok / s / peak, mfu_spec=f_tok * tok / s / H100_BF16_DENSE,
                         peak_mem_gb=peak_gb())
        say(name, res[name])
    mamba.USE_KERNEL = True
    # distillation: the same model as a frozen teacher, student = a copy being trained
    torch.manual_seed(1)
    with torch.device(DEV):
        teacher = init_weights(HybridLM(ModelConfig(**big))).eval().requires_grad_(False)
    try:
        plain = step_time(model, None, ids, reps, opt)
        kd = step_time(model, teacher, ids, reps, opt)
        res["distill"] = dict(plain_s=plain, distill_s=kd, ratio=kd / plain, distill_tok_s=tok / kd)
    except torch.OutOfMemoryError:
        res["distill"] = "out of memory"
    say("distill", res["distill"])
    del teacher, opt, model
    free()
    return res


def vs_transformers(big, seq_len, batch, reps):
    """bf16 autocast forward + CE + backward (no optimizer) of ours and transformers, same weights."""
    say("vs transformers at", seq_len, ": building both models")
    kw = hf_kw(big)
    hf, ours = hf_and_ours(kw)
    ids = torch.randint(0, kw["vocab_size"], (batch, seq_len), device=DEV)
    res = {}

    def one(fn, model):
        model.zero_grad(set_to_none=True)
        with autocast():
            logits = fn(ids)
        F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)).backward()

    runs = [("transformers (torch path)", lambda x: hf(x).logits, hf, True),
            ("ours, pure-PyTorch scan", ours, ours, False), ("ours + mamba-ssm scan", ours, ours, True)]
    for name, fn, model, kern in runs:
        mamba.USE_KERNEL = kern
        if model is ours and kern and not any(mamba._kernels()):
            continue
        reset_peak()
        try:
            mode = train_mode_or_eval(hf, lambda: one(fn, hf)) if model is hf else None
            s = timed(lambda: one(fn, model), reps)
            res[name] = dict(step_s=s, tok_s=batch * seq_len / s, peak_mem_gb=peak_gb())
            if mode:
                res[name]["mode"] = mode
        except torch.OutOfMemoryError:
            res[name] = "out of memory"
        free()
        say(name, seq_len, res[name])
    mamba.USE_KERNEL = True
    return res


def profile(big, seq_len):
    """Top CUDA kernels of one bf16 forward + backward of ours (GPU kernels when present)."""
    from torch.profiler import ProfilerActivity, profile as prof

    model = init_weights(HybridLM(ModelConfig(**big)), seed=0).to(DEV)
    ids = torch.randint(0, big["vocab_size"], (1, seq_len), device=DEV)

    def one():
        with autocast():
            logits = model(ids)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids.reshape(-1)).backward()
        model.zero_grad(set_to_none=True)

    one()
    sync()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        one()
        sync()
    table = p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    print(table, flush=True)
    del model
    free()
    return table


# ---- windows: bf16 / FP8, plain / distill, against transformers -------------------------------------

def window_hf_kw(name, layers_8b, layers_nano):
    """transformers nemotron_h kwargs of a benchmark window: the 1.3B hybrid, or the first layers of the
    8B / Nano config's pattern with that config's widths (shrunk under --smoke)."""
    if name == "hybrid_1.3b":
        kw = hf_kw(BIG)
    else:
        file, layers = (("nemotron-h-8b.json", layers_8b) if name == "nemotron_h_8b_window"
                        else ("nemotron-3-nano-30b-a3b.json", layers_nano))
        kw = json.loads((ROOT / "models" / "configs" / file).read_text())
        kw = {k: v for k, v in kw.items() if k not in ("model_type", "architectures")}
        kw["hybrid_override_pattern"] = kw["hybrid_override_pattern"][:layers]
    if SMOKE:
        kw.update({k: v for k, v in SMOKE_WIDTHS.items() if k in kw or k in ("chunk_size",)})
    return kw


def fp8_filter_hf(module, fqn):
    """The torchao swap for transformers' model: every Linear but lm_head and the MoE router, widths % 16."""
    return (isinstance(module, torch.nn.Linear) and "lm_head" not in fqn and "gate" not in fqn.rsplit(".", 1)[-1]
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def ours_model(kw, seed, fp8, dtype=torch.float32):
    """Our model of a window, built and initialised on DEV (the device's RNG, seeded: fast for billions of
    parameters, the same weights for the same seed), FP8-swapped when asked, in `dtype`."""
    from remodel.pipelines.training.fp8 import convert

    torch.manual_seed(seed)
    with torch.device(DEV):
        model = init_weights(HybridLM(config_from_hf({"model_type": "nemotron_h", **kw})))
    if fp8:
        convert(model)
    return model.to(dtype)


def ours_rows(kw, ids, reps, fp8):
    """Plain and distill step of ours (fused CE / KL) in bf16 or FP8: seconds, tokens/s, MFU."""
    model = ours_model(kw, 0, fp8)
    opt = build_optimizer(dict(model.named_parameters()), 1e-5, 0.1)
    f_fwd = forward_flops_per_token(model, ids.shape[1])
    tok, rows = ids.numel(), {"params": sum(p.numel() for p in model.parameters())}
    for name in ("plain", "distill"):
        teacher = None
        if name == "distill":  # frozen, forward in bf16 (FP8 rows: in FP8 too)
            teacher = ours_model(kw, 1, fp8, torch.bfloat16).eval().requires_grad_(False)
        reset_peak()
        try:
            s = step_time(model, teacher, ids, reps, opt, fused=True)
            flops = (3 + (teacher is not None)) * f_fwd * tok
            rows[name] = dict(step_s=s, tok_s=tok / s, mfu_spec=flops / s / H100_BF16_DENSE, peak_mem_gb=peak_gb())
        except torch.OutOfMemoryError:
            rows[name] = "out of memory"
        except Exception as e:  # recorded, so that one failing variant does not cost the device call
            rows[name] = failed(e)
        del teacher
        free()
    if isinstance(rows["plain"], dict) and isinstance(rows["distill"], dict):
        rows["distill"]["over_plain"] = rows["distill"]["step_s"] / rows["plain"]["step_s"]
    del model, opt
    free()
    return rows


def train_mode_or_eval(hf, step) -> str:
    """Runs step() once in training mode (transformers' fused mamba_split_conv1d_scan_combined where
    mamba-ssm imports); if that fails (mamba-ssm without its compiled causal-conv1d), puts the model in eval
    mode, the same math through its unfused path. -> the mode used."""
    try:
        step()
        return "train"
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        hf.zero_grad(set_to_none=True)
        hf.eval()
        return f"eval (train-mode fused path failed: {type(e).__name__}: {str(e)[:120]})"


def transformers_row(kw, ids, reps, fp8, f_tok):
    """transformers' own train step (its loss, backward, clip, AdamW; bf16 autocast), same shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(DEV):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("nemotron_h", **kw)).float()
    if fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(hf, config=Float8LinearConfig(), module_filter_fn=fp8_filter_hf)
    hf = hf.to(DEV).train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, weight_decay=0.1, fused=DEV.type == "cuda")

    def step():
        with autocast():
            loss = hf(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    reset_peak()
    try:
        mode = train_mode_or_eval(hf, step)
        s = timed(step, reps)
        row = dict(step_s=s, tok_s=ids.numel() / s, mfu_spec=3 * f_tok * ids.numel() / s / H100_BF16_DENSE,
                   peak_mem_gb=peak_gb(), mode=mode)
    except torch.OutOfMemoryError:
        row = "out of memory"
    except Exception as e:
        row = failed(e)
    del hf, opt
    free()
    return row


def window(name, seq_len, batch, reps, layers_8b, layers_nano, res=None, save=lambda: None):
    """One window: {params, seq_len, batch, bf16: {plain, distill, transformers}, fp8: {...}}, filled into
    `res` and saved after each precision (a device call cut during FP8 keeps the bf16 rows)."""
    kw = window_hf_kw(name, layers_8b, layers_nano)
    ids = torch.randint(0, kw["vocab_size"], (batch, seq_len), device=DEV)
    with torch.device("meta"):
        f_tok = forward_flops_per_token(HybridLM(config_from_hf({"model_type": "nemotron_h", **kw})), seq_len)
    res = {} if res is None else res
    res.update(pattern=kw["hybrid_override_pattern"], seq_len=seq_len, batch=batch, fwd_flops_per_token=f_tok)
    for prec in ("bf16", "fp8"):
        say("window", name, prec)
        rows = ours_rows(kw, ids, reps, prec == "fp8")
        res["params"] = rows.pop("params")
        rows["transformers"] = transformers_row(kw, ids, reps, prec == "fp8", f_tok)
        plain, hf = rows["plain"], rows["transformers"]
        if isinstance(plain, dict) and isinstance(hf, dict):
            rows["plain"]["over_transformers"] = hf["step_s"] / plain["step_s"]
        res[prec] = rows
        say(name, prec, rows)
        save()
    if isinstance(res["bf16"]["plain"], dict) and isinstance(res["fp8"]["plain"], dict):
        res["fp8_speedup_plain"] = res["bf16"]["plain"]["step_s"] / res["fp8"]["plain"]["step_s"]
    return res


def mfu_1p3b(seq_len, batch, reps):
    """Our plain bf16 train step on the 1.3B hybrid (fused loss): tokens/s and MFU over the H100 spec."""
    kw = window_hf_kw("hybrid_1.3b", 0, 0)
    ids = torch.randint(0, kw["vocab_size"], (batch, seq_len), device=DEV)
    model = ours_model(kw, 0, False)
    opt = build_optimizer(dict(model.named_parameters()), 1e-5, 0.1)
    f_fwd = forward_flops_per_token(model, seq_len)
    reset_peak()
    s = step_time(model, None, ids, reps, opt, fused=True)
    res = dict(params=sum(p.numel() for p in model.parameters()), seq_len=seq_len, batch=batch, step_s=s,
               tok_s=ids.numel() / s, mfu_spec=3 * f_fwd * ids.numel() / s / H100_BF16_DENSE, peak_mem_gb=peak_gb())
    del model, opt
    free()
    say("1.3B bf16", res)
    return res


# ---- FP8 loss gap --------------------------------------------------------------------------------------

def markov_batch(step, vocab, batch, seq_len, jump=0.1):
    """Learnable synthetic tokens: a fixed random successor of each of the first min(vocab, 4096) ids,
    followed with probability 1 - jump, else a uniformly random id (entropy floor ~0.33 + 0.1 ln V nats);
    the successor table is fixed, each step's batch seeded by the step."""
    V = min(vocab, 4096)
    succ = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1000 + step)
    rnd = torch.randint(0, V, (batch, seq_len), generator=g)
    jumps = torch.rand(batch, seq_len, generator=g) < jump
    ids = rnd.clone()
    for t in range(1, seq_len):
        ids[:, t] = torch.where(jumps[:, t], rnd[:, t], succ[ids[:, t - 1]])
    return ids.to(DEV)


def loss_curve(kw, fp8, steps, seq_len, batch, lr):
    say("loss curve", "fp8" if fp8 else "bf16", steps, "steps")
    model = ours_model(kw, 0, fp8)
    opt = build_optimizer(dict(model.named_parameters()), lr, 0.1)
    losses = [train_step(model, None, markov_batch(i, kw["vocab_size"], batch, seq_len), opt, fused=True)
              for i in range(steps)]
    del model, opt
    free()
    return [x.item() for x in losses]


def fp8_loss_gap(name, steps, seq_len, batch, layers_8b, layers_nano, lr=3e-4):
    kw = window_hf_kw(name, layers_8b, layers_nano)
    curves = {prec: loss_curve(kw, prec == "fp8", steps, seq_len, batch, lr) for prec in ("bf16", "fp8")}
    tail = {prec: statistics.fmean(c[-10:]) for prec, c in curves.items()}
    res = dict(window=name, steps=steps, seq_len=seq_len, batch=batch, lr=lr, loss_bf16=tail["bf16"],
               loss_fp8=tail["fp8"], rel_gap=(tail["fp8"] - tail["bf16"]) / tail["bf16"],
               curve_every_10={prec: c[::10] for prec, c in curves.items()})
    say("fp8 loss gap", {k: v for k, v in res.items() if k != "curve_every_10"})
    return res


# ---- main ----------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cmp-lengths", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--parity-only", action="store_true")
    ap.add_argument("--parts", nargs="+", default=["parity", "legacy", "windows", "gap"],
                    choices=["parity", "legacy", "windows", "gap", "mfu"],
                    help="legacy: the 1.3B throughput / distill / vs-transformers measurements of earlier runs")
    ap.add_argument("--windows", nargs="+", default=list(WINDOWS), choices=WINDOWS)
    ap.add_argument("--layers-8b", type=int, default=8, help="first layers of the 8B pattern in its window")
    ap.add_argument("--layers-nano", type=int, default=6, help="first layers of the Nano pattern in its window")
    ap.add_argument("--gap-window", default="nemotron_h_8b_window", choices=WINDOWS)
    ap.add_argument("--gap-steps", type=int, default=200)
    ap.add_argument("--gap-seq-len", type=int, default=1024)
    ap.add_argument("--gap-batch", type=int, default=4)
    ap.add_argument("--gap-lr", type=float, default=3e-4)
    ap.add_argument("--smoke", action="store_true", help="CPU or GPU, tiny shapes: checks that every part runs")
    a = ap.parse_args(argv)
    if a.smoke:
        a.seq_len, a.batch, a.reps, a.cmp_lengths = 64, 2, 1, [32]
        a.gap_steps, a.gap_seq_len, a.gap_batch = 3, 32, 2
    return a


def run_parts(a, report, save=lambda: None):
    """The requested parts in order; `save()` after each piece, so a device call cut off by its time limit
    still returns what finished."""
    big = {**BIG, **SMOKE_WIDTHS} if SMOKE else BIG
    if DEV.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the timings' setting (as in the earlier runs)
    if "legacy" in a.parts:
        if a.profile and DEV.type == "cuda":
            report["profile_2048"] = profile(big, 2048)
        peak = matmul_rate(torch.bfloat16, n=256 if SMOKE else 8192)
        report["bf16_matmul_tflops_measured"] = peak / 1e12
        say("bf16 matmul", peak / 1e12, "TFLOP/s")
        report["train_step_bf16"] = throughput(big, a.seq_len, a.batch, a.reps, peak)
        save()
        report["fwd_bwd_vs_transformers_bf16"] = cmp = {}
        for n in a.cmp_lengths:
            cmp[str(n)] = vs_transformers(big, n, 1, a.reps)
            save()
    if "mfu" in a.parts:
        report["mfu_1p3b_bf16"] = mfu_1p3b(a.seq_len, a.batch, a.reps)
        save()
    if "windows" in a.parts:
        report["windows"] = done = {}
        for w in a.windows:
            done[w] = {}
            window(w, a.seq_len, a.batch, a.reps, a.layers_8b, a.layers_nano, done[w], save)
    if "gap" in a.parts:
        report["fp8_loss_gap"] = fp8_loss_gap(a.gap_window, a.gap_steps, a.gap_seq_len, a.gap_batch, a.layers_8b,
                                              a.layers_nano, a.gap_lr)


def main(argv=None):
    global SMOKE, WARMUP
    a = parse_args(argv)
    SMOKE, WARMUP = a.smoke, 0 if a.smoke else 2
    import transformers

    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
    report = dict(device=name, torch=torch.__version__, transformers=transformers.__version__,
                  command=" ".join(sys.argv), smoke=SMOKE, gpu_kernels=kernels_present())
    print(report, flush=True)
    out = a.json
    if out is None and DEV.type == "cuda":
        kind = "h200" if "H200" in name else "h100" if "H100" in name else "cuda"
        out = ROOT / "bench" / f"gpu_{kind}_{'-'.join(a.parts)}.json"

    def save():
        if out:
            Path(out).write_text(json.dumps(report, indent=1))
    if "parity" in a.parts or a.parity_only:
        report["parity_fp32"] = parity()
        say(report["parity_fp32"])
        save()
    if not a.parity_only:
        run_parts(a, report, save)
    print(json.dumps({k: v for k, v in report.items() if k != "profile_2048"}, indent=1))
    save()


if __name__ == "__main__":
    main()
