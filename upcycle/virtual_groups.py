"""Dense FFN -> fine-grained MoE with virtual groups (arXiv 2410.07524), as tensor math.

Notation: dense f(x) = W2 act(W1 x) with intermediate size F; G granularity, E expansion,
N = E*G experts, T top-k, S shared-expert neurons.
  * The first S neurons (or `shared_index`) become the shared expert, unscaled.
  * The other F-S neurons are cut into G contiguous shards of Fm = (F-S)/G; expert e gets shard
    j = e mod G (gate and up rows of a gated MLP are cut with the same neuron index).
  * Router row R[e] = R0[e // G], R0 ~ N(0, 0.02): the G experts of a virtual group have identical
    logits, so with G | T whole groups are chosen together.
  * Every routed expert's W1 (gate and up) and W2 is multiplied by s = a^(1/d): a = G for top-k then
    softmax and for the renormalised sigmoid router, a = E*G^2/T for softmax then top-k, a = 2G/T for the
    unnormalised sigmoid (sigmoid-raw: gates ~ sigmoid(0) = 1/2, router std 0.02/sqrt(H)); d is the
    degree of the expert in its weights, 1 + deg(act) + gated, with deg(relu2) = 2 and deg 1 for
    relu/silu/gelu (the paper's a^(1/3) for relu2 or gated, a^(1/2) for plain GeLU/SiLU).
Exactness at step 0: with a renormalising router and G | T, a chosen group g carries total weight
w_g and each of its G members outputs s^d * shard_j(x) = G * shard_j(x) when act is positively
homogeneous (relu2, relu), so the group returns w_g * f_routed(x) and the weights sum to one:
y = f(x). G = 1 gives a = s = 1, exact for any activation. silu/gelu with G > 1 and softmax-then-
top-k are approximations (the paper's trade-off; they are reported, or refused with exact=True).
Router settings: the sigmoid router keeps routed_scaling_factor = 1 and a zero correction bias (a
factor r != 1 would need every expert divided by r to stay exact; 1 is the simpler exact choice), so
all three modes reuse the same a. Nothing else of the model changes.
Ties: group members tie bit for bit (identical rows), but torch.topk does not break ties by index,
so two *different* groups with exactly equal scores at the top-k boundary could be split; with a
random router this needs equal logits (probability zero) or a saturated sigmoid (logit > ~16.6 in
fp32, far outside the std-0.02 router's range at step 0).
Placement (exact=True in the pipeline): the whole factor a on W2 ("down") instead of s on W1 and W2
("balanced", the paper's split) makes every member output a * shard_j(x) for any activation, so
relu2, GeLU and SwiGLU with G | T are all exact, and a power-of-two a is exact in any float format.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.families import FAMILIES
from remodel.models.kinds import layer_kinds, routed, upcycled_pattern, used

from .drop import dense_stats, drop_neurons, drop_seed

ROUTER_MODES = {  # CLI name -> (ModelConfig.router, norm_topk_prob)
    "topk-softmax": ("softmax", True),
    "softmax-topk": ("softmax", False),
    "sigmoid": ("sigmoid", True),
    "sigmoid-raw": ("sigmoid", False),  # gates are the sigmoid scores themselves (no renormalisation)
}
HOMOGENEOUS = {"relu2": 2, "relu": 1}  # act(c x) = c^d act(x) for every c > 0
ROUTER_STD = 0.02


def output_degree(act: str, gated: bool) -> int:
    """Degree of an expert's output in a common scale of all its weights."""
    return 1 + HOMOGENEOUS.get(act, 1) + int(gated)


