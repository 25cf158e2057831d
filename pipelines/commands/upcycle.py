"""`remodel upcycle`: dense HF checkpoint -> fine-grained MoE HF checkpoint, streamed layer by layer.

Reads the source one tensor at a time (iter_our_tensors), turns each dense MLP layer into router +
experts (+ shared expert) with upcycle.virtual_groups, and exports through iter_hf_tensors. Per
layer it holds the dense MLP and its G scaled shards; the N per-expert tensors are views of those,
written to the shard file as they come, so memory is about two dense MLPs (and the check's two).
On a second thread, upcycle.deviation measures the initial deviation (dense vs upcycled logits on
random tokens, and per upcycled layer MoE vs dense MLP outputs) from the streamed tensors, at most two
layer groups behind the writer; the figures go to OUT/remodel_report.json.
--drop-ratio R > 0 (upcycle.drop, Drop-Upcycling): the N experts of a layer become distinct tensors (E
dense MLPs of memory per layer) with round(R * expert size) neurons each re-initialised. The report
also gives the experts' similarity per layer (upcycle.similarity), and config.json records how the
experts were built (UPCYCLE_KEY) for the training run's figures.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

from remodel.models.checkpoint import CheckpointReader, CheckpointWriter, atomic_output_dir, cast_for_output
from remodel.models.errors import RemodelError
from remodel.models.kinds import KINDS, layer_kinds
from remodel.models.families import FAMILIES, UPCYCLE_TARGETS
from remodel.models.hf import check_exportable, config_from_hf, config_to_hf, weight_table
from remodel.models.families.tower import check_tower
from remodel.models.load import extra_hf_tensors, iter_hf_tensors, iter_our_tensors, passthrough_names
from remodel.upcycle.deviation import StreamCheck
from remodel.upcycle.drop import drop_count, drop_report
from remodel.upcycle.similarity import UPCYCLE_KEY, expert_similarity
from remodel.upcycle.virtual_groups import (ROUTER_MODES, drop_upcycle, layer_seed, make_plan, moe_config,
                                            router_std, router_weight, upcycle_mlp)

from .configs import UpcycleOptions
from .upcycle_defaults import default_router, default_top_k
from .options import given, make
from .report import write_report

# (random sequences, tokens each) of the deviation check: it is bound by casting and packing the weight
# blocks, hardly by the tokens (bench/RESULTS.md)
DEVIATION_TOKENS = (1, 16)


def _group(name: str) -> str:
    """'layers.7' for a layer's tensors, the name itself for top-level tensors."""
    return ".".join(name.split(".")[:2]) if name.startswith("layers.") else name


def _resolve(cfg, src_family: str, p_router: str | None, to: str | None, shared: int,
             exact: bool = False) -> tuple[str, str]:
    """(router, target family): the source family's defaults (the raw router README recommends, unless --exact),
    checked against what the target holds."""
    src = FAMILIES[src_family]
    router = p_router or default_router(src.upcycle_router(), exact)
    if router not in ROUTER_MODES:
        raise RemodelError(f"unknown router {router!r} (supported: {', '.join(ROUTER_MODES)})")
    to = to or src.upcycle_into(cfg, router, shared)
    if to not in UPCYCLE_TARGETS:
        raise RemodelError(f"unknown upcycling target {to!r} (supported: {', '.join(UPCYCLE_TARGETS)})")
    why = FAMILIES[to].upcycle_check(cfg, router)
    if why:
        raise RemodelError(why)
    return router, to


def _cast(name: str, t: torch.Tensor, dtype) -> torch.Tensor:
    """t in `dtype` when it is floating point (the sigmoid router's correction bias stays fp32)."""
    return cast_for_output(name, t, dtype)


