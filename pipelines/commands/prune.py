"""`remodel prune`: cached scores (or a fresh scoring run) -> structurally pruned HF checkpoint.

Streams: tensors are read, sliced and handed to the writer one at a time (one fused expert stack at
most) and written to the shard file as they come, so peak memory is about the largest tensor,
whatever the model size.
Targets are checked before anything is read or computed. When scores are computed here (--data),
they are kept in OUT/scores so that pruning to another target can reuse them (--scores OUT/scores).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from tqdm import tqdm

from remodel.compress.prune import (depth_metric, kept_layers, layer_units, new_config, plan_keep, prune_tensor, rename,
                            validate_targets)
from remodel.compress.axes import tensor_axes
from remodel.compress.scores import load_scores
from remodel.models.checkpoint import (CheckpointReader, CheckpointWriter, atomic_output_dir, cast_for_output,
                                       output_format)
from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.families.tower import check_tower
from remodel.models.hf import config_from_hf, config_to_hf, our_shapes, weight_table
from remodel.models.kinds import KINDS, used
from remodel.models.load import iter_hf_tensors, iter_our_tensors
from remodel.models.params import count_params

from .configs import PruneOptions
from .options import given, make
from .plots import plot_importance
from .report import write_report

def check_scores_match(cfg: ModelConfig, meta: dict, where) -> None:
    try:
        theirs = ModelConfig.from_dict(meta.get("config") or {})
    except (RemodelError, TypeError) as e:
        raise RemodelError(f"{where}: scores.json has no usable model config ({e})".splitlines()[0]) from None
    if our_shapes(theirs) != our_shapes(cfg):  # same tensors, same shapes: the scores fit (extra etc. aside)
        a, b = theirs.flat(), cfg.flat()  # field names, not the sections holding them
        diff = [k for k in b if k != "extra" and a.get(k) != b[k]]
        raise RemodelError(f"{where}: scores were computed for a different model (differs in {', '.join(diff[:4])}); "
                           f"re-run `remodel score` on this model")


def _params(cfg: ModelConfig, family: str) -> dict:
    c = count_params(cfg, family)
    return {"total": c["total"], "active": c["active"], "by_type": c["by_type"]}


def _kept_report(cfg: ModelConfig, keep: dict) -> dict:
    full = {"hidden": cfg.hidden_size, "layers": cfg.num_layers,  # and each kind's units (its spec)
            **{unit: cfg.get(field, k.section_name) for k in KINDS.values() for unit, field in k.units.items()},
            **{a: k.axis_size(cfg.view(k), a) for k in used(cfg) for a in k.hidden_units}}  # sized by hidden (Mamba-1, LFM2)
    return {k: {"size": int(v.shape[-1]), "of": full[k.rsplit(".", 1)[-1]], "indices": v.tolist()}
            for k, v in keep.items()}


def prune(model_dir=None, out=None, scores_dir=None, data=None, opts: PruneOptions | None = None, **kw) -> dict:
    """Prune the HF checkpoint `model_dir` into `out` (same family). -> the report dict.
    The options are PruneOptions (pipelines/commands/configs.py), given as `opts` or by name: a width's name
    (ffn_size=...) is a target, a keyword of `score` configures the --data scoring run, any other name is refused.
    tasks: lm-eval task names (pipelines/training/tasks.py) run on the result, in the report as `tasks`."""
    return _prune(make(PruneOptions, opts, **given(model=model_dir, out=out, scores=scores_dir, data=data),
                       **_score_keywords(kw)))


def _prune(o: PruneOptions) -> dict:
    t0 = time.time()
    model_dir, out, scores_dir, data, task_limit = o.model, o.out, o.scores, o.data, o.task_limit
    reader = CheckpointReader(model_dir)
    family = reader.config.get("model_type")
    cfg = config_from_hf(reader.config)
    # every width target of the options, whatever path follows: validate_targets refuses one it does not know
    t, want = _targets(o, cfg, family)
    from ..training.tasks import add_tasks, check_task_options  # (lm-eval is imported only when asked for)
    checked = check_task_options(o.tasks, o.task_dir, task_limit, o.trust_task_code)  # before any work
    if scores_dir is None and data is None and o.plan is None:
        raise RemodelError("prune needs importance scores: pass --scores SCORES (from `remodel score`) or --data DATA")
    _check_attention(cfg, _dropped_pattern(cfg, family, t.get("drop_layers")), o.allow_attention_free)
    if scores_dir is not None:
        scores, meta = _checked_scores(cfg, scores_dir)
        t = _placed(o, cfg, family, scores, t)
        keep, new, hf_cfg = _plan(cfg, reader.config, scores, t, family)
        _check_attention(cfg, new.pattern, o.allow_attention_free)  # before anything is written
    check_tower(reader, cfg, family)  # a vision tower passed through: as transformers builds it, finite
    with reader, atomic_output_dir(out, overwrite=o.overwrite, inputs=[model_dir]) as tmp:
        if scores_dir is None:
            from .score import score
            how = o.score if data is not None else {"method": "magnitude"}  # --plan alone: data-free scores
            score(model_dir, data, tmp / "scores", **how)  # kept as OUT/scores for re-pruning
            scores, meta = _checked_scores(cfg, tmp / "scores")
            scores_dir = Path(out) / "scores"
            t = _placed(o, cfg, family, scores, t) if data is not None else t
            keep, new, hf_cfg = _plan(cfg, reader.config, scores, t, family)
            _check_attention(cfg, new.pattern, o.allow_attention_free)  # OUT's temporary folder is removed
        if want is not None and count_params(new, family)["total"] != want:  # never: the plan's own arithmetic
            raise RemodelError(f"internal: --plan row has {want:,} parameters, the pruned shape "
                               f"{count_params(new, family)['total']:,}")
        dtype = getattr(torch, o.dtype) if o.dtype else None
        w = CheckpointWriter(tmp, max_shard_bytes=o.max_shard_bytes, fmt=output_format(reader, dtype))
        n = _write_tensors(w, reader, cfg, family, keep, new, dtype)
        w.close(_with_dtype(hf_cfg, o.dtype), aux_from=model_dir)
        kept = kept_layers(cfg, keep)
        dropped = [i for i in range(cfg.num_layers) if i not in set(kept)]
        plotted = plot_importance(tmp / "importance.png", cfg.pattern, scores, dropped)
        report = {
            "command": "prune", "input": str(model_dir), "output": str(out), "scores": str(scores_dir),
            "family": family, "targets": t, "plan": _plan_ref(o),
            "pattern_before": cfg.pattern, "pattern_after": new.pattern,
            "dropped_layers": dropped,
            "dropped_family_layers": [j for j, u in enumerate(layer_units(cfg, family)) if u[0] in dropped],
            "depth_metric": depth_metric(scores) if "num_layers" in t else None,
            "config_before": cfg.to_dict(), "config_after": new.to_dict(),
            "params_before": _params(cfg, family), "params_after": _params(new, family),
            "kept": _kept_report(cfg, keep),
            "layer_importance": {m: scores[m].tolist() for m in ("block_importance", "loss_increase") if m in scores},
            "plot": "importance.png" if plotted else None,
            "scores_meta": {k: v for k, v in meta.items() if k != "config"},
            "tensors_written": n, "bytes_written": w.total_size, "seconds": round(time.time() - t0, 3)}
        write_report(tmp, add_tasks(report, tmp, checked, task_limit, source=model_dir))  # accuracy before / after
    return report


def _targets(o: PruneOptions, cfg: ModelConfig, family: str) -> tuple[dict, int | None]:
    """(validated targets, the --plan row's parameter count or None): the flags' targets, or --plan's candidate."""
    if o.plan is None:
        return validate_targets(cfg, {**o.widths, "num_layers": o.num_layers, "drop_layers": o.drop_layers},
                                family), None
    given_too = [f"--{k.replace('_', '-')}" for k, v in {**o.widths, "num_layers": o.num_layers,
                                                           "drop_layers": o.drop_layers}.items() if v is not None]
    if given_too:
        raise RemodelError(f"--plan sets the whole shape; drop {', '.join(given_too)}")
    from .plan_file import plan_targets
    row = plan_targets(o.plan, o.candidate, cfg, family)
    want = row.pop("params")
    return validate_targets(cfg, row, family), want


def _placed(o: PruneOptions, cfg: ModelConfig, family: str, scores: dict, t: dict) -> dict:
    """--plan's layer choice re-placed by SCORES (the least important of each type, as plan places them)."""
    if o.plan is None or not t.get("drop_layers"):
        return t
    from .plan_file import place_by_scores
    s = scores[depth_metric(scores)].double().tolist()
    unit_scores = [sum(s[i] for i in u) for u in layer_units(cfg, family)]
    return {**t, "drop_layers": place_by_scores(cfg, family, t["drop_layers"], unit_scores)}


def _plan_ref(o: PruneOptions) -> dict | None:
    return {"file": str(o.plan), "candidate": o.candidate} if o.plan is not None else None


ATTENTION_CHARS = frozenset(k.char for k in KINDS.values() if "attn_heads" in k.widths)  # '*', 'A', 'P'


def _dropped_pattern(cfg: ModelConfig, family: str, drop) -> str | None:
    """The pattern after --drop-layers (unit indices), or None without it."""
    if not drop:
        return None
    gone = {i for j, u in enumerate(layer_units(cfg, family)) if j in set(drop) for i in u}
    return "".join(c for i, c in enumerate(cfg.pattern) if i not in gone)


def _check_attention(cfg: ModelConfig, pattern: str | None, allowed: bool) -> None:
    """Refuses a depth cut that removes every attention layer of a model that has some (transformers' hybrid
    caches and long-context recall both need one), unless --allow-attention-free."""
    if allowed or pattern is None or not ATTENTION_CHARS & set(cfg.pattern) or ATTENTION_CHARS & set(pattern):
        return
    n = sum(c in ATTENTION_CHARS for c in cfg.pattern)
    raise RemodelError(f"this depth cut removes all {n} attention layer(s) ({cfg.pattern} -> {pattern}); keep more "
                       "layers (--num-layers / --drop-layers) or pass --allow-attention-free to accept it")


def _score_keywords(kw: dict) -> dict:
    """prune's keywords with those of `score` (samples, seq_len, ...: the --data scoring run) gathered into `score`;
    the rest stay for PruneOptions, which refuses an unknown name in one line (on the --scores path too)."""
    from .configs import ScoreOptions
    known = set(ScoreOptions.__dataclass_fields__) - set(PruneOptions.__dataclass_fields__)
    rest = {k: v for k, v in kw.items() if k not in known}
    return {**rest, "score": {k: v for k, v in kw.items() if k in known}} if known & set(kw) else rest


def _checked_scores(cfg: ModelConfig, scores_dir) -> tuple[dict, dict]:
    """-> (score tensors, scores.json) of SCORES, refused when they were computed for another model."""
    scores, meta = load_scores(scores_dir)
    check_scores_match(cfg, meta, scores_dir)
    return scores, meta


def _plan(cfg: ModelConfig, src_hf: dict, scores: dict, targets: dict, family: str):
    """-> keep, pruned config, its HF config (refusals here still write nothing)."""
    keep = plan_keep(cfg, scores, targets, family)
    new = new_config(cfg, keep)
    hf_cfg = config_to_hf(new, family)
    for k in ("dtype", "torch_dtype"):
        if src_hf.get(k) is not None:
            hf_cfg[k] = src_hf[k]
    return keep, new, hf_cfg


def _with_dtype(hf_cfg: dict, dtype: str | None) -> dict:
    """The output's config.json with --dtype's name as its dtype (torch_dtype too where the source has it)."""
    if dtype is None:
        return hf_cfg
    return {**hf_cfg, "dtype": dtype, **({"torch_dtype": dtype} if "torch_dtype" in hf_cfg else {})}


def _write_tensors(w: CheckpointWriter, reader, cfg: ModelConfig, family: str, keep: dict, new: ModelConfig,
                   dtype=None) -> int:
    """Streams every kept tensor, sliced (cast to `dtype` if given), from `reader` to `w`; -> the number written."""
    table = tensor_axes(cfg)
    old_names = [n for n in table if rename(n, keep) is not None]
    stream = iter_our_tensors(reader, cfg, family, names=set(old_names))  # checks every shape first

    def get(new_name):  # iter_hf_tensors asks in table order, which is the old order renumbered
        old, tensor = next(stream)
        if rename(old, keep) != new_name:
            raise RemodelError(f"internal: tensor order mismatch ({old} -> {rename(old, keep)} != {new_name})")
        return prune_tensor(old, tensor, cfg, keep, table)

    n = 0
    for name, tensor in tqdm(iter_hf_tensors(get, new, family, source=reader), desc="prune", unit="tensor",
                             total=len(weight_table(new, family)), leave=False):
        w.add(name, cast_for_output(name, tensor, dtype))
        n += 1
    return n
