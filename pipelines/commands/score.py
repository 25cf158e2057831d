"""`remodel score`: calibrate on DATA and write a SCORES directory (see compress/scores.py).

Whole mode loads the model; streaming mode holds one layer's weights at a time (for checkpoints larger
than memory). 'auto' streams when the fp32 weights exceed AUTO_FRACTION of the available memory.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from remodel.compress.baselines import DATA_METHODS, METHODS, weight_scores
from remodel.compress.expert_scores import check_expert_method, rank_experts
from remodel.compress.head_criteria import rank_correlation, unit_values
from remodel.compress.head_loo import head_costs, loo_scores, loo_units, measured_scores
from remodel.compress.importance import score_model
from remodel.compress.streaming import Streaming, score_streaming
from remodel.compress.scores import write_scores
from remodel.models.checkpoint import CheckpointReader, atomic_output_dir
from remodel.models.errors import RemodelError
from remodel.models.hf import config_from_hf
from remodel.models.kinds import routed
from remodel.models.load import iter_our_tensors, load_model

from ..data.data import batches as make_batches, load_texts, pack
from ..distributed.runtime import load_tokenizer
from .configs import ScoreOptions
from .options import given, make
from .plots import plot_importance
from .report import write_report

MODES = ScoreOptions.__dataclass_fields__["mode"].metadata["choices"]
AUTO_FRACTION = 0.5
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def choose_mode(mode: str, weight_bytes: int, available_bytes: int) -> str:
    if mode != "auto":
        return mode
    return "streaming" if weight_bytes > AUTO_FRACTION * available_bytes else "whole"


def _positive(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        flag = f" (--{name.replace('_', '-')})" if name in ("samples", "seq_len", "batch") else ""
        raise RemodelError(f"{name} must be a positive integer{flag}, got {v!r}")


def _tokenizer(model_dir: Path):
    """MODEL's tokenizer, never code from the folder (runtime.load_tokenizer)."""
    return load_tokenizer(model_dir, "MODEL")


def score_weights(model_dir, out, method: str, seed: int = 0, overwrite: bool = False) -> dict:
    """Data-free baseline SCORES (compress/baselines.py): 'magnitude' streams the weights once,
    'random' reads only the config. Same files as an activation run. Returns the report."""
    t0 = time.time()
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise RemodelError(f"model not found: {model_dir}")
    reader = CheckpointReader(model_dir)
    cfg = config_from_hf(reader.config)
    with reader, atomic_output_dir(out, overwrite=overwrite, inputs=[model_dir]) as tmp:
        scores = weight_scores(cfg, method, iter_our_tensors(reader, cfg) if method == "magnitude" else None, seed)
        meta = {"config": cfg.to_dict(), "source": str(model_dir), "method": method, "seed": seed, "samples": 0,
                "seq_len": 0, "tokens": 0, "baseline_loss": None, "mode": method}
        write_scores(tmp, scores, meta)
        plot_importance(tmp / "importance.png", cfg.pattern, scores)
        report = {"command": "score", "method": method, "seed": seed, "model": str(model_dir), "output": str(out),
                  "seconds": round(time.time() - t0, 3),
                  "layers": [{"index": i, "type": c, "block_importance": float(scores["block_importance"][i])}
                             for i, c in enumerate(cfg.pattern)],
                  "files": ["scores.safetensors", "scores.json", "importance.png"]}
        write_report(tmp, report)
    return report


def score(model_dir=None, data=None, out=None, opts: ScoreOptions | None = None, **kw) -> dict:
    """Score every prunable unit of MODEL on `samples` sequences of `seq_len` tokens from DATA and
    write SCORES to `out` (+ remodel_report.json, importance.png); the options are ScoreOptions
    (pipelines/commands/configs.py: each one's meaning and default), given as `opts` or by name. Returns the report.
    method='activation_measured' (the default): activation, with the units a kind names as few (Gated DeltaNet
    key-head groups) ranked by their leave-one-out loss increase over the loss batches, whole or streamed
    (compress/head_loo.measured_scores). method='activation': activations alone. method='magnitude' | 'random' (seeded by `seed`) writes data-free baseline scores instead
    (compress/baselines.py); DATA and the calibration options are then ignored (DATA may be None).
    expert_method: what ranks routed experts (`layers.i.experts`), compress/expert_scores.py; all their
    tensors are written. method='loo': the activation scores, with the Mamba and Gated DeltaNet heads ranked by
    their leave-one-out loss increase on the calibration data (compress/head_loo.py: one forward per head,
    whole model in memory). method='activation_in': activation with each kind's in_sites() (Mamba-2 heads at
    in_proj's x segment, the default before issue 55)."""
    return _score(make(ScoreOptions, opts, **given(model=model_dir, data=data, out=out), **kw))


