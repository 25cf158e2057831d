"""Dense attention model -> hybrid (issue 57): the chosen attention layers replaced by a linear mixer, the rest
(kept attention layers, MLPs, norms, embeddings) copied exactly, in a family transformers loads.

--init attention, Mamba-2 (MambaInLlama, arXiv 2408.15237): C <- Q, B <- K, x <- V, out <- O, with one Mamba head
and one B/C group per query head, its B and x those of its key-value head: with decay 1 and dt 1 the SSD scan
is then attention's linear form y_t = sum_{s<=t} (q_t . k_s) v_s per head; D = 0 (attention has no x_t skip) and
the gate's in_proj rows (z) zero, so the new layer starts silent (silu(0) = 0: the hybrid starts as the source
without those layers, never worse) and the gradient opens it (silu'(0) = 1/2). Measured on a small trained Llama
(tests/test_hybridize_quality.py): with transformers' random z and D = 1 the same weights ended 0.03 - 0.05 above
--init random after 40 distillation steps, silent 0.011 - 0.015 below. dt, conv, A_log and dt_bias as transformers
initialises them (models.model.init_weights' rule, each layer from its own generator: layer_seed). --init random:
the whole mixer so.
A target family whose attention rotates a fixed share of each head (Family.fixed_rotary) gets wider heads, zero
in the added channels and the query rescaled, so its kept layers compute what the source's did.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from remodel.models.attention import ATTENTION
from remodel.models.errors import RemodelError
from remodel.models.families import DEFAULT_ORDER, FAMILIES
from remodel.models.hf import check_exportable
from remodel.models.kinds import routed
from remodel.models.layout import layer_of
from remodel.models.mamba import MAMBA
from remodel.models.model import Block, HybridLM, init_tensor
from remodel.models.gated_deltanet import GATED_DELTANET
from remodel.models.kda import KDA
from remodel.models.norm import scale_of

from .hybrid_gdn import gdn_from_attention, gdn_sizes
from .hybrid_kda import kda_from_attention, kda_sizes
from .hybrid_target import family_fit, kept_attention, shift_norms, shifted_norms

INITS = ("attention", "random")


class Mixer(NamedTuple):
    """A --mixer: the kind whose layers it replaces, the kind it puts there, its config fields sized from the
    source's attention section, and its tensors initialised from one attention layer's (init(cfg, att, fresh))."""
    replaces: object
    kind: object
    sizes: Callable
    init: Callable


def _mamba_sizes(a) -> dict:
    """One Mamba head and one B/C group per query head, head and state width the attention head's."""
    return {"mamba.mamba_num_heads": a.num_attention_heads, "mamba.mamba_head_dim": a.head_dim,
            "mamba.n_groups": a.num_attention_heads, "mamba.ssm_state_size": a.head_dim,
            "mamba.mamba_proj_bias": bool(a.attention_bias or a.attention_out_bias), "mamba.time_step_min": 0.0}


