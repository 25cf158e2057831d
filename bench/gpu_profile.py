"""Where a GPU train step's time goes: ours against transformers', profiled in one process (issue 42).

For each window (bench_gpu's 8B window and Nano MoE window, bf16 autocast, fp32 master weights, AdamW,
batch x length tokens): the step time, then one profiled step with shapes, written as
`<out-dir>/gpu_profile_<window>_<side>.txt`: the top kernels by self CUDA time (with input shapes), the
time per kernel category (GEMM, attention, Mamba scan, conv, norm, optimizer, loss, copies/casts,
elementwise), and the GPU-idle fraction = 1 - (CUDA kernel time of one step) / (wall time of one
unprofiled step): the share of the step in which the GPU waits for the host.
Then, on the 8B window, ours against transformers at further shapes (`--shapes`, timed only), and ours under
each switch (`--variants`) off, timed in the same process: the step's knobs one at a time, so the
profile's largest rows can be acted on with figures.

    python bench/gpu_profile.py [--windows 8b nano] [--seq-len 4096] [--batch 2] [--json OUT.json]
    python bench/gpu_profile.py --smoke     (CPU, tiny widths: checks that every part runs)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "bench_gpu.py")
bg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bg)

import remodel.models.mamba as mamba  # noqa: E402
import remodel.pipelines.training.fused_loss as fused_loss  # noqa: E402
import remodel.pipelines.training.trainer as trainer  # noqa: E402

WINDOWS = {"8b": "nemotron_h_8b_window", "nano": "nano_moe_window", "1p3b": "hybrid_1.3b"}
CATEGORIES = [  # first match wins; names of cuBLAS / CUTLASS / Triton / ATen kernels
    ("gemm", r"gemm|cutlass|nvjet|xmma|cublas|_mm_|matmul|grouped_mm|wgmma"),
    ("attention", r"flash|fmha|attention|sdpa|efficient_attention"),
    ("mamba scan", r"_chunk_|_bmm_chunk|_state_passing|ssd"),
    ("conv", r"conv1d|conv_fwd|conv_bwd|causal_conv|cudnn|depthwise"),
    ("norm", r"rms|norm"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("loss / softmax", r"softmax|cross_entropy|nll|logsumexp|log_softmax"),
    ("copy / cast", r"copy_kernel|direct_copy|_to_copy|bfloat16_copy|copy_|cast|convert|fill|memset|catarray|index"),
    ("elementwise / reduce", r"elementwise|vectorized|unrolled|reduce|silu|mul|add|exp"),
]


def category(name: str) -> str:
    low = name.lower()
    return next((c for c, pat in CATEGORIES if re.search(pat, low)), "other")


def ours_step(kw, ids):
    """Our trainer step on a fresh window model (each block torch.compile'd when COMPILE_BLOCKS) ->
    (step(), cleanup())."""
    model = bg.ours_model(kw, 0, False)
    if COMPILE_BLOCKS:
        for layer in model.layers:
            layer.compile()
    opt = trainer.build_optimizer(dict(model.named_parameters()), 1e-5, 0.1)
    return (lambda: bg.train_step(model, None, ids, opt, fused=FUSED_LOSS)), (model, opt)


def hf_step(kw, ids):
    """transformers' own train step (its loss, backward, clip, fused AdamW; bf16 autocast) -> (step(), held)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(bg.DEV):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("nemotron_h", **kw)).float().train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, weight_decay=0.1, fused=bg.DEV.type == "cuda")

    def step():
        with bg.autocast():
            loss = hf(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    mode = bg.train_mode_or_eval(hf, step)
    return step, (hf, opt, mode)


FUSED_LOSS = True
COMPILE_BLOCKS = False  # the compiled_blocks variant: every block torch.compile'd (measured, not yet the trainer's)


def _self_device_us(e) -> float:
    t = getattr(e, "self_device_time_total", None)
    return t if t is not None else getattr(e, "self_cuda_time_total", 0.0)


def _annotation(e) -> bool:
    """A user range on the GPU timeline (torch.optim's "Optimizer.step#AdamW.step"), not a kernel: its time is
    its kernels' again (the H200 tables of 2026-11-27 counted AdamW twice and read the GPU as never idle)."""
    return bool(getattr(e, "is_user_annotation", False)) or "#" in e.key or e.key.startswith("ProfilerStep")


def kernel_rows(prof):
    """Device kernels only (not the operators that launched them, whose device time is the same time again):
    (name, input shapes of the launching operator where known, self device us, calls), and their total (us)."""
    from torch.autograd import DeviceType

    ops = {}  # operator rows by input shapes: the shape column of the kernel table
    for e in prof.key_averages(group_by_input_shape=True):
        if e.device_type != DeviceType.CUDA and _self_device_us(e) > 0:
            ops.setdefault(e.key, []).append((str(e.input_shapes)[:100], _self_device_us(e)))
    rows = [(e.key, "", _self_device_us(e), e.count) for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA and _self_device_us(e) > 0 and not _annotation(e)]
    return sorted(rows, key=lambda r: -r[2]), sum(r[2] for r in rows), ops


def op_rows(ops, top):
    """The operators with the most device time, each with its input shapes (the launching side of the table)."""
    flat = sorted(((t, k, sh) for k, v in ops.items() for sh, t in v), reverse=True)[:top]
    return [f"{t / 1e3:9.2f}  {k[:60]} | {sh}" for t, k, sh in flat]


def profile_one(step, label, reps, out_dir, top):
    """Times step() (median of reps), profiles one call, writes the table -> summary dict."""
    from torch.profiler import ProfilerActivity, profile

    step_s = bg.timed(step, reps)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bg.DEV.type == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:
        step()
        bg.sync()
    rows, total_us, ops = kernel_rows(prof)
    cats = defaultdict(float)
    for name, _, t, _ in rows:
        cats[category(name)] += t
    kernel_s = total_us / 1e6
    res = dict(step_s=step_s, kernel_s=kernel_s, gpu_idle_fraction=max(0.0, 1 - kernel_s / step_s) if kernel_s else None,
               categories_ms={k: round(v / 1e3, 3) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])})
    lines = [f"# {label}: step {step_s * 1e3:.1f} ms (median of {reps}), device kernels {kernel_s * 1e3:.1f} ms, "
             f"GPU idle {100 * (res['gpu_idle_fraction'] or 0):.1f}% ({bg.DEV_NAME})", "", "## by category (ms, share)"]
    lines += [f"{k:24s} {v:9.2f}  {100 * v / max(total_us / 1e3, 1e-9):5.1f}%" for k, v in res["categories_ms"].items()]
    lines += ["", f"## top {top} kernels by self device time", f"{'ms':>9s} {'calls':>6s}  {'category':14s} name | shapes"]
    lines += [f"{t / 1e3:9.2f} {n:6d}  {category(k):14s} {k[:110]}" for k, s, t, n in rows[:top]]
    lines += ["", f"## top {top} operators by device time, with input shapes", f"{'ms':>9s}  name | shapes"]
    lines += op_rows(ops, top)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, f"gpu_profile_{label}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:20]), flush=True)
    return res