@dataclass
class Plan:
    """Everything the weight math needs, decided (and validated) before any tensor is read."""
    experts: int  # N = E*G
    granularity: int  # G
    top_k: int  # T
    shared: int  # S
    router: str  # CLI name (ROUTER_MODES)
    ffn: int  # F, dense intermediate size
    act: str
    gated: bool
    expert_size: int  # Fm = (F - S) / G
    a: float
    s: float
    exact: bool
    why_not_exact: list
    placement: str = "balanced"  # "balanced": W1 and W2 x s; "down": W2 x a, W1 unscaled

    @property
    def scales(self) -> tuple[float, float]:
        """(factor on W1 = gate and up, factor on W2 = down) of every routed expert."""
        return (self.s, self.s) if self.placement == "balanced" else (1.0, self.a)

    @property
    def expansion(self) -> int:
        return self.experts // self.granularity

    def to_dict(self) -> dict:
        return {**asdict(self), "expansion": self.expansion}


def make_plan(cfg: ModelConfig, experts: int, granularity: int, top_k: int, shared: int = 0,
              router: str = "topk-softmax", placement: str = "balanced") -> Plan:
    """Check the request against a dense config (one-line RemodelError) and fix a, s and exactness.
    placement "down" puts the whole factor a on W2 (exact for any activation, see module doc)."""
    N, G, T, S, F = experts, granularity, top_k, shared, cfg.mlp.intermediate_size
    if router not in ROUTER_MODES:
        raise RemodelError(f"unknown router {router!r} (supported: {', '.join(ROUTER_MODES)})")
    if not any(k.upcycles_to for k in used(cfg)):
        raise RemodelError(f"the source has no dense MLP layers to upcycle (pattern {cfg.pattern!r})")
    if routed(cfg):
        raise RemodelError("the source already has MoE layers; upcycling needs a dense-MLP model")
    if cfg.mlp.mlp_bias:
        raise RemodelError("MLP biases cannot be upcycled (experts have no bias)")
    if G < 1 or N < 2:
        raise RemodelError(f"need --granularity >= 1 and --experts >= 2, got G={G}, N={N}")
    if N % G:
        raise RemodelError(f"--experts N={N} is not a multiple of --granularity G={G} (N = E*G)")
    if not 1 <= T <= N:
        raise RemodelError(f"--top-k T={T} must be in 1..{N} (the number of experts)")
    if not 0 <= S < F:
        raise RemodelError(f"--shared-expert-size S={S} must be in 0..{F - 1} (dense intermediate size {F})")
    if (F - S) % G:
        raise RemodelError(f"intermediate size F={F} minus shared size S={S} is not divisible by G={G}")
    a = {"softmax-topk": (N // G) * G * G / T, "sigmoid-raw": 2 * G / T}.get(router, float(G))
    s = a ** (1.0 / output_degree(cfg.mlp.mlp_act, cfg.mlp.mlp_gated))
    why = []
    if router == "softmax-topk":
        why.append("the softmax-topk router never reproduces the dense model (kept weights sum to < 1)")
    if router == "sigmoid-raw":
        why.append("the sigmoid-raw router's gates are sigmoid(logit) ~ 0.5, never exactly (close, not exact)")
    if T % G:
        why.append(f"top-k T={T} is not a multiple of granularity G={G}, so virtual groups are split")
    if G > 1 and cfg.mlp.mlp_act not in HOMOGENEOUS and placement == "balanced":
        kind = "gated " if cfg.mlp.mlp_gated else ""
        why.append(f"granularity G={G} with the {kind}{cfg.mlp.mlp_act} activation is approximate "
                   f"(only relu2/relu are homogeneous; use G=1)")
    if placement not in ("balanced", "down"):
        raise RemodelError(f"unknown scaling placement {placement!r} (balanced or down)")
    return Plan(N, G, T, S, router, F, cfg.mlp.mlp_act, cfg.mlp.mlp_gated, (F - S) // G, a, s, not why, why, placement)


def gated_shared(family: str | None) -> bool:
    """Whether the target family scales its shared expert by sigmoid(w.x) (models.families)."""
    return bool(family) and FAMILIES[family].shared_expert_gate


def moe_config(cfg: ModelConfig, p: Plan, family: str) -> ModelConfig:
    """The upcycled config: every dense MLP layer becomes MoE; routed scale kept at 1 (exactness), no bias groups;
    then the target family's own MoE numerics (Family.upcycled)."""
    kind, norm = ROUTER_MODES[p.router]
    out = cfg.replace(
        pattern=upcycled_pattern(cfg), n_routed_experts=p.experts, num_experts_per_tok=p.top_k,
        moe_intermediate_size=p.expert_size, moe_shared_expert_intermediate_size=p.shared,
        moe_latent_size=None, router=kind, norm_topk_prob=norm, routed_scaling_factor=1.0,
        n_group=1, topk_group=1, shared_expert_gate=gated_shared(family) and p.shared > 0)
    return FAMILIES[family].upcycled(out) if family in FAMILIES else out  # the target's own MoE numerics


def router_std(router: str, hidden: int) -> float:
    """Init std of the router rows: 0.02 (the paper's); 0.02 / sqrt(H) for sigmoid-raw, whose gates are the
    scores themselves, so its logits stay ~0.02 and the gates within ~1% of the 0.5 the scaling assumes."""
    return ROUTER_STD / hidden ** 0.5 if router == "sigmoid-raw" else ROUTER_STD


def router_weight(p: Plan, hidden: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """[N, H]: one N(0, router_std) row per virtual group, repeated for its G members."""
    g = torch.Generator().manual_seed(seed)
    r0 = torch.randn(p.experts // p.granularity, hidden, generator=g) * router_std(p.router, hidden)
    return r0.repeat_interleave(p.granularity, dim=0).to(dtype)


class LazyExperts:
    """The N per-expert slices of one fused projection without materialising N copies: expert e is
    the scaled shard e mod G (a view; writers copy it). `fused()` builds the [N, ...] tensor."""

    def __init__(self, shards: torch.Tensor, n: int):
        self.shards, self.n = shards, n  # [G, ...], already scaled

    def __len__(self):
        return self.n

    def __getitem__(self, e: int) -> torch.Tensor:
        if not 0 <= e < self.n:
            raise IndexError(e)
        return self.shards[e % len(self.shards)]

    @property
    def shape(self) -> tuple:  # of the fused tensor (what models.moe.Experts reads)
        return (self.n, *self.shards.shape[1:])

    def fused(self) -> torch.Tensor:
        return self.shards.repeat(self.n // len(self.shards), *[1] * (self.shards.dim() - 1))


def _scaled(t: torch.Tensor, s: float) -> torch.Tensor:
    """t * s rounded once to t's dtype (same bits as (t.float() * s).to(dtype)), contiguous: written in
    one pass into a contiguous tensor (t * s would keep a transposed view's layout and need a copy)."""
    if s == 1.0:
        return t.contiguous()
    return torch.mul(t, s, out=torch.empty(t.shape, dtype=t.dtype, device=t.device))


def upcycle_mlp(p: Plan, up: torch.Tensor, down: torch.Tensor, gate: torch.Tensor | None, router: torch.Tensor,
                family: str | None = None, shared_index: torch.Tensor | None = None) -> dict:
    """One dense MLP (up/gate [F, H], down [H, F]) -> the MoE tensors under our names relative to
    `mixer.` (fused experts as LazyExperts). `router` is the [N, H] gate weight (see router_weight).
    Inputs are not modified. A family whose shared expert is scaled by sigmoid(w.x) (Qwen2-MoE) gets
    w = 0 and down_proj * 2, which keep it exact."""
    F, G, N, Fm = up.shape[0], p.granularity, p.experts, p.expert_size
    if shared_index is None:  # the first S neurons: plain slices, no gather
        shared, rest = slice(0, p.shared), slice(p.shared, F)
    else:
        keep = torch.ones(F, dtype=torch.bool)
        keep[shared_index] = False
        shared, rest = shared_index, keep.nonzero().squeeze(1)
        if len(shared_index) != p.shared or len(rest) != F - p.shared:
            raise RemodelError(f"shared_index must name {p.shared} distinct neurons of {F}")
    out = {"gate.weight": router.to(up.dtype)}
    if ROUTER_MODES[p.router][0] == "sigmoid":
        out["gate.e_score_correction_bias"] = torch.zeros(N, dtype=torch.float32)
    s_in, s_out = p.scales
    out["experts.up_proj"] = LazyExperts(_scaled(up[rest].view(G, Fm, -1), s_in), N)
    if gate is not None:
        out["experts.gate_proj"] = LazyExperts(_scaled(gate[rest].view(G, Fm, -1), s_in), N)
    down_shards = down[:, rest].reshape(down.shape[0], G, Fm).transpose(0, 1)
    out["experts.down_proj"] = LazyExperts(_scaled(down_shards, s_out), N)
    if p.shared:
        out["shared_experts.up_proj.weight"] = up[shared]
        if gate is not None:
            out["shared_experts.gate_proj.weight"] = gate[shared]
        sd = down[:, shared]
        if gated_shared(family):
            out["shared_experts.down_proj.weight"] = sd * 2  # exact in any float format
            out["shared_expert_gate.weight"] = torch.zeros(1, up.shape[1], dtype=up.dtype)
        else:
            out["shared_experts.down_proj.weight"] = sd
    return out


def layer_seed(seed: int, layer: int) -> int:
    return seed * 1_000_003 + layer


def drop_upcycle(moe: dict, up: torch.Tensor, down: torch.Tensor, gate: torch.Tensor | None, ratio: float,
                 seed: int, layer: int) -> dict:
    """upcycle_mlp's output `moe` of the dense MLP (up, down, gate) of `layer` -> the same with its routed
    experts drop-upcycled (upcycle.drop): N distinct experts as LazyExperts over N shards. `moe` itself
    is returned when ratio is 0 (naive copies, bit for bit)."""
    if not ratio:
        return moe
    leaves = {k.split(".")[1]: v for k, v in moe.items() if k.startswith("experts.")}
    fused = {k: v.fused() for k, v in leaves.items()}  # repeat: new tensors
    drop_neurons(fused, dense_stats(up, down, gate), ratio, drop_seed(layer_seed(seed, layer)))
    return {**moe, **{f"experts.{k}": LazyExperts(v, len(v)) for k, v in fused.items()}}


@torch.no_grad()
def upcycle_model(model, p: Plan, family: str | None = None, seed: int = 0, round_to=None,
                  drop_ratio: float = 0.0):
    """In-memory upcycling of a HybridLM by plan `p` (make_plan of model.cfg; tests and experiments, the
    pipeline streams): -> (new model, p). Non-MLP weights are shared with `model`, not copied. `round_to`:
    the dtype the MoE weights are made in (a checkpoint's, e.g. bf16), then cast back: the same bits as the
    streamed checkpoint. drop_ratio > 0: Drop-Upcycling (drop_upcycle) after the copies."""
    from remodel.models.model import HybridLM

    cfg = model.cfg
    new_cfg = moe_config(cfg, p, family or "")
    dtype = next(model.parameters()).dtype
    state = dict(model.state_dict())
    for i, k in enumerate(layer_kinds(cfg)):
        if not k.upcycles_to:
            continue
        m = f"layers.{i}.mixer."
        up, down, gate = (state.pop(m + n, None) for n in ("up_proj.weight", "down_proj.weight", "gate_proj.weight"))
        up, down, gate = (None if t is None else t.to(round_to or dtype) for t in (up, down, gate))
        r = router_weight(p, cfg.hidden_size, layer_seed(seed, i))
        moe = drop_upcycle(upcycle_mlp(p, up, down, gate, r, family), up, down, gate, drop_ratio, seed, i)
        for k, v in moe.items():
            if isinstance(v, LazyExperts):  # cast the G shards, then repeat: E times less casting
                v = LazyExperts(v.shards.to(dtype), v.n).fused()
            state[m + k] = v if k.endswith("correction_bias") else v.to(dtype)
    with torch.device("meta"):
        new = HybridLM(new_cfg)
    new.load_state_dict(state, strict=True, assign=True)
    new.init_buffers(next(model.parameters()).device)  # non-persistent buffers (RoPE frequencies), every module's
    return new.eval(), p