def _score(o: ScoreOptions) -> dict:
    model_dir, data, out, samples, seq_len = o.model, o.data, o.out, o.samples, o.seq_len
    method, seed, overwrite = o.method, o.seed, o.overwrite
    t0 = time.time()
    if method not in METHODS:
        raise RemodelError(f"unknown scoring method {method!r} (allowed: {', '.join(METHODS)})")
    expert_method = check_expert_method(o.expert_method)
    if method not in DATA_METHODS:
        return score_weights(model_dir, out, method, seed, overwrite)
    _check_options(o)
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise RemodelError(f"model not found: {model_dir}")
    reader = CheckpointReader(model_dir)  # config, safetensors headers and shards checked here
    cfg = config_from_hf(reader.config)
    _check_loo(o, cfg)
    device = o.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # the data is read and checked before OUT (or any parent of it) is created
    blocks = _calibration_blocks(model_dir, data, cfg, samples, seq_len)
    with reader, atomic_output_dir(out, overwrite=overwrite, inputs=[model_dir]) as tmp:
        batch_list = list(make_batches(blocks, o.batch))
        import psutil
        available = psutil.virtual_memory().available
        weight_bytes = sum(torch.Size(reader.shape(k)).numel() * 4 for k in reader.keys())
        mode = "whole" if method == "loo" else choose_mode(o.mode, weight_bytes, available)
        budget = o.max_memory_bytes if o.max_memory_bytes is not None else available // 4
        if mode == "whole":
            scores, info = _score_whole(o, load_model(model_dir, device=device), batch_list, budget, tmp)
        else:
            run = Streaming(max_memory_bytes=budget, spill_dir=tmp, device=device, progress=o.progress)
            scores, info = score_streaming(reader, batch_list, loss_increase=o.loss_increase,
                                           loss_batches=o.loss_batches, run=run, in_sites=method == "activation_in",
                                           measured=method == "activation_measured")
        scores = rank_experts(scores, cfg, expert_method, seed)
        meta = {"config": cfg.to_dict(), "source": str(model_dir), "method": method, "samples": len(blocks),
                "seq_len": seq_len, "tokens": info["tokens"], "baseline_loss": info["baseline_loss"], "mode": mode,
                "expert_method": expert_method if routed(cfg) else None}
        write_scores(tmp, scores, meta)
        plot_importance(tmp / "importance.png", cfg.pattern, scores)
        seconds = time.time() - t0
        report = {"command": "score", "model": str(model_dir), "data": str(data), "output": str(out), "mode": mode,
                  "device": device, "samples": len(blocks), "samples_requested": samples, "seq_len": seq_len,
                  "batch": o.batch, "tokens": info["tokens"], "baseline_loss": info["baseline_loss"],
                  "loss_batches": info["loss_batches"], "weight_bytes_fp32": weight_bytes,
                  "available_memory_bytes": available, "spilled_bytes": info.get("spilled_bytes", 0),
                  "seconds": round(seconds, 3), "tokens_per_s": round(info["tokens"] / max(seconds, 1e-9), 1),
                  "layers": _layer_rows(cfg.pattern, scores), "method": method,
                  "files": ["scores.safetensors", "scores.json", "importance.png"]}
        if "head_rank_correlation" in info:  # --method loo: how the default ranking tracks the measured costs
            report["head_rank_correlation"] = info["head_rank_correlation"]
        write_report(tmp, report)
    return report


def _score_whole(o: ScoreOptions, model, batch_list, budget, tmp) -> tuple[dict, dict]:
    """The scores with the whole model in memory -> (scores, info): activation (in_proj sites for activation_in),
    then the measured units (activation_measured) or every head's LOO cost (loo, with the default's rank
    correlation to those costs in info)."""
    cfg, method = model.cfg, o.method
    scores, info = score_model(model, batch_list, loss_increase=o.loss_increase, loss_batches=o.loss_batches,
                               progress=o.progress, in_sites=method == "activation_in")
    measured = dict(loss_batches=o.loss_batches, max_memory_bytes=budget, spill_dir=tmp)
    if method == "activation_measured":
        scores = measured_scores(model, scores, batch_list, progress=o.progress, **measured)
    if method == "loo":
        costs, _ = head_costs(model, batch_list, max_memory_bytes=budget, spill_dir=tmp, progress=o.progress)
        default = measured_scores(model, scores, batch_list, **measured)
        info["head_rank_correlation"] = rank_correlation(unit_values(cfg, default), costs)  # the default's
        scores = loo_scores(cfg, scores, costs)
    return scores, info


def _check_options(o: ScoreOptions):
    for name in ("samples", "seq_len", "batch", "loss_batches"):
        _positive(name, getattr(o, name))
    if o.mode not in MODES:
        raise RemodelError(f"unknown mode {o.mode!r} (allowed: {', '.join(MODES)})")
    if o.max_memory_bytes is not None and o.max_memory_bytes < 0:
        raise RemodelError(f"max_memory_bytes must be >= 0, got {o.max_memory_bytes}")


def _check_loo(o: ScoreOptions, cfg) -> None:
    if o.method != "loo":
        return
    if o.mode == "streaming":
        raise RemodelError("--method loo holds the whole model in memory; use --mode whole or auto")
    if not loo_units(cfg):
        raise RemodelError(f"--method loo ranks Mamba and Gated DeltaNet heads; the model has none "
                           f"(pattern {cfg.pattern})")


def _calibration_blocks(model_dir: Path, data, cfg, samples: int, seq_len: int):
    """The calibration token blocks [n, seq_len] of DATA, tokenized with MODEL's tokenizer (checked)."""
    if not Path(data).expanduser().exists():
        raise RemodelError(f"data not found: {data}")
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        raise RemodelError(f"no tokenizer files in {model_dir}")
    tok = _tokenizer(model_dir)
    blocks = pack(load_texts(data), tok, seq_len, max_tokens=samples * seq_len)
    if int(blocks.max()) >= cfg.vocab_size:
        raise RemodelError(f"the tokenizer in {model_dir} gives token id {int(blocks.max())} but the model's "
                           f"vocab_size is {cfg.vocab_size}")
    return blocks


def _layer_rows(pattern: str, scores: dict) -> list[dict]:
    return [{"index": i, "type": c, "block_importance": float(scores["block_importance"][i]),
             **({"loss_increase": float(scores["loss_increase"][i])} if "loss_increase" in scores else {})}
            for i, c in enumerate(pattern)]