EXTRAS = ("compiled_blocks", "liger_ce")  # variants that turn something on (the others turn a default off)


def switch(name, on):
    """One knob of our step: conv (fla-core's Triton conv), adamw (fused kernel), kernels (mamba-ssm +
    conv kernels at all), fused_loss (the chunked vocabulary loss), compiled_loss (its blocks' arithmetic as
    torch.compile'd kernels; off: eager), compiled_blocks and liger_ce (extras, off by default:
    every block torch.compile'd; liger's fused linear CE in place of ours)."""
    global FUSED_LOSS, COMPILE_BLOCKS
    if name == "fused_adamw":
        trainer.FUSED_ADAMW = on
    elif name == "kernels":
        mamba.USE_KERNEL = on
    elif name == "fused_loss":
        FUSED_LOSS = on
    elif name == "fla_conv":
        mamba.USE_FLA_CONV = on
    elif name == "compiled_loss":
        fused_loss.COMPILE = on
    elif name == "liger_ce":
        fused_loss.LIGER = not on  # an extra since 2026-11-28 (off by default): its variant turns it on
    elif name == "compiled_blocks":
        COMPILE_BLOCKS = not on  # an extra: its variant turns it on


def variants(kw, ids, reps, names):
    """Our step with each knob off (the others at their defaults), timed in this process -> {name: s}."""
    out = {}
    for name in ["defaults"] + names:
        if name != "defaults":
            switch(name, False)
        try:
            step, held = ours_step(kw, ids)
            out[_label(name)] = bg.timed(step, reps)
            del step, held
        except Exception as e:
            out[name] = bg.failed(e)
        bg.free()
        if name != "defaults":
            switch(name, True)
        bg.say("variant", name, out.get(_label(name), out.get(name)))
    return out


def _label(name):
    return name if name == "defaults" else name + (" on" if name in EXTRAS else " off")