def _check_finite(tensors: dict, model_dir):
    """One-line RemodelError naming a source tensor that holds NaN/inf (with the count): upcycling
    would copy them into every expert and the deviation check could only report NaN."""
    for name, t in tensors.items():
        if t.is_floating_point():
            bad = t.numel() - int(torch.isfinite(t).sum())
            if bad:
                raise RemodelError(f"{model_dir}: tensor {name!r} holds {bad} non-finite value(s) (NaN/inf) of "
                                   f"{t.numel()}; upcycling needs finite weights")


def _params(cfg) -> tuple[int, int]:
    """(total, active per token) parameter counts from the config (models.params, the MTP head included)."""
    from remodel.models.params import active_params, count_params
    c = count_params(cfg)
    return c["total"] + c["mtp"]["total"], active_params(cfg, with_mtp=True)


@contextlib.contextmanager
def _one_thread():
    """The work here is memory-bound copies and a 16-token check: one intra-op thread is as fast on an
    idle machine and avoids OpenMP barrier stalls on an oversubscribed one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def upcycle(model_dir=None, out=None, opts: UpcycleOptions | None = None, **kw) -> dict:
    """Dense checkpoint at `model_dir` -> MoE checkpoint at `out` (see module docstring); -> report. The options
    are UpcycleOptions (pipelines/commands/configs.py), given as `opts` or by name. exact=True puts the whole
    factor on down_proj (exact_placement) or refuses; dtype: the written floating-point dtype (a torch dtype or
    its name; default: the checkpoint's), the expert weights scaled in it; drop_ratio R > 0: Drop-Upcycling,
    round(R * expert size) neurons of every routed expert re-initialised (upcycle.drop)."""
    o = make(UpcycleOptions, opts, **given(model=model_dir, out=out), **kw)
    if isinstance(o.dtype, str):
        o = dataclasses.replace(o, dtype=getattr(torch, o.dtype))
    check_drop(o.drop_ratio, o.exact)
    with _one_thread():
        return _upcycle(o)


def check_drop(ratio, exact: bool):
    """One-line RemodelError, before anything is read: R outside [0, 1], or R > 0 with --exact."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise RemodelError(f"--drop-ratio must be in [0, 1] (the fraction of each expert's neurons "
                           f"re-initialised), got {ratio!r}")
    if exact and ratio > 0:
        raise RemodelError(f"--exact cannot be combined with --drop-ratio {ratio:g} > 0: drop-upcycling "
                           f"re-initialises neurons, so the MoE does not reproduce the dense model; drop one of them")


_MANTISSA = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def _source_dtype(reader) -> torch.dtype:
    """The dtype of the dense MLP weights (the widest floating dtype among the down projections)."""
    names = [k for k in reader.keys() if "down_proj" in k] or reader.keys()
    dts = {reader.dtype(k) for k in names if reader.dtype(k).is_floating_point}
    return max(dts, key=lambda d: _MANTISSA.get(d, 0)) if dts else torch.float32


def check_exact_dtype(p, src: torch.dtype, out: torch.dtype):
    """--exact: the written dtype must hold every source weight (the same dtype, or float32/64) and
    W2 x a must not round: a power-of-two a never does; an integer a fits when the written dtype has
    bit_length(a) more mantissa bits than the source's. One-line RemodelError otherwise."""
    name = str(out).replace("torch.", "")
    if out != src and (_MANTISSA.get(out, 0) < _MANTISSA.get(src, 99) or out in (torch.float16, torch.bfloat16)):
        raise RemodelError(f"--exact: --dtype {name} cannot hold every {str(src).replace('torch.', '')} weight "
                           f"exactly; use float32 or the checkpoint's own dtype")
    _, a = p.scales
    if a == 2 ** round(math.log2(a)):
        return
    if a == int(a) and _MANTISSA.get(out, 0) >= _MANTISSA.get(src, 99) + int(a).bit_length():
        return
    fix = "pass --dtype float32 or " if _MANTISSA.get(src, 99) + int(a).bit_length() <= 24 else ""
    raise RemodelError(f"--exact: scaling down_proj by a={a:g} (not a power of two) rounds in {name}; "
                       f"{fix}use a power-of-two --granularity, or drop --exact")


def _hf_config(reader, new_cfg, family: str, dtype) -> dict:
    """The written config.json: the MoE config, with the source's dtype (or the written one)."""
    hf_cfg = config_to_hf(new_cfg, family)
    for k in ("dtype", "torch_dtype"):
        if reader.config.get(k):
            hf_cfg[k] = reader.config[k]
    if dtype is not None:
        hf_cfg["dtype"] = str(dtype).replace("torch.", "")
        hf_cfg.pop("torch_dtype", None)
    return hf_cfg


class _LayerStream:
    """Serves the MoE checkpoint's tensors one layer group at a time: reads a group of the source,
    upcycles its dense MLP, and hands the group to the deviation check on the `pool` thread."""

    def __init__(self, reader, o: UpcycleOptions, cfg, new_cfg, p, src_family: str, family: str):
        self.cfg, self.new_cfg, self.p, self.src_family, self.family = cfg, new_cfg, p, src_family, family
        self.seed, self.dtype, self.model_dir, self.drop_ratio = o.seed, o.dtype, o.model, o.drop_ratio
        self.similarity = []
        stream = iter_our_tensors(reader, cfg, src_family)
        first = next(stream)  # checks every tensor's shape against the config before anything is written
        self.groups = itertools.groupby(itertools.chain([first], stream), key=lambda kv: _group(kv[0]))
        self.cache: dict = {}
        self.mlp_dtypes, self.logit_std, self.t_check, self.pending = set(), 0.0, 0.0, []
        self.check = StreamCheck(cfg, new_cfg, o.seed, *DEVIATION_TOKENS)
        self.pool = None

    def feed(self, key, source, moe):  # on the check's own thread; torch ops release the GIL
        t = time.perf_counter()
        self.check.feed(key, source, moe)
        self.t_check += time.perf_counter() - t

    def get(self, name):
        """Called once per our tensor of the MoE config, in table order, layer after layer."""
        while name not in self.cache:
            self.cache.clear()
            self._next_group()
        return self.cache.pop(name)

    def _next_group(self):
        key, items = next(self.groups)
        tensors = dict(items)
        _check_finite(tensors, self.model_dir)
        source, moe = dict(tensors), None
        if self.dtype is not None:  # scaled in the written dtype: rounded once
            tensors = {k: _cast(k, v, self.dtype) for k, v in tensors.items()}
        if key.startswith("layers.") and KINDS[self.cfg.pattern[int(key.split(".")[1])]].upcycles_to:
            moe = self._upcycle_layer(key, tensors)
        # the check runs beside the conversion and the writes, at most two groups behind (memory)
        while len(self.pending) >= 2:
            self.pending.pop(0).result()
        self.pending.append(self.pool.submit(self.feed, key, source, moe))
        self.cache.update(tensors)

    def _upcycle_layer(self, key: str, tensors: dict) -> dict:
        """Replaces the dense MLP of `tensors` (layer `key`) by router + experts, in place; -> the MoE tensors."""
        p, m = self.p, f"{key}.mixer."
        # router logit std at init ~ init std * |norm weight| (the MoE input is RMS-normalised)
        std = router_std(p.router, self.cfg.hidden_size)
        self.logit_std = max(self.logit_std, std * tensors[f"{key}.norm.weight"].float().norm().item())
        self.mlp_dtypes.add(str(tensors[m + "up_proj.weight"].dtype).replace("torch.", ""))
        layer = int(key.split(".")[1])
        r = router_weight(p, self.cfg.hidden_size, layer_seed(self.seed, layer))
        up, down, gate = (tensors.pop(m + n, None) for n in ("up_proj.weight", "down_proj.weight", "gate_proj.weight"))
        moe = drop_upcycle(upcycle_mlp(p, up, down, gate, r, self.family), up, down, gate, self.drop_ratio,
                           self.seed, layer)
        sim = expert_similarity([moe.get(f"experts.{n}") for n in ("up_proj", "gate_proj", "down_proj")],
                                p.granularity)
        self.similarity.append({"layer": layer, **sim})
        tensors.update((m + k, v) for k, v in moe.items())
        return moe

    def deviation(self) -> dict:
        """The check's figures, once every group was written (re-raises a failure of the check)."""
        for f in self.pending:
            f.result()
        if self.check.result is None:
            raise RemodelError(f"internal: the deviation check did not see every tensor group ({self.check.todo[:1]})")
        return self.check.result


def _notes(p, kind: str, mlp_dtypes: set, dtype, logit_std: float) -> list[str]:
    """Warnings for the report: kernel strides, rounding of non-power-of-2 scales, saturated sigmoid scores."""
    notes = []
    if p.expert_size % 8:
        notes.append(f"expert size {p.expert_size} is not a multiple of 8: transformers' default grouped_mm "
                     f"experts kernel needs 16-byte strides; load with experts_implementation='eager'")
    low = sorted(mlp_dtypes - {"float32", "float64"})
    if dtype is not None:
        low = sorted({str(dtype).replace("torch.", "")} - {"float32", "float64"})
    odd = [f for f in p.scales if f != 2 ** round(math.log2(f))]
    if low and odd:
        notes.append(f"expert weights were scaled by {odd[0]:.4g} (not a power of 2) in {', '.join(low)}: "
                     f"expect deviations at that precision even where the method is exact")
    if kind == "sigmoid" and 6 * logit_std > 16.0:
        notes.append(f"router logits at init have std ~{logit_std:.3g}: sigmoid scores saturate to exactly 1.0 "
                     f"above ~16.6 in fp32, and top-k may split exactly tied groups there")
    return notes


def _method_report(p, router: str, family: str, seed: int, logit_std: float, init_std: float) -> dict:
    """The report's description of the router and the expert scaling."""
    kind, norm = ROUTER_MODES[router]
    return {
        "router": {"mode": router, "type": kind, "norm_topk_prob": norm, "routed_scaling_factor": 1.0,
                   "correction_bias": "zero" if kind == "sigmoid" else None, "init_std": init_std, "seed": seed,
                   "logit_std_estimate": round(logit_std, 6)},
        "scaling": {"a": p.a, "s": p.s, "placement": p.placement, "w1_scale": p.scales[0],
                    "w2_scale": p.scales[1],
                    "applied_to": "W1 (gate and up) and W2 of every routed expert" if p.placement == "balanced"
                    else "W2 (down) of every routed expert, the whole factor a (--exact)",
                    "shared_expert": "unscaled" + (f", down_proj x2 with a zero sigmoid gate ({family})"
                                                   if FAMILIES[family].shared_expert_gate and p.shared else "")},
    }


def _upcycle(o: UpcycleOptions) -> dict:
    t0 = time.perf_counter()
    model_dir, dtype, exact = o.model, o.dtype, o.exact
    reader = CheckpointReader(model_dir)
    src_family = reader.config.get("model_type")
    cfg = config_from_hf(reader.config)
    router, family = _resolve(cfg, src_family, o.router, o.to, o.shared_expert_size, exact)
    top_k = o.top_k if o.top_k is not None else default_top_k(o.experts, o.granularity)
    p = make_plan(cfg, o.experts, o.granularity, top_k, o.shared_expert_size, router,
                  "down" if exact else "balanced")
    if exact and not p.exact:
        raise RemodelError(f"--exact: {p.why_not_exact[0]}; change that or drop --exact")
    src_dtype = _source_dtype(reader)
    if exact:
        check_exact_dtype(p, src_dtype, dtype or src_dtype)
    new_cfg = moe_config(cfg, p, family)
    check_exportable(new_cfg, family)
    hf_cfg = _hf_config(reader, new_cfg, family, dtype)
    hf_cfg[UPCYCLE_KEY] = {"experts": p.experts, "granularity": p.granularity, "expert_shard": "e mod granularity",
                           "drop_ratio": o.drop_ratio, "seed": o.seed}  # read by training's expert-similarity figures
    check_tower(reader, cfg, family)  # a vision tower passed through: as transformers builds it, finite
    layers = _LayerStream(reader, o, cfg, new_cfg, p, src_family, family)
    n_out = len(weight_table(new_cfg, family)) + len(extra_hf_tensors(new_cfg, family)) + len(passthrough_names(reader, family))
    with atomic_output_dir(o.out, overwrite=o.overwrite, inputs=[model_dir]) as tmp, \
            ThreadPoolExecutor(1, thread_name_prefix="deviation-check") as layers.pool:
        w = CheckpointWriter(tmp)
        for hf, t in tqdm(iter_hf_tensors(layers.get, new_cfg, family, source=reader), total=n_out, desc="upcycle",
                          unit="tensor"):
            w.add(hf, t if dtype is None else _cast(hf, t, dtype))
        w.close(hf_cfg, aux_from=model_dir)
        t_write = time.perf_counter() - t0
        deviation = layers.deviation()
        report = _report(o, layers, src_dtype)
        report.update({"deviation": deviation, "tensors_written": n_out, "bytes_written": w.total_size,
                       "seconds": {"upcycle_and_write": round(t_write, 3),
                                   "deviation_check_overlapped": round(layers.t_check, 3),
                                   "total": round(time.perf_counter() - t0, 3)}})
        write_report(tmp, report)
    reader.close()
    return report


def _report(o: UpcycleOptions, layers: _LayerStream, src_dtype) -> dict:
    """The report's figures known once every layer was upcycled (the deviation and timings come after)."""
    cfg, new_cfg, p, family, router = layers.cfg, layers.new_cfg, layers.p, layers.family, layers.p.router
    seed, dtype, drop_ratio = o.seed, o.dtype, o.drop_ratio
    moe_total, moe_active = _params(new_cfg)
    dropped = drop_count(drop_ratio, p.expert_size) > 0
    why = p.why_not_exact + (["drop-upcycling re-initialised neurons of every routed expert"] if dropped else [])
    return {
        "command": "upcycle", "input": str(o.model), "output": str(o.out), "from": layers.src_family, "to": family,
        "method": "virtual-group upcycling (arXiv 2410.07524): expert e = dense shard e mod G, router rows "
                  "tied per group, W1 and W2 of every routed expert scaled by s = a^(1/d)"
                  + ("; then Drop-Upcycling (arXiv 2502.19261)" if dropped else ""),
        "experts": p.experts, "granularity": p.granularity, "expansion": p.expansion, "top_k": p.top_k,
        "shared_expert_size": p.shared, "expert_size": p.expert_size, "dense_intermediate_size": p.ffn,
        "activation": ("gated " if p.gated else "") + p.act, "dtype": sorted(layers.mlp_dtypes),
        "written_dtype": str(dtype or src_dtype).replace("torch.", ""),
        **_method_report(p, router, family, seed, layers.logit_std, router_std(router, cfg.hidden_size)),
        "drop_upcycling": drop_report(drop_ratio, p.expert_size, seed),
        "exact_expected": p.exact and not dropped, "why_not_exact": why, "exact_requested": o.exact,
        "layers_upcycled": [i for i, k in enumerate(layer_kinds(cfg)) if k.upcycles_to],
        "pattern": {"before": cfg.pattern, "after": new_cfg.pattern},
        "params": {"dense": _params(cfg)[0], "moe_total": moe_total, "moe_active": moe_active},
        "expert_similarity": {"layers": layers.similarity,
                              "method": "mean pairwise cosine of the routed experts' flattened weights (up, gate, "
                                        "down): same_shard over the pairs e = e' mod G built from one dense shard "
                                        "(1.0 for naive copies), all_pairs over every pair"},
        "notes": _notes(p, ROUTER_MODES[router][0], layers.mlp_dtypes, dtype, layers.logit_std),
    }