def per_query_head(t: torch.Tensor, kv_heads: int, heads: int) -> torch.Tensor:
    """Rows of key-value heads [kv * d, ...] -> the rows each query head reads [heads * d, ...] (repeat_kv's order)."""
    return t.unflatten(0, (kv_heads, -1)).repeat_interleave(heads // kv_heads, dim=0).flatten(0, 1)


def _mamba_from_attention(cfg, att: dict, fresh: dict) -> dict:
    """MambaInLlama: in_proj's x, B, C rows <- V, K, Q (x and B repeated per query head), out_proj <- O, the z rows
    and D zero; the rest (dt rows, conv, A_log, dt_bias, norm) as `fresh` holds them."""
    a, out = cfg.attention, dict(fresh)
    H, KV = a.num_attention_heads, a.num_key_value_heads
    for leaf in ("weight", "bias"):
        if f"in_proj.{leaf}" not in fresh or f"v_proj.{leaf}" not in att:  # no bias on one side: the fresh zeros
            continue
        t = fresh[f"in_proj.{leaf}"].clone()
        src = {"x": per_query_head(att[f"v_proj.{leaf}"], KV, H), "B": per_query_head(att[f"k_proj.{leaf}"], KV, H),
               "C": att[f"q_proj.{leaf}"]}
        for seg, rows in src.items():
            t[MAMBA.segment_span(cfg, "mamba_in_proj", seg)] = rows
        out[f"in_proj.{leaf}"] = t
        out[f"out_proj.{leaf}"] = att.get(f"o_proj.{leaf}", fresh[f"out_proj.{leaf}"])
    out["in_proj.weight"][MAMBA.segment_span(cfg, "mamba_in_proj", "z")] = 0
    out["D"] = torch.zeros_like(fresh["D"])
    return out


MIXERS = {"mamba2": Mixer(ATTENTION, MAMBA, _mamba_sizes, _mamba_from_attention),
          "gdn": Mixer(ATTENTION, GATED_DELTANET, gdn_sizes, gdn_from_attention),
          "kda": Mixer(ATTENTION, KDA, kda_sizes, kda_from_attention)}


def mixer_of(name: str) -> Mixer:
    if name not in MIXERS:
        raise RemodelError(f"unknown --mixer {name!r} (supported: {', '.join(MIXERS)})")
    return MIXERS[name]


def replaceable(cfg, mixer: str) -> list[int]:
    """Our indices of the layers `mixer` can replace (the attention layers), in order; refused when none."""
    m = mixer_of(mixer)
    layers = [s.index for s in cfg.slots if s.kind is m.replaces]
    if not layers:
        raise RemodelError(f"--mixer {mixer} replaces {m.replaces.name} layers and the model has none "
                           f"(pattern {cfg.pattern!r})")
    return layers


def kept(n: int, keep_attention=None, keep_layers=None) -> list[int]:
    """Which of the n attention layers keep attention (0-based among them): --keep-layers as given, or
    --keep-attention N evenly spaced (the k-th at int((k + 1/2) n / N))."""
    if (keep_attention is None) == (keep_layers is None):
        raise RemodelError("give one of --keep-attention N or --keep-layers I,J,... (which layers keep attention)")
    if keep_layers is not None:
        ok = all(isinstance(j, int) and not isinstance(j, bool) and 0 <= j < n for j in keep_layers)
        if not ok or len(set(keep_layers)) != len(keep_layers):
            raise RemodelError(f"--keep-layers must be distinct attention-layer indices in 0..{n - 1}, got "
                               f"{list(keep_layers)}")
        return sorted(keep_layers)
    if isinstance(keep_attention, bool) or not isinstance(keep_attention, int) or not 0 <= keep_attention <= n:
        raise RemodelError(f"--keep-attention must be in 0..{n} (the model's attention layers), got {keep_attention!r}")
    return [int((k + 0.5) * n / keep_attention) for k in range(keep_attention)]


def head_dim_in(cfg, family: str) -> int:
    """The head width that holds the source's attention exactly in `family`: the source's, or where the family
    rotates a fixed share r of each head, rotated channels / r (the added channels zero)."""
    a, r = cfg.attention, FAMILIES[family].fixed_rotary
    if r is None or r == a.partial_rotary_factor:
        return a.head_dim
    rot = int(a.head_dim * a.partial_rotary_factor)
    d = round(rot / r)
    where = f"--to {family}: its attention rotates {r} of each head's channels, the source's {rot} of {a.head_dim}"
    if d < a.head_dim or int(d * r) != rot:
        raise RemodelError(f"{where}: no head width holds them")
    if a.qk_norm:
        raise RemodelError(f"{where}: its heads would be widened to {d}, which a q/k norm over the head does not allow")
    return d


def hybrid_config(cfg, mixer: str, replaced: set, family: str | None):
    """The hybrid's ModelConfig: layers `replaced` of the mixer's kind, the kept attention in `family`'s head width
    (None: the source's, a model held in memory only) with one bias flag for q/k/v and o_proj (the hybrid families
    tie them: the side the source lacks is written as zeros, hybridize_model)."""
    m, a = mixer_of(mixer), cfg.attention
    pattern = "".join(m.kind.char if i in replaced else c for i, c in enumerate(cfg.pattern))
    attn = {}
    if family is not None and any(s.kind is m.replaces and s.index not in replaced for s in cfg.slots):  # kept
        bias = bool(a.attention_bias or a.attention_out_bias)
        attn = {"attention.head_dim": head_dim_in(cfg, family), "attention.attention_scale": None,
                "attention.partial_rotary_factor": FAMILIES[family].fixed_rotary or a.partial_rotary_factor,
                "attention.attention_bias": bias, "attention.attention_out_bias": bias}
    new = cfg.replace(pattern=pattern, **m.sizes(a), **attn)
    return new if family is None else family_fit(new, family)  # the family's gate, q/k norms, norm offset


def _variants(new) -> list:
    """`new`, then (MoE layers without a shared expert) the same with a zero shared expert of width 1, which adds
    nothing: the form of a family whose MoE layers always hold one (hybridize_model writes it as zeros)."""
    out = [new]
    if routed(new) and not new.moe.moe_shared_expert_intermediate_size:
        out.append(new.replace(**{"moe.moe_shared_expert_intermediate_size": 1}))
    return out


def _held(cfg, mixer: str, replaced: set, family: str):
    """The first form of the hybrid that `family` exports exactly; else RemodelError with the family's reason
    (that of the last form tried)."""
    why = None
    for new in _variants(hybrid_config(cfg, mixer, replaced, family)):
        try:
            check_exportable(new, family)
            return new
        except RemodelError as e:
            why = e  # the last form's reason: the one closest to holding it
    raise why


def target(cfg, mixer: str, replaced: set, to: str | None) -> tuple[str, object]:
    """(family, hybrid config): `to` when it holds the hybrid, else the first family of the registry's default
    order that holds it (and holds the mixer, asked with every attention layer replaced); one line otherwise,
    with each family that holds the mixer's layers and why it cannot hold this hybrid."""
    if to is not None:
        if to not in FAMILIES:
            raise RemodelError(f"unknown --to {to!r} (supported: {', '.join(FAMILIES)})")
        try:
            return to, _held(cfg, mixer, replaced, to)
        except RemodelError as e:
            raise RemodelError(f"--to {to} cannot hold the hybrid: {e}") from None
    every, why = set(replaceable(cfg, mixer)), []
    for f in DEFAULT_ORDER:
        try:
            _held(cfg, mixer, every, f.name)
            return f.name, _held(cfg, mixer, replaced, f.name)
        except RemodelError as e:
            if mixer_of(mixer).kind.char in "".join(f.block_types.values()):
                said = str(e).removeprefix(f"cannot export to {f.name}: ").removeprefix(f"--to {f.name}: ")
                why.append(f"--to {f.name}: {said}")
    raise RemodelError(f"no family holds this hybrid (--mixer {mixer}; {'; '.join(why) or 'none holds its layers'})")


def widen_attention(att: dict, a, d2: int) -> dict:
    """One attention layer's tensors with every head d -> d2 channels wide (zeros appended) and the query scaled
    so that 1/sqrt(d2) attention computes the source's scores (source scale: attention_scale or 1/sqrt(d))."""
    d = a.head_dim
    factor = (a.attention_scale or 1 / math.sqrt(d)) * math.sqrt(d2)
    if d2 == d and factor == 1:
        return dict(att)

    def rows(t):
        return F.pad(t.unflatten(0, (-1, d)), (0, 0) * (t.dim() - 1) + (0, d2 - d)).flatten(0, 1)

    out = dict(att)
    for k, t in att.items():
        if k.startswith(("q_proj.", "k_proj.", "v_proj.")):
            out[k] = rows(t) * (factor if k.startswith("q_proj.") else 1)
    out["o_proj.weight"] = rows(att["o_proj.weight"].T).T.contiguous()
    return out


def _mixer_state(state: dict, i: int) -> dict:
    pre = f"layers.{i}.mixer."
    return {k[len(pre):]: v for k, v in state.items() if k.startswith(pre)}


def layer_seed(seed: int, i: int) -> int:
    """The seed of layer i's fresh mixer: each layer draws from its own generator, so a layer's initialisation
    is the same whether the model is converted whole or streamed a layer at a time."""
    return seed * 1_000_003 + i


def fresh_mixer(new_cfg, i: int, seed: int) -> dict:
    """Layer i's mixer in new_cfg initialised as init_weights does (models.model.init_tensor), from a generator
    seeded layer_seed(seed, i): {its name in the mixer: tensor}."""
    block = Block(new_cfg, new_cfg.pattern[i])
    g = torch.Generator().manual_seed(layer_seed(seed, i))
    for n, p in block.mixer.named_parameters():
        init_tensor(new_cfg, f"layers.{i}.mixer.{n}", p, g, 0.02, (block.spec, n))
    return {k: v.detach() for k, v in block.mixer.state_dict().items()}


def _added(src_cfg, new_cfg) -> dict:
    """{name: meta tensor} of the tensors the target's form adds to the source's model: the keys of new_cfg's
    model that the same model with the source's bias flags and shared-expert width lacks. hybrid_config's tied
    q/k/v / o_proj bias (the side the source lacks) and _variants' width-1 shared expert add nothing: zeros."""
    c, a = src_cfg, src_cfg.attention
    base = new_cfg.replace(**{
        "attention.attention_bias": a.attention_bias, "attention.attention_out_bias": a.attention_out_bias,
        "moe.moe_shared_expert_intermediate_size": c.moe.moe_shared_expert_intermediate_size})
    with torch.device("meta"):
        new = HybridLM(new_cfg).state_dict()
        keys = new.keys() - HybridLM(base).state_dict().keys()
    return {k: new[k] for k in keys}


class HybridLayers:
    """The source's tensors -> the hybrid's, one group at a time (a trunk layer, or the rest: layer_of): what
    hybridize_model does to a model held whole and upcycle.hybridize_stream to a checkpoint read layer by layer,
    so both give the same tensors. Replaced layers' mixers initialised per `init` (fresh_mixer), kept attention
    in the target's form (widened, kept_attention), norms re-expressed for the target's offset, every other
    tensor copied, those the target's form adds as zeros."""

    def __init__(self, src_cfg, new_cfg, mixer: str, replaced: set, init: str = "attention", seed: int = 0):
        if init not in INITS:
            raise RemodelError(f"unknown --init {init!r} (supported: {', '.join(INITS)})")
        self.src_cfg, self.new_cfg, self.replaced, self.init, self.seed = src_cfg, new_cfg, replaced, init, seed
        self.mixer, self.attention = mixer_of(mixer), set(replaceable(src_cfg, mixer))
        with torch.device("meta"):
            self.norms = shifted_norms(HybridLM(src_cfg), new_cfg.norm_offset)
            self.target = HybridLM(new_cfg).state_dict()  # meta tensors: the hybrid's names, shapes, dtypes
        self.added = _added(src_cfg, new_cfg)

    def convert(self, group: int | None, old: dict) -> dict:
        """Group `group`'s tensors of the hybrid from the source's (`old`: that group's, our names, float32)."""
        old = shift_norms(old, self.norms, self.src_cfg.norm_offset, self.new_cfg.norm_offset)
        pre = f"layers.{group}.mixer."
        swap = group in self.attention
        state = {k: v for k, v in old.items() if k in self.target and not (swap and k.startswith(pre))}
        if swap:
            state.update({pre + k: v for k, v in self._mixer(group, old).items()})
        for k, t in self.added.items():
            if layer_of(k) == group and k not in state:
                state[k] = torch.zeros(t.shape, dtype=t.dtype)
        return state

    def _mixer(self, i: int, old: dict) -> dict:
        att, new = _mixer_state(old, i), self.new_cfg
        if i not in self.replaced:
            return kept_attention(widen_attention(att, self.src_cfg.attention, new.attention.head_dim),
                                  self.src_cfg, new, scale_of(old[f"layers.{i}.norm.weight"], new.norm_offset))
        fresh = fresh_mixer(new, i, self.seed)
        return fresh if self.init == "random" else self.mixer.init(new, att, fresh)

    def missing(self, name: str) -> RemodelError:
        """The refusal for a hybrid tensor nothing gives (an init that forgot it): never zero-filled."""
        return RemodelError(f"hybridize: nothing gives the hybrid's tensor {name} (not the source's, the mixer "
                            f"init's or one the target's form adds)")


@torch.no_grad()
def hybridize_model(src: HybridLM, new_cfg, mixer: str, replaced: set, init: str = "attention",
                    seed: int = 0) -> HybridLM:
    """The hybrid of `src` under `new_cfg` (hybrid_config), converted group by group by HybridLayers; any tensor
    without a value is refused, not zero-filled."""
    conv = HybridLayers(src.cfg, new_cfg, mixer, replaced, init, seed)
    groups = {}
    for k, v in src.state_dict().items():
        groups.setdefault(layer_of(k), {})[k] = v
    state = {}
    for group in [None, *range(len(src.cfg.slots))]:
        state.update(conv.convert(group, groups.get(group, {})))
    missing = [k for k in conv.target if k not in state]
    if missing:
        more = f" nor {len(missing) - 1} more" if missing[1:] else ""
        raise RemodelError(f"{conv.missing(missing[0])}{more}")
    model = HybridLM(new_cfg)
    model.load_state_dict(state, strict=True)
    return model.eval()


@torch.no_grad()
def kl_costs(src: HybridLM, mixer: str, blocks: torch.Tensor, init: str = "attention", seed: int = 0,
             batch: int = 4) -> list[float]:
    """Per attention layer (in order): the mean per-token KL(source || the source with that layer alone replaced
    by its initialised mixer) over the token blocks [n, l] (arXiv 2512.20569's selection: keep the costliest)."""
    chunks = blocks.split(batch)
    ref = [F.log_softmax(src(ids).float(), -1) for ids in chunks]
    costs = []
    for i in replaceable(src.cfg, mixer):
        probe = hybridize_model(src, hybrid_config(src.cfg, mixer, {i}, None), mixer, {i}, init, seed)
        kl = sum(F.kl_div(F.log_softmax(probe(ids).float(), -1), r, log_target=True, reduction="sum").item()
                 for ids, r in zip(chunks, ref))
        costs.append(kl / blocks.numel())
    return costs


def costliest(costs: list[float], n: int) -> list[int]:
    """The n attention layers (indices among them, ascending) whose replacement costs most."""
    return sorted(sorted(range(len(costs)), key=lambda j: -costs[j])[:n])
