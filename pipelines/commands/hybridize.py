"""`remodel hybridize`: dense attention checkpoint -> hybrid checkpoint (upcycle.hybridize): the attention layers
not kept become linear-mixer layers initialised from their attention weights (or at random), the rest copied
exactly, written as a family transformers loads without remote code. Every input is checked on config.json
before the weights are read; the model is held whole (two copies) while converting.
"""
from __future__ import annotations

import time

import torch

from remodel.models.errors import RemodelError
from remodel.models.load import load_config, load_model, read_config_dict, save_model
from remodel.models.params import count_params
from remodel.upcycle.hybridize import INITS, hybridize_model, kept, replaceable, target

from .configs import HybridizeOptions
from .options import given, make


def _dtype(config: dict):
    """The checkpoint's own floating-point dtype (config.json), None where it names none."""
    name = config.get("dtype") or config.get("torch_dtype")
    t = getattr(torch, name, None) if isinstance(name, str) else None
    return t if isinstance(t, torch.dtype) and t.is_floating_point else None


def plan(o: HybridizeOptions) -> dict:
    """What the conversion will do, from config.json alone (one-line RemodelError for any bad input)."""
    if o.init not in INITS:
        raise RemodelError(f"unknown --init {o.init!r} (supported: {', '.join(INITS)})")
    cfg = load_config(o.model)
    layers = replaceable(cfg, o.mixer)
    keep = kept(len(layers), o.keep_attention, o.keep_layers)
    replaced = {i for j, i in enumerate(layers) if j not in keep}
    family, new_cfg = target(cfg, o.mixer, replaced, o.to)
    return {"cfg": cfg, "new_cfg": new_cfg, "family": family, "keep": keep, "replaced": replaced, "layers": layers}


def hybridize(model_dir=None, out=None, opts: HybridizeOptions | None = None, **kw) -> dict:
    """Dense checkpoint at `model_dir` -> hybrid checkpoint at `out`; -> the report. The options are
    HybridizeOptions (pipelines/commands/configs.py), given as `opts` or by name."""
    t0 = time.perf_counter()
    o = make(HybridizeOptions, opts, **given(model=model_dir, out=out), **kw)
    p = plan(o)
    src = load_model(o.model)
    model = hybridize_model(src, p["new_cfg"], o.mixer, p["replaced"], o.init, o.seed)
    dtype = _dtype(read_config_dict(o.model))
    save_model(model, o.out, family=p["family"], aux_from=o.model, overwrite=o.overwrite, dtype=dtype,
               inputs=[o.model])
    cfg, new_cfg = p["cfg"], p["new_cfg"]
    return {"command": "hybridize", "input": str(o.model), "output": str(o.out), "to": p["family"],
            "mixer": o.mixer, "init": o.init, "seed": o.seed,
            "attention_kept": p["keep"], "attention_layers": len(p["layers"]),
            "pattern": {"before": cfg.pattern, "after": new_cfg.pattern},
            "head_dim": {"before": cfg.attention.head_dim, "after": new_cfg.attention.head_dim},
            "params": {"before": count_params(cfg)["total"], "after": count_params(new_cfg)["total"]},
            "seconds": round(time.perf_counter() - t0, 3)}
