"""`remodel hybridize`: dense attention checkpoint -> hybrid checkpoint (upcycle.hybridize): the attention layers
not kept become linear-mixer layers initialised from their attention weights (or at random), the rest copied
exactly, written as a family transformers loads without remote code. Every input is checked on config.json
before the weights are read; the conversion streams layer by layer (upcycle.hybridize_stream: peak memory about
one layer), except that --select kl loads the model whole for its forwards.
With --data, two training stages by distill's trainer (pipelines.training: checkpoints, --resume, parallelism):
stage one (--transfer-steps) fits the new mixers alone, the rest frozen: by default (--transfer-target layer,
LoLCATs' attention transfer) each fed MODEL's own hidden state at its input and fitted to that attention layer's
output, so each layer is fitted alone; with stream, to MODEL's residual stream after every layer, the hybrid run
freely. Stage two (--steps) distils the whole hybrid from MODEL. The initialised hybrid is written to OUT.init,
stage one's result to OUT.transfer when stage two follows, the last stage's to OUT.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from remodel.models.errors import RemodelError
from remodel.models.layout import layer_of
from remodel.models.load import load_config, load_model, read_config_dict
from remodel.models.params import count_params
from remodel.upcycle.hybridize import INITS, HybridLayers, costliest, kept, kl_costs, replaceable, target
from remodel.upcycle.hybridize_stream import write_hybrid

from ..data.data import load_texts, pack
from ..distributed.runtime import load_tokenizer
from ..training.train import train
from ..training.train_config import make_config
from .configs import HybridizeOptions
from .hybridize_run import check_processes, kept_in, lead, on_lead
from .options import given, make


def _dtype(config: dict):
    """The checkpoint's own floating-point dtype (config.json), None where it names none."""
    name = config.get("dtype") or config.get("torch_dtype")
    t = getattr(torch, name, None) if isinstance(name, str) else None
    return t if isinstance(t, torch.dtype) and t.is_floating_point else None


def _training(o: HybridizeOptions, student: Path, folders: bool = True) -> dict | None:
    """distill's settings shared by both stages (checked here, before any work), None without --data; `folders`:
    refuse non-empty intermediate folders (False once measured: rank 0 may have written OUT.init)."""
    two = o.steps is not None or o.tokens is not None  # stage two's budget
    if o.steps is not None and o.tokens is not None:
        raise RemodelError("give one of --steps or --tokens as the distillation's budget, not both")
    if (two or o.transfer_steps) and o.data is None:
        raise RemodelError("--steps, --tokens and --transfer-steps need --data (the training text)")
    if o.data is not None and not two and not o.transfer_steps and o.select != "kl":
        raise RemodelError("--data needs --steps N or --tokens N (stage two), --transfer-steps N (stage one) or "
                           "--select kl (calibration)")
    if o.select == "kl" and (o.data is None or o.keep_attention is None):
        raise RemodelError("--select kl needs --keep-attention N and --data (its calibration text)")
    if not two and not o.transfer_steps:
        return None
    kw = dict(student_dir=str(student), teacher_dir=str(o.model), out=str(o.out), data=str(o.data),
              seq_len=o.seq_len, batch=o.batch, lr=o.lr, seed=o.seed, resume=o.resume, overwrite=o.overwrite)
    clash = sorted(set(o.train) & (set(kw) | {"steps", "tokens"}))
    if clash:  # the Python API's train dict: these are hybridize's own options (or its paths)
        raise RemodelError(f"train={{...}} sets {', '.join(clash)}: hybridize's own (give them by name) or its paths")
    kw.update(o.train)
    if o.transfer_steps and o.transfer_target == "layer" and kw.get("tp", 1) > 1:
        raise RemodelError("--transfer-target layer (teacher forcing) runs data parallel only (tp 1); "
                           "--transfer-target stream runs tensor parallel too")
    check_processes(kw.get("tp", 1), kw.get("ep", 1), o.batch)
    for d in [student] + ([Path(f"{o.out}.transfer")] if o.transfer_steps and two else []) if folders else []:
        if not (o.resume or o.overwrite) and d.is_dir() and any(d.iterdir()):
            raise RemodelError(f"{d}: an intermediate stage's folder exists and is not empty (pass --resume to go "
                               "on from it, or --overwrite to replace it)")
    return kw


def fitted(cfg, new_cfg, replaced: set) -> list[str]:
    """What stage one trains: the replaced layers' mixers, and the q/k norms the target family added to the kept
    attention layers (not an identity: upcycle.hybrid_target)."""
    names = [f"layers.{i}.mixer." for i in sorted(replaced)]
    if new_cfg.attention.qk_norm and not cfg.attention.qk_norm:
        names += [f"layers.{s.index}.mixer.{n}_norm." for s in new_cfg.slots if s.index not in replaced
                  and s.kind.section_name == "attention" for n in "qk"]
    return names


def _stages(o: HybridizeOptions, kw: dict | None, fit: list) -> list[tuple[str, dict]]:
    """The training runs in order, each reading the previous one's output and checked before any work:
    stage one (attention transfer: the parameters `fit` alone, hidden loss only; --transfer-target layer: their
    layers teacher-forced), stage two (distill)."""
    if kw is None:
        return []
    if o.transfer_target not in ("layer", "stream"):
        raise RemodelError(f"unknown --transfer-target {o.transfer_target!r} (supported: layer, stream)")
    runs = []
    if o.transfer_steps:
        forced = sorted({layer_of(n) for n in fit}) if o.transfer_target == "layer" else None
        runs.append(("transfer", dict(kw, steps=o.transfer_steps, kl_weight=0.0, lm_loss_weight=0.0,
                                      hidden_loss_weight=1.0, topk=None, train_only=fit, forced_layers=forced)))
    if o.steps is not None or o.tokens is not None:
        runs.append(("distillation", dict(kw, steps=o.steps, tokens=o.tokens)))
    for (_, a), (_, b) in zip(runs, runs[1:]):  # stage one writes OUT.transfer, read by stage two
        a["out"] = b["student_dir"] = f"{o.out}.transfer"
    for _, run in runs:
        make_config(**run)
    return runs