def compare(kw, shape, reps):
    """Step seconds of ours and transformers' at shape "BxL" (timed only) -> {ours_s, transformers_s, ratio}."""
    b, l = (int(x) for x in shape.split("x"))
    ids = torch.randint(0, kw["vocab_size"], (b, l), device=bg.DEV)
    out = {}
    for side, make in (("ours", ours_step), ("transformers", hf_step)):
        try:
            step, held = make(kw, ids)
            out[side + "_s"] = bg.timed(step, reps)
            del step, held
        except torch.OutOfMemoryError:
            out[side + "_s"] = "out of memory"
        except Exception as e:
            out[side + "_s"] = bg.failed(e)
        bg.free()
    if all(isinstance(v, float) for v in out.values()):
        out["ratio"] = out["transformers_s"] / out["ours_s"]
    bg.say("vs transformers", shape, out)
    return out


def window(w, a, report, save):
    kw = bg.window_hf_kw(WINDOWS[w], a.layers_8b, a.layers_nano)
    ids = torch.randint(0, kw["vocab_size"], (a.batch, a.seq_len), device=bg.DEV)
    res = report.setdefault("windows", {}).setdefault(w, {"pattern": kw["hybrid_override_pattern"],
                                                          "batch": a.batch, "seq_len": a.seq_len})
    for side in a.sides:
        bg.say(w, side)
        try:
            step, held = (ours_step if side == "ours" else hf_step)(kw, ids)
            bg.reset_peak()
            res[side] = profile_one(step, f"{w}_{side}", a.reps, a.out_dir, a.top)
            res[side]["peak_mem_gb"] = bg.peak_gb()
            if side == "transformers":
                res[side]["mode"] = held[2]
            del step, held
        except torch.OutOfMemoryError:
            res[side] = "out of memory"
        except Exception as e:
            res[side] = bg.failed(e)
        bg.free()
        save()
    if isinstance(res.get("ours"), dict) and isinstance(res.get("transformers"), dict):
        res["ours_over_transformers"] = res["transformers"]["step_s"] / res["ours"]["step_s"]
    for shape in (a.shapes if w == "8b" else []):
        res.setdefault("vs_transformers", {})[shape] = compare(kw, shape, a.reps)
        save()
    if a.variants and w in a.variant_windows:
        res["variants_s"] = variants(kw, ids, a.reps, a.variants)
        save()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", nargs="+", default=["8b", "nano"], choices=list(WINDOWS))
    ap.add_argument("--sides", nargs="+", default=["ours", "transformers"], choices=["ours", "transformers"])
    ap.add_argument("--variants", nargs="*",
                    default=["fla_conv", "fused_adamw", "fused_loss", "compiled_loss", "liger_ce", "kernels"],
                    help="knobs of our step timed off one at a time (default: %(default)s); compiled_blocks: "
                         "timed on (every block torch.compile'd: minutes of compiling, its own device stage)")
    ap.add_argument("--variant-windows", nargs="*", default=["8b"], choices=list(WINDOWS),
                    help="windows whose variants are timed (default: %(default)s)")
    ap.add_argument("--shapes", nargs="*", default=["1x1024", "1x4096"],
                    help="further BxL shapes of the 8b window timed (not profiled) against transformers "
                         "(default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=30, help="kernel rows per table (default: %(default)s)")
    ap.add_argument("--layers-8b", type=int, default=8)
    ap.add_argument("--layers-nano", type=int, default=6)
    ap.add_argument("--out-dir", default=None, help="where the tables go (default: bench/ on a GPU, none on CPU)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU or GPU, tiny widths: checks that every part runs")
    a = ap.parse_args(argv)
    bg.SMOKE, bg.WARMUP = a.smoke, 0 if a.smoke else 2
    if a.smoke:
        a.seq_len, a.batch, a.reps, a.shapes = 64, 2, 1, ["1x32"]
    bg.DEV_NAME = torch.cuda.get_device_name() if bg.DEV.type == "cuda" else "cpu"
    if a.out_dir is None and bg.DEV.type == "cuda":
        a.out_dir = str(ROOT / "bench")
    if bg.DEV.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    report = dict(device=bg.DEV_NAME, torch=torch.__version__, command=" ".join(sys.argv), smoke=a.smoke,
                  date=time.strftime("%Y-%m-%d"), gpu_kernels=bg.kernels_present())

    def save():
        if a.json:
            Path(a.json).write_text(json.dumps(report, indent=1))
    for w in a.windows:
        window(w, a, report, save)
    save()
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
