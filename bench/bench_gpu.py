"""GPU checks and throughput (run on a CUDA machine; nothing here runs in CI).

1. Parity in fp32 on CUDA (TF32 off): our model (pure-PyTorch scan) against transformers'
   NemotronHForCausalLM with the same weights, logits and gradients of a loss; and our model with
   mamba-ssm's fused Triton SSD scan (when importable) against our pure-PyTorch scan.
2. bf16 train step (the trainer's own code: compute_losses + backward + clip + AdamW, autocast bf16,
   fp32 master weights) of a ~1.3B Nemotron-H-style hybrid: tokens/s and MFU = train FLOPs (3x the
   trainer's forward count: 2 x matmul params + attention) x tokens/s over (a) the bf16 matmul rate
   measured in this process (8192^3) and (b) the H100 SXM dense bf16 spec, 989 TFLOP/s.
   Variants: ours with the mamba-ssm scan, ours with the pure-PyTorch scan, transformers' own model
   (its torch path; it has no fused path without causal-conv1d) at a length it fits in memory.
3. Distillation step (teacher = the same 1.3B, frozen, bf16 forward) over the plain step, same process.

    python bench/bench_gpu.py [--seq-len 4096] [--batch 2] [--reps 5] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models.mamba as mamba  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.load import load_model  # noqa: E402
from models.model import HybridLM, init_weights  # noqa: E402
from pipelines.metrics import forward_flops_per_token  # noqa: E402
from pipelines.trainer import build_optimizer, compute_losses  # noqa: E402

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


def sync():
    torch.cuda.synchronize()


def timed(fn, reps, warmup=2):
    """Median wall seconds of fn() over reps calls after `warmup` untimed ones, GPU synchronised."""
    times = []
    for i in range(warmup + reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_rate(dtype, n=8192, reps=10):
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - t)


def hf_and_ours(kw):
    """transformers' NemotronHForCausalLM (fp32, seed 0) and ours loaded from its saved weights, on CUDA."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("nemotron_h", **kw)).float()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = load_model(tmp).cuda()
    return hf.cuda(), ours


def grads(model):
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def parity():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf, ours = hf_and_ours(TINY_HF)
    ids = torch.randint(0, TINY_HF["vocab_size"], (2, 200), device="cuda")  # 200: not a multiple of 32
    out = {}

    def run(fn, model):
        model.zero_grad(set_to_none=True)
        logits = fn(ids)
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                          ids[:, 1:].reshape(-1)).backward()
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
    kernel = mamba._mamba_kernel()
    out["mamba_ssm_kernel"] = kernel is not None
    if kernel is not None:
        l_k, g_k = run(ours, ours)
        out["logits_max_abs_ours_kernel_vs_torch"] = (l_k - l_ours).abs().max().item()
        out["grad_max_rel_ours_kernel_vs_torch"] = max(
            ((g_k[k] - v).abs().max() / v.abs().max().clamp(min=1e-30)).item() for k, v in g_ours.items())
    torch.backends.cuda.matmul.allow_tf32 = True
    return out


def step_time(model, teacher, ids, reps, opt):
    w = dict(kl=1.0 if teacher is not None else 0.0, lm=0.0 if teacher is not None else 1.0, hidden=0.0,
             lb=0.0, z=0.0, temperature=1.0, topk=None)
    ac = torch.autocast("cuda", dtype=torch.bfloat16)

    def step():
        loss, _ = compute_losses(model, teacher, ids, w, autocast=ac)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed(step, reps)