def _calibration(o: HybridizeOptions, cfg) -> torch.Tensor:
    """--select kl's token blocks [samples, seq_len] of --data, tokenized with MODEL's tokenizer (checked)."""
    if not Path(o.data).expanduser().exists():
        raise RemodelError(f"--data not found: {o.data}")
    blocks = pack(load_texts(o.data), load_tokenizer(Path(o.model), "MODEL"), o.seq_len,
                  max_tokens=o.samples * o.seq_len)
    if blocks.numel() == 0 or int(blocks.max()) >= cfg.vocab_size:
        raise RemodelError(f"--data gives no block of {o.seq_len} tokens, or ids beyond the model's vocabulary")
    return blocks


def plan(o: HybridizeOptions, keep: list | None = None) -> dict:
    """What the conversion will do, from config.json alone (one-line RemodelError for any bad input); `keep`:
    the attention layers kept when measured (--select kl), else from the flags."""
    if o.init not in INITS:
        raise RemodelError(f"unknown --init {o.init!r} (supported: {', '.join(INITS)})")
    training = _training(o, Path(f"{o.out}.init"), folders=keep is None)
    cfg = load_config(o.model)
    layers = replaceable(cfg, o.mixer)
    keep = kept(len(layers), o.keep_attention, o.keep_layers) if keep is None else keep
    replaced = {i for j, i in enumerate(layers) if j not in keep}
    family, new_cfg = target(cfg, o.mixer, replaced, o.to)
    fit = fitted(cfg, new_cfg, replaced)
    return {"cfg": cfg, "new_cfg": new_cfg, "family": family, "keep": keep, "replaced": replaced, "layers": layers,
            "training": _stages(o, training, fit), "fitted": fit, "init_dir": Path(f"{o.out}.init") if training else None}


def _convert(o: HybridizeOptions, p: dict) -> list | None:
    """Writes the initialised hybrid (OUT.init with training, else OUT); -> --select kl's measured costs."""
    dest = p["init_dir"] or Path(o.out)
    if p["init_dir"] and o.resume and (dest / "config.json").is_file():  # a resumed run keeps the hybrid it started from
        return None
    costs = None
    if o.select == "kl":  # measured on the model held whole (forwards); the conversion itself streams
        costs = kl_costs(load_model(o.model), o.mixer, _calibration(o, p["cfg"]), o.init, o.seed)
        p = plan(o, costliest(costs, o.keep_attention))
    conv = HybridLayers(p["cfg"], p["new_cfg"], o.mixer, p["replaced"], o.init, o.seed)
    write_hybrid(o.model, dest, conv, p["family"], dtype=_dtype(read_config_dict(o.model)), overwrite=o.overwrite)
    return costs


def hybridize(model_dir=None, out=None, opts: HybridizeOptions | None = None, **kw) -> dict:
    """Dense checkpoint at `model_dir` -> hybrid checkpoint at `out`; -> the report. The options are
    HybridizeOptions (pipelines/commands/configs.py), given as `opts` or by name."""
    t0 = time.perf_counter()
    o = make(HybridizeOptions, opts, **given(model=model_dir, out=out), **kw)
    if o.select is None:  # measured where it can be (issue 57: kl is the default)
        o = dataclasses.replace(o, select="kl" if o.data is not None and o.keep_attention else "even")
    p = plan(o)
    costs = on_lead(lambda: _convert(o, p), o.train.get("device", "auto"))  # under torchrun: rank 0 alone
    if costs is not None:
        p = plan(o, costliest(costs, o.keep_attention))
    elif o.select == "kl" and p["init_dir"]:  # resumed from OUT.init: the layers the first run measured
        p = plan(o, kept_in(p["init_dir"], p))
    trained = {stage: train(**run) for stage, run in p["training"]}
    if not lead():  # under torchrun rank 0 reports, as train does
        return None
    cfg, new_cfg = p["cfg"], p["new_cfg"]
    return {"command": "hybridize", "input": str(o.model), "output": str(o.out), "to": p["family"],
            **{stage: trained.get(stage) and {k: trained[stage].get(k) for k in ("steps", "tokens", "eval")
                                             if k in trained[stage]} for stage in ("transfer", "distillation")},
            "mixer": o.mixer, "init": o.init, "seed": o.seed,
            "attention_kept": p["keep"], "attention_layers": len(p["layers"]), "select": o.select,
            "kl_per_layer": costs, "transfer_trains": p["fitted"] if o.transfer_steps else None,
            "transfer_target": o.transfer_target if o.transfer_steps else None,
            "pattern": {"before": cfg.pattern, "after": new_cfg.pattern},
            "head_dim": {"before": cfg.attention.head_dim, "after": new_cfg.attention.head_dim},
            "params": {"before": count_params(cfg)["total"], "after": count_params(new_cfg)["total"]},
            "seconds": round(time.perf_counter() - t0, 3)}
