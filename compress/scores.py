"""The SCORES directory: scores.safetensors (float32, our layer indices) + scores.json (metadata)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from remodel.models.checkpoint import atomic_output_dir, read_header
from remodel.models.files import read_json
from remodel.models.errors import RemodelError

FORMAT = "remodel-scores/1"


DEPTH = ("block_importance", "loss_increase")  # per-layer: NaN marks a layer scoring never saw


def check_score_values(tensors: dict, where: str) -> None:
    """Refuse scores that would rank nothing: not floating point, any inf, or an axis all NaN (its kept
    units would then be arbitrary). `where` names the source in the message (a path and its flag)."""
    for k, t in tensors.items():
        if not t.is_floating_point() or bool(torch.isinf(t).any()):
            raise RemodelError(f"{where}: scores {k!r} are not finite floating-point numbers")
        if t.numel() and bool(torch.isnan(t).all()):
            raise RemodelError(f"{where}: scores {k!r} are all NaN (nothing to rank); re-run `remodel score`")


def write_scores(dir, tensors: dict, meta: dict) -> None:
    """The two files into an existing (temporary) directory; save_scores is the atomic form. Scores
    computed as NaN (an overflow while scoring) are refused here, before anything could prune by them:
    only the per-layer DEPTH scores may hold a NaN, for a layer scoring never saw."""
    check_score_values(tensors, "scoring")
    for k, t in tensors.items():
        n = int(torch.isnan(t).sum()) if k not in DEPTH else 0
        if n:
            raise RemodelError(f"scoring: scores {k!r} came out NaN in {n} of {t.numel()} unit(s) "
                               "(an overflow in the model's activations?)")
    save_file({k: v.detach().float().cpu().contiguous() for k, v in tensors.items()}, Path(dir) / "scores.safetensors")
    (Path(dir) / "scores.json").write_text(json.dumps({**meta, "format": FORMAT}, indent=2, default=str) + "\n")


def save_scores(out_dir, tensors: dict, meta: dict, overwrite: bool = False) -> Path:
    with atomic_output_dir(out_dir, overwrite=overwrite) as tmp:
        write_scores(tmp, tensors, meta)
    return Path(out_dir)


def load_scores(path) -> tuple[dict[str, torch.Tensor], dict]:
    p = Path(path)
    if not (p / "scores.json").is_file() or not (p / "scores.safetensors").is_file():
        raise RemodelError(f"{p}: not a scores directory (needs scores.json and scores.safetensors)")
    meta = read_json(p / "scores.json")
    if meta.get("format") != FORMAT:
        raise RemodelError(f"{p / 'scores.json'}: format {meta.get('format')!r}, expected {FORMAT!r}")
    read_header(p / "scores.safetensors")  # as strict as the library, with a one-line reason
    try:
        tensors = load_file(p / "scores.safetensors")
    except Exception as e:  # corrupt file
        raise RemodelError(f"{p / 'scores.safetensors'}: cannot read ({type(e).__name__}: {e})".splitlines()[0]) from None
    check_score_values(tensors, f"{p / 'scores.safetensors'} (--scores)")
    return tensors, meta