def throughput(seq_len, batch, reps, peak):
    res = {}
    torch.manual_seed(0)
    model = init_weights(HybridLM(ModelConfig(**BIG)), seed=0).cuda()
    n = sum(p.numel() for p in model.parameters())
    opt = build_optimizer(dict(model.named_parameters()), 1e-5, 0.1)
    ids = torch.randint(0, BIG["vocab_size"], (batch, seq_len), device="cuda")
    f_tok = 3 * forward_flops_per_token(model, seq_len)
    tok = batch * seq_len
    for name, kern in (("ours + mamba-ssm scan", True), ("ours, pure-PyTorch scan", False)):
        mamba.USE_KERNEL = kern
        if kern and mamba._mamba_kernel() is None:
            continue
        torch.cuda.reset_peak_memory_stats()
        try:
            s = step_time(model, None, ids, reps, opt)
        except torch.OutOfMemoryError:
            res[name] = "out of memory"
            continue
        res[name] = dict(params=n, seq_len=seq_len, batch=batch, step_s=s, tok_s=tok / s,
                         mfu_measured=f_tok * tok / s / peak, mfu_spec=f_tok * tok / s / H100_BF16_DENSE,
                         peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30)
        print(name, res[name], flush=True)
    mamba.USE_KERNEL = True
    # distillation: the same model as a frozen teacher, student = a copy being trained
    teacher = init_weights(HybridLM(ModelConfig(**BIG)), seed=1).cuda().eval().requires_grad_(False)
    try:
        plain = step_time(model, None, ids, reps, opt)
        kd = step_time(model, teacher, ids, reps, opt)
        res["distill"] = dict(plain_s=plain, distill_s=kd, ratio=kd / plain, distill_tok_s=tok / kd)
    except torch.OutOfMemoryError:
        res["distill"] = "out of memory"
    print("distill", res["distill"], flush=True)
    del teacher, opt, model
    torch.cuda.empty_cache()
    return res


def vs_transformers(seq_len, batch, reps):
    """bf16 autocast forward + CE + backward (no optimizer) of ours and transformers, same weights."""
    kw = dict(BIG)
    kw["hybrid_override_pattern"] = kw.pop("pattern")
    kw["layer_norm_epsilon"] = 1e-5
    hf, ours = hf_and_ours(kw)
    ids = torch.randint(0, kw["vocab_size"], (batch, seq_len), device="cuda")
    res = {}

    def one(fn, model):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fn(ids)
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                          ids[:, 1:].reshape(-1)).backward()

    runs = [("transformers (torch path)", lambda x: hf(x).logits, hf, True),
            ("ours, pure-PyTorch scan", ours, ours, False), ("ours + mamba-ssm scan", ours, ours, True)]
    for name, fn, model, kern in runs:
        mamba.USE_KERNEL = kern
        if model is ours and kern and mamba._mamba_kernel() is None:
            continue
        torch.cuda.reset_peak_memory_stats()
        try:
            s = timed(lambda: one(fn, model), reps)
            res[name] = dict(step_s=s, tok_s=batch * seq_len / s, peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30)
        except torch.OutOfMemoryError:
            res[name] = "out of memory"
        torch.cuda.empty_cache()
        print(name, seq_len, res[name], flush=True)
    mamba.USE_KERNEL = True
    return res


def profile(seq_len):
    """Top CUDA kernels of one bf16 forward + backward of ours (mamba-ssm scan when present)."""
    from torch.profiler import ProfilerActivity, profile as prof

    model = init_weights(HybridLM(ModelConfig(**BIG)), seed=0).cuda()
    ids = torch.randint(0, BIG["vocab_size"], (1, seq_len), device="cuda")

    def one():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids.reshape(-1)).backward()
        model.zero_grad(set_to_none=True)

    one()
    sync()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        one()
        sync()
    table = p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    print(table, flush=True)
    del model
    torch.cuda.empty_cache()
    return table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cmp-lengths", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--parity-only", action="store_true")
    a = ap.parse_args()
    import transformers

    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__)
    print(report, flush=True)
    report["parity_fp32"] = parity()
    print(report["parity_fp32"], flush=True)
    if a.parity_only:
        return
    if a.profile:
        report["profile_2048"] = profile(2048)
    peak = matmul_rate(torch.bfloat16)
    report["bf16_matmul_tflops_measured"] = peak / 1e12
    print("bf16 matmul", peak / 1e12, "TFLOP/s", flush=True)
    report["train_step_bf16"] = throughput(a.seq_len, a.batch, a.reps, peak)
    report["fwd_bwd_vs_transformers_bf16"] = {str(l): vs_transformers(l, 1, a.reps) for l in a.cmp_lengths}
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
