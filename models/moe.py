"""The mixture-of-experts layer kind ('E', LatentMoE included): router, fused experts, shared expert,
and its spec (MOE).

Experts are stored fused, [E, F, L] per projection, and dispatched dropless: tokens are sorted by
expert and each expert runs once on exactly the tokens routed to it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from .mlp import ACT, ACTIVATIONS, MLP, ffn_magnitude, gated_act
from .recompute import maybe_checkpoint
from .section import MAX_SMALL, MAX_WIDTH, Section, ints, plain, reals
from .spec import LayerKind, Param, Width, mlp_params, sq, top, top_per_group

ROUTERS = ("sigmoid", "softmax")
MOE_ALIGN = 8  # expert rows (expert FFN, what experts read) in multiples of this: transformers' grouped_mm


@dataclass(frozen=True)
class MoEConfig(Section):
    """The MoE kind's fields: routed experts (top-k of E, grouped top-k with n_group > 1: DeepSeek-V3),
    whose FFNs take `moe_act` and are gated when `moe_gated` (its own; a config without them takes the MLP
    section's mlp_act / mlp_gated), a shared expert (0: none;
    shared_expert_gate scales it by sigmoid(w.x), Qwen2-MoE) and a LatentMoE latent (None: none)."""
    n_routed_experts: int = ints(0, 0, MAX_SMALL, raw={"n_routed_experts": 1, "num_experts": 1,
                                                                "num_local_experts": 0})  # 0 experts: dense
    num_experts_per_tok: int = ints(0, 0, MAX_SMALL, raw={"num_experts_per_tok": 1})
    moe_intermediate_size: int = ints(0, 0, MAX_WIDTH, raw={"moe_intermediate_size": 1})
    moe_shared_expert_intermediate_size: int = ints(0, 0, MAX_WIDTH, raw={
        "moe_shared_expert_intermediate_size": 0, "shared_expert_intermediate_size": 0, "shared_intermediate_size": 1})
    moe_latent_size: int | None = ints(None, 1, MAX_WIDTH, none_ok=True, raw={"moe_latent_size": 1})
    router: str = plain("sigmoid", "sigmoid (Nemotron-H / DeepSeek-V3) or softmax (Mixtral / Qwen)")
    norm_topk_prob: bool = plain(True)
    routed_scaling_factor: float = reals(1.0, gt=0, raw=("routed_scaling_factor",))
    n_group: int = ints(1, 1, MAX_SMALL, raw={"n_group": 1})
    topk_group: int = ints(1, 1, MAX_SMALL, raw={"topk_group": 1})
    shared_expert_gate: bool = plain(False)
    topk_norm_eps: float = reals(1e-20, gt=0, lt=1, variant="topk_norm_eps",
                                 doc="added to the sigmoid top-k weights' sum before renormalising (LFM2-MoE: 1e-6)")
    router_bias: bool = plain(False, "the router's logits have a bias per expert (gpt-oss)", variant="router_bias")
    expert_bias: bool = plain(False, "each expert's up / gate / down projections have biases (gpt-oss)",
                              variant="expert_bias")
    swiglu_alpha: float | None = reals(None, gt=0, variant="clamped_swiglu",
                                       doc="clamped SwiGLU of the experts (gpt-oss): gate * sigmoid(alpha * gate) * (up + 1)")
    swiglu_limit: float | None = reals(None, gt=0, variant="clamped_swiglu",
                                       doc="the clamp of that SwiGLU: gate <= limit, -limit <= up <= limit")
    moe_act: str | None = plain(None, "the experts' and the shared expert's activation (None: the MLP's)",
                                default_from="mlp.mlp_act")
    moe_gated: bool | None = plain(None, "the experts and the shared expert are gated (None: as the MLP)",
                                   default_from="mlp.mlp_gated")


def router_probs(logits: torch.Tensor, router: str) -> torch.Tensor:
    """Per-token routing distribution [T, E] of a router variant (the aux losses and the routing metrics
    read it): softmax, or sigmoid scores normalised to sum 1."""
    logits = logits.float()
    if router == "softmax":
        return logits.softmax(-1)
    if router == "sigmoid":
        s = logits.sigmoid()
        return s / (s.sum(-1, keepdim=True) + 1e-20)
    raise ValueError(f"unknown router kind {router!r}")


def wide(t: torch.Tensor) -> torch.Tensor:
    """t in fp32, or as it is when already wider (a float64 model routes and sums its experts in float64)."""
    return t if t.dtype == torch.float64 else t.float()


class Router(nn.Module):
    """sigmoid: Nemotron-H / DeepSeek-V3 (select on score + correction bias, optional expert groups,
    weight with the unbiased score). softmax: Mixtral / Qwen (softmax over all, keep top-k).
    Both: optional renormalisation of the kept weights, then routed_scaling_factor."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.moe.n_routed_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(cfg.moe.n_routed_experts)) if cfg.moe.router_bias else None
        if cfg.moe.router == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.moe.n_routed_experts, dtype=torch.float32))

    def forward(self, x):
        """x [T, H] -> (logits [T, E] fp32, weights [T, k] fp32, indices [T, k]); fp64 stays fp64."""
        cfg = self.cfg
        logits = F.linear(wide(x), wide(self.weight), None if self.bias is None else wide(self.bias))
        k = cfg.moe.num_experts_per_tok
        if cfg.moe.router == "sigmoid":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            if cfg.moe.n_group > 1:
                E, G = cfg.moe.n_routed_experts, cfg.moe.n_group
                group = choice.view(choice.shape[0], G, E // G).topk(2, dim=-1)[0].sum(-1)
                top_groups = group.topk(cfg.moe.topk_group, dim=-1, sorted=False)[1]
                gmask = torch.zeros_like(group).scatter_(1, top_groups, 1.0).bool()
                choice = choice.masked_fill(~gmask.repeat_interleave(E // G, dim=1), float("-inf"))
            idx = choice.topk(k, dim=-1, sorted=False)[1]
            w = scores.gather(1, idx)
            if cfg.moe.norm_topk_prob:
                w = w / (w.sum(-1, keepdim=True) + cfg.moe.topk_norm_eps)
        else:
            probs = logits.softmax(-1)
            w, idx = probs.topk(k, dim=-1)
            if cfg.moe.norm_topk_prob:
                w = w / w.sum(-1, keepdim=True)
        return logits, w * cfg.moe.routed_scaling_factor, idx


# F.grouped_mm (torch >= 2.10; CPU and CUDA), else the private op it wraps (CUDA bf16 since torch 2.8)
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
GROUPED = GROUPED_MM is not None  # the grouped expert path (the loop where it is off or the shapes refuse)


def grouped_ok(rows, ffn: int) -> bool:
    """Whether F.grouped_mm takes these rows and expert width: rows of 16-byte multiples on both sides of
    the experts (the kernel's stride rule), fp32 / bf16 on CPU, bf16 on CUDA."""
    size = rows.element_size()
    dtypes = (torch.bfloat16,) if rows.is_cuda else (torch.float32, torch.bfloat16)
    kernel = GROUPED and (rows.is_cuda or hasattr(F, "grouped_mm"))  # torch._grouped_mm is CUDA-only
    return kernel and rows.dtype in dtypes and (rows.shape[-1] * size) % 16 == 0 and (ffn * size) % 16 == 0


class ExpertLinear(torch.autograd.Function):
    """rows @ W_e^T for each expert's run of rows (offs: the runs' ends), W [E, out, in] cast to the rows'
    dtype. Its weight gradient is computed in W's own layout (dy^T x per expert: [E, out, in], contiguous),
    so it reaches an fp32 parameter by one contiguous cast; autograd's grouped_mm backward gives it as a
    transposed view, and accumulating that into .grad was a strided copy per expert weight (5.4 ms each,
    the Nano window's 128 x 1856 x 2688, on an H200: bench/gpu_profile_nano_ours.txt)."""

    @staticmethod
    def forward(ctx, rows, w, offs):
        wc = w.to(rows.dtype)
        ctx.save_for_backward(rows, wc, offs)
        ctx.w_dtype = w.dtype
        return GROUPED_MM(rows, wc.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, dy):
        rows, wc, offs = ctx.saved_tensors
        dy = dy.contiguous()  # e.g. sum()'s expanded gradient: the kernel takes real strides only
        d_rows = GROUPED_MM(dy, wc, offs=offs) if ctx.needs_input_grad[0] else None
        d_w = GROUPED_MM(dy.transpose(-2, -1), rows, offs=offs).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return d_rows, d_w, None


def autocast_rows(rows):
    """Rows in the autocast dtype when autocast is on (as F.linear would cast them): a bf16 training step with
    fp32 master weights then takes the grouped kernel too, not the loop."""
    dev = rows.device.type
    if torch.is_autocast_enabled(dev) and rows.is_floating_point():
        return rows.to(torch.get_autocast_dtype(dev))
    return rows


def expert_counts(flat, n: int):
    """Rows per expert [n] (int64) without a host sync: CUDA's bincount reads the max id back to size its output."""
    return flat.new_zeros(n).index_add_(0, flat, torch.ones_like(flat))


def clamped_glu(alpha: float, limit: float, h, gate):
    """gpt-oss's expert activation: gate clamped above, up (h) both sides, gate * sigmoid(alpha * gate) * (up + 1)."""
    gate, h = gate.clamp(max=limit), h.clamp(-limit, limit)
    return (h + 1) * (gate * torch.sigmoid(gate * alpha))


def _no_biases(experts, e):
    return None, None, None


def _expert_biases(experts, e):
    """expert_bias: expert e's (up, gate or None, down) biases (through the exchange, as the weights: EP scales
    their gradients)."""
    b = (experts.up_proj_bias, experts.gate_proj_bias, experts.down_proj_bias)
    ub, gb, db = b if experts.exchange is None else experts.exchange.weights(b)
    return ub[e], None if gb is None else gb[e], db[e]


class Experts(nn.Module):
    """The routed experts, fused [E, ...] per projection, with one dropless dispatch. Expert parallelism
    plugs in as `exchange` (set from outside, pipelines.distributed.parallel.ExpertExchange): it moves
    the sorted rows to the rank holding their expert and back; the arithmetic stays this class's."""
    recompute_core = False  # models.recompute "selective": each expert's activation + down recomputed
    exchange = None

    def __init__(self, cfg):
        super().__init__()
        E, Fm, L = cfg.moe.n_routed_experts, cfg.moe.moe_intermediate_size, cfg.moe_input_size
        self.act = ACT[cfg.moe.moe_act]
        self.up_proj = nn.Parameter(torch.empty(E, Fm, L))
        self.gate_proj = nn.Parameter(torch.empty(E, Fm, L)) if cfg.moe.moe_gated else None
        self.down_proj = nn.Parameter(torch.empty(E, L, Fm))
        if cfg.moe.expert_bias:  # the variant parts, chosen here: biases, the clamped SwiGLU
            self.up_proj_bias = nn.Parameter(torch.zeros(E, Fm))
            self.gate_proj_bias = nn.Parameter(torch.zeros(E, Fm)) if cfg.moe.moe_gated else None
            self.down_proj_bias = nn.Parameter(torch.zeros(E, L))
        self.biases = _expert_biases if cfg.moe.expert_bias else _no_biases
        clamped = cfg.moe.swiglu_limit is not None
        self.glu = partial(clamped_glu, cfg.moe.swiglu_alpha, cfg.moe.swiglu_limit) if clamped else partial(gated_act, self.act)
        self.fused = not (clamped or cfg.moe.expert_bias)  # the grouped-matmul path computes the plain experts only
        self._expert_hooks: OrderedDict = OrderedDict()  # torch's hook handles need a weak-referable dict

    def register_expert_hook(self, hook) -> RemovableHandle:
        """hook(experts, e, h, y) after expert e ran in the dispatch: h the activation entering its down
        projection, y its output (importance scoring reads them). -> a handle whose remove() detaches it."""
        handle = RemovableHandle(self._expert_hooks)
        self._expert_hooks[handle.id] = hook
        return handle

    def weights(self) -> tuple:
        """(up, gate or None, down) as the dispatch uses them (the exchange may scale their gradients)."""
        w = (self.up_proj, self.gate_proj, self.down_proj)
        return w if self.exchange is None else self.exchange.weights(w)

    def expert(self, e: int, x, w: tuple | None = None):
        """Expert e on rows x [n, L] -> [n, L]."""
        up, gate, down = w or (self.up_proj, self.gate_proj, self.down_proj)
        ub, gb, db = self.biases(self, e)
        h = F.linear(x, up[e], ub)
        if gate is None:
            return maybe_checkpoint(self, self._act_down, down[e], db, h)
        return maybe_checkpoint(self, self._act_down, down[e], db, h, F.linear(x, gate[e], gb))

    def _act_down(self, down, bias, h, gate=None):
        return F.linear(self.glu(h, gate), down, bias)

    def traced(self, e: int, x, w: tuple):
        """Expert e on rows x -> (the activation entering its down projection, its output), for the scorers."""
        ub, gb, db = self.biases(self, e)
        h = self.glu(F.linear(x, w[0][e], ub), None if w[1] is None else F.linear(x, w[1][e], gb))
        return h, F.linear(h, w[2][e], db)

    def _run(self, rows, counts, every: bool):
        """Every expert on its run of `rows` (sorted by expert, counts[e] each, a tensor) -> outputs in the same
        order: one grouped matmul per projection where the shapes allow it (GROUPED), else a loop over the
        experts (every: also the ones with no rows, so that each rank's backward meets the same collectives).
        Scoring's expert hooks get each expert's activation and output from either path."""
        cast = autocast_rows(rows)
        if self.fused and grouped_ok(cast, self.up_proj.shape[1]):
            return self._grouped(cast, counts)
        w, ys = self.weights(), []
        for e, xi in enumerate(rows.split(counts.tolist())):  # split, not slices: one cat in backward, no zero-filled grads
            if len(xi) or every:
                if self._expert_hooks:  # scoring: the activation and output of each expert, recorded
                    h, y = self.traced(e, xi, w)
                    for hook in list(self._expert_hooks.values()):
                        hook(self, e, h, y)
                else:
                    y = self.expert(e, xi, w)
                ys.append(y)
        return torch.cat(ys) if ys else rows.new_zeros(0, rows.shape[-1])

    def _grouped(self, rows, counts):
        """The experts as grouped matmuls over the sorted rows (no host sync, no Python loop over experts)."""
        up, gate, down = self.weights()
        offs = counts.cumsum(0).to(torch.int32)
        h = ExpertLinear.apply(rows, up, offs)
        g = None if gate is None else ExpertLinear.apply(rows, gate, offs)
        if not self._expert_hooks:
            return maybe_checkpoint(self, self._act_down_grouped, down, offs, h, g)
        a = gated_act(self.act, h, g)  # scoring: the same arithmetic, each expert's part recorded
        y = ExpertLinear.apply(a, down, offs)
        sizes = counts.tolist()
        for e, (ae, ye) in enumerate(zip(a.split(sizes), y.split(sizes))):
            for hook in list(self._expert_hooks.values()) if len(ae) else ():
                hook(self, e, ae, ye)
        return y

    def _act_down_grouped(self, down, offs, h, gate=None):
        return ExpertLinear.apply(gated_act(self.act, h, gate), down, offs)

    def forward(self, x, weights, idx):
        """x [T, L], weights/idx [T, k] -> sum_k w * expert_idx(x), dropless; each token's terms are
        added in expert order."""
        ex = self.exchange
        if ex is not None:
            x, weights, idx, T_all = ex.enter(x, weights, idx)
        T, k = idx.shape
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // k
        counts = expert_counts(flat, self.up_proj.shape[0] if ex is None else ex.n_experts)
        rows = x.index_select(0, token)  # backward: index_add, 3x faster than x[token]'s index_put
        if ex is None:
            y = self._run(rows, counts, every=False)
        else:
            rows, local, back = ex.dispatch(rows, counts)
            y = ex.combine(self._run(rows, local, every=True), back)
        w = weights.reshape(-1).index_select(0, order)
        yw = wide(y * w[:, None])
        out = torch.zeros(T, x.shape[-1], dtype=yw.dtype, device=x.device).index_add(0, token, yw).to(x.dtype)
        return out if ex is None else ex.leave(out, T_all)


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        S = cfg.moe.moe_shared_expert_intermediate_size
        self.shared_experts = MLP(cfg.hidden_size, S, cfg.moe.moe_act, cfg.moe.moe_gated) if S else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if cfg.moe.shared_expert_gate else None
        if cfg.moe.moe_latent_size:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, cfg.moe.moe_latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(cfg.moe.moe_latent_size, cfg.hidden_size, bias=False)
        self.router_logits = None  # last forward's [T, E] logits, read by the trainer's aux losses

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, w, idx = self.gate(x)
        self.router_logits = logits
        h = self.fc1_latent_proj(x) if self.cfg.moe.moe_latent_size else x
        y = self.experts(h, w, idx)
        if self.cfg.moe.moe_latent_size:
            y = self.fc2_latent_proj(y)
        if self.shared_experts is not None:
            s = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                s = torch.sigmoid(self.shared_expert_gate(x)) * s
            y = y + s
        return y.view(shape)


class MoEKind(LayerKind):
    def build(self, cfg):
        return MoE(cfg)

    def validate(self, cfg, need):
        need(cfg.moe.n_routed_experts > 0 and cfg.moe.moe_intermediate_size > 0,
             "MoE layers need n_routed_experts and moe_intermediate_size > 0")
        need(0 < cfg.moe.num_experts_per_tok <= cfg.moe.n_routed_experts,
             f"num_experts_per_tok={cfg.moe.num_experts_per_tok} must be in 1..n_routed_experts={cfg.moe.n_routed_experts}")
        need(cfg.moe.router in ROUTERS, f"unknown router {cfg.moe.router!r} (allowed: {ROUTERS})")
        need(cfg.moe.n_group > 0 and cfg.moe.n_routed_experts % cfg.moe.n_group == 0,
             f"n_routed_experts={cfg.moe.n_routed_experts} is not a multiple of n_group={cfg.moe.n_group}")
        need(0 < cfg.moe.topk_group <= cfg.moe.n_group, f"topk_group={cfg.moe.topk_group} must be in 1..n_group")
        if cfg.moe.n_group > 1:
            need(cfg.moe.router == "sigmoid", "grouped routing (n_group > 1) is only defined for the sigmoid router")
            need(cfg.moe.n_routed_experts // cfg.moe.n_group >= 2, "grouped routing needs at least 2 experts per group")
        need(cfg.moe.moe_act in ACTIVATIONS, f"unknown activation {cfg.moe.moe_act!r}")
        need((cfg.moe.swiglu_alpha is None) == (cfg.moe.swiglu_limit is None) and (cfg.moe.swiglu_limit is None or cfg.moe.moe_gated),
             "the clamped SwiGLU needs swiglu_alpha and swiglu_limit together, and gated experts")

    def summary(self, cfg):
        return {"moe_act": cfg.moe.moe_act, "moe_gated": cfg.moe.moe_gated, "n_routed_experts": cfg.moe.n_routed_experts,
                "num_experts_per_tok": cfg.moe.num_experts_per_tok, "moe_intermediate_size": cfg.moe.moe_intermediate_size,
                "moe_shared_expert_intermediate_size": cfg.moe.moe_shared_expert_intermediate_size,
                "moe_latent_size": cfg.moe.moe_latent_size, "router": cfg.moe.router}

    def target_problem(self, cfg, width, v):
        """Expert counts the router's top-k and groups can use; expert rows transformers can load."""
        if width == "experts":
            k, G, tg = cfg.moe.num_experts_per_tok, cfg.moe.n_group, cfg.moe.topk_group
            if v < k:
                return f"is fewer than num_experts_per_tok={k}"
            if G > 1 and not (v % G == 0 and v // G >= 2 and tg * (v // G) >= k):
                return (f"does not fit n_group={G} expert groups (the same number in every group, >= 2 each, "
                        f"topk_group={tg} groups holding num_experts_per_tok={k})")
        rows = ("expert_ffn_size", "latent_size" if cfg.moe.moe_latent_size else "hidden_size")
        if width in rows and v % MOE_ALIGN:
            return (f"is not a multiple of {MOE_ALIGN}, which transformers' grouped expert matmul needs "
                    f"(16-byte rows in bf16)")
        return None

    def buffer_elements(self, cfg, w):
        return w["experts"] if cfg.moe.router == "sigmoid" else 0  # e_score_correction_bias, fp32

    def keep(self, cfg, score, t, p):
        keep, E = {}, cfg.moe.n_routed_experts
        experts = torch.arange(E)
        if "experts" in t:
            experts = top_per_group(score(p + "experts", (E,), "--experts"), cfg.moe.n_group, t["experts"])
            keep[p + "experts"] = experts  # n_group=1: plain top-k
        if "expert_ffn_size" in t:
            s = score(p + "expert_ffn", (E, cfg.moe.moe_intermediate_size), "--expert-ffn-size")[experts]
            keep[p + "expert_ffn"] = torch.stack([top(row, t["expert_ffn_size"]) for row in s])
        if "shared_expert_size" in t:
            s = score(p + "shared_ffn", (cfg.moe.moe_shared_expert_intermediate_size,), "--shared-expert-size")
            keep[p + "shared_ffn"] = top(s, t["shared_expert_size"])
        if "latent_size" in t:
            keep[p + "latent"] = top(score(p + "latent", (cfg.moe.moe_latent_size,), "--latent-size"), t["latent_size"])
        return keep

    def magnitude(self, cfg, local, t):
        if local.startswith("shared_experts."):
            return ffn_magnitude("shared_ffn", local, t)
        if local in ("experts.up_proj", "experts.gate_proj", "experts.down_proj"):
            per = t.square().sum(1 if local == "experts.down_proj" else 2)  # [E, Fm]
            out = [("expert_ffn", per), ("experts", per.sum(1))]
            if cfg.moe.moe_latent_size:
                out.append(("latent", sq(t, 1 if local == "experts.down_proj" else 2)))
            return out
        if local in ("fc1_latent_proj.weight", "fc2_latent_proj.weight"):
            return [("latent", sq(t, 0 if local.startswith("fc1") else 1))]
        return []

    def check_tp(self, cfg, tp, need):
        S = cfg.moe.moe_shared_expert_intermediate_size
        need(S % tp == 0, f"tensor parallelism: moe_shared_expert_intermediate_size={S} is not divisible by tp={tp}")


MOE = MoEKind(
    "E", "moe",
    (Param("gate.weight", ("experts", "hidden")), Param("gate.bias", ("experts",), ("router_bias",)),
     Param("gate.e_score_correction_bias", ("experts",), ("sigmoid_router",)),
     Param("experts.up_proj", ("experts", "expert_ffn", "moe_io")),
     Param("experts.gate_proj", ("experts", "expert_ffn", "moe_io"), ("moe_gated",)),
     Param("experts.down_proj", ("experts", "moe_io", "expert_ffn")),
     Param("experts.up_proj_bias", ("experts", "expert_ffn"), ("expert_bias",)),
     Param("experts.gate_proj_bias", ("experts", "expert_ffn"), ("expert_bias", "moe_gated")),
     Param("experts.down_proj_bias", ("experts", "moe_io"), ("expert_bias",)))
    + mlp_params("shared_experts.", "shared_ffn", (), ("moe_shared_expert_intermediate_size",), "moe_gated")
    + (Param("shared_expert_gate.weight", ("one", "hidden"), ("shared_expert_gate",)),
       Param("fc1_latent_proj.weight", ("latent", "hidden"), ("moe_latent_size",)),
       Param("fc2_latent_proj.weight", ("hidden", "latent"), ("moe_latent_size",))),
    sizes={"experts": lambda cfg, w: w["experts"], "expert_ffn": lambda cfg, w: w["expert_ffn_size"],
           "shared_ffn": lambda cfg, w: w["shared_expert_size"], "latent": lambda cfg, w: w["latent_size"],
           "moe_io": lambda cfg, w: w["latent_size"] if cfg.moe.moe_latent_size else w["hidden_size"]},  # what experts read
    units={"experts": "n_routed_experts", "expert_ffn": "moe_intermediate_size",
           "shared_ffn": "moe_shared_expert_intermediate_size", "latent": "moe_latent_size"},
    scored={"experts": ("experts",), "expert_ffn": ("experts", "expert_ffn"), "shared_ffn": ("shared_ffn",),
            "latent": ("latent",)},
    widths=("experts", "expert_ffn_size", "shared_expert_size", "latent_size"),
    declares=(Width("experts", "n_routed_experts", None, "experts", 8, "experts", "routed experts per MoE layer",
                    step_lcm="n_group"),
              Width("expert_ffn_size", "moe_intermediate_size", None, "expert_ffn", 512, "e.ffn", "routed expert FFN size"),
              Width("shared_expert_size", "moe_shared_expert_intermediate_size", None, "shared_ffn", 512, "shared",
                    "shared expert FFN size", absent="shared expert"),
              Width("latent_size", "moe_latent_size", None, "latent", 256, "latent", "LatentMoE latent size",
                    absent="latent MoE (moe_latent_size)")), tp_axes=("shared_ffn",), routed=True,
    color="tab:purple", tp_plan={"shared_experts.up_proj": "colwise", "shared_experts.gate_proj": "colwise",
                                 "shared_experts.down_proj": "rowwise"}, config=MoEConfig)
