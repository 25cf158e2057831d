"""Structured pruning on every axis (Minitron / Minitron-SSM / MiniPuzzle), from cached scores.

targets (any subset; an axis not named is kept):
  hidden_size, ffn_size, mamba_heads (per layer, a multiple of n_groups), mamba_head_dim,
  attn_heads (query heads per layer, a multiple of num_key_value_heads), experts, expert_ffn_size,
  shared_expert_size, latent_size (LatentMoE: fc1/fc2_latent_proj and the experts' inputs/outputs, per
  layer by `layers.i.latent`), linear_key_heads / linear_value_heads (Gated DeltaNet: value heads in whole
  groups of the kept key heads, at most each one's own; key heads alone keep their value heads),
  linear_key_head_dim, linear_value_head_dim, num_layers | drop_layers.
Depth is counted in the source family's decoder layers (models.families: one of our layers for
Nemotron-H, the attention + MLP/MoE pair for the Llama family, dropped together so the result stays
exportable); `drop_layers` uses that numbering too. `num_layers` drops the layers with the lowest
`loss_increase` when the scores have it (the direct measure: what removing that layer alone costs in
LM loss, MiniPuzzle), else the lowest `block_importance` (1 - cos(x_in, x_out), Minitron); for a
decoder-layer pair the two per-character scores are summed. Where the family places its layer types by a rule (Jamba's
period and offset) and those layers break it: the set it can write of lowest summed score (depth_forms.choose_any).

Each kind's own width rules (LayerKind.target_problem) are asked for every changed width. Experts with
grouped routing (n_group > 1) are kept group-aware like Mamba heads (the same number in
every group); an expert count below num_experts_per_tok, or one the groups cannot hold, is refused.
Refused as not loadable by transformers: MoE expert_ffn_size / hidden_size (latent_size for a
LatentMoE) not a multiple of models.moe.MOE_ALIGN (its grouped expert matmul needs 16-byte rows in bf16), a
hidden size not a multiple of the query heads where the family's config demands it (models.families), even
with an explicit head_dim.

validate_targets -> plan_keep (scores -> keep dict, see compress/axes.py) -> new_config + prune_tensor.
"""
from __future__ import annotations

import copy

import torch

from remodel.models.config import ModelConfig, path_of
from remodel.models.errors import RemodelError
from remodel.models.families import depth_units as layer_units, family as family_of
from remodel.models.families.depth_forms import choose_any
from remodel.models.hf import check_exportable, config_to_hf, default_family
from remodel.models.kinds import KINDS, PRUNABLE, WIDTHS, layer_kinds, used, widths
from remodel.models.spec import top

from .axes import dim_indices, layer_of, select, tensor_axes

AXES = {n: WIDTHS[n] for n in PRUNABLE}  # target -> its Width (declared by its kind, models.kinds)
TARGETS = tuple(AXES) + ("num_layers", "drop_layers")


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _nearest(v: int, step: int, hi: int) -> str:
    lo = v // step * step
    vals = [x for x in (lo, lo + step) if 0 < x <= hi]
    return " or ".join(map(str, vals)) if vals else "none"


# ---- depth units ------------------------------------------------------------------------------

def parse_layers(v) -> list[int]:
    if isinstance(v, str):
        try:
            return [int(x) for x in v.replace(" ", "").split(",") if x]
        except ValueError:
            raise RemodelError(f"--drop-layers {v!r} is not a comma-separated list of layer indices") from None
    return [int(x) for x in v]


def depth_metric(scores: dict) -> str:
    return "loss_increase" if "loss_increase" in scores else "block_importance"


# ---- validation (before any calibration or I/O) ----------------------------------------------

def _check_depth(cfg, t, units):
    n = len(units)
    word = "layers" if len(units[0]) == 1 else "decoder layers"
    if "num_layers" in t and "drop_layers" in t:
        raise RemodelError("--num-layers and --drop-layers are exclusive; give one of them")
    if "num_layers" in t and t["num_layers"] >= n:
        raise RemodelError(f"--num-layers {t['num_layers']} does not remove any of the source's {n} {word}; "
                           f"nearest valid: {n - 1}")
    if "drop_layers" in t:
        drop = parse_layers(t["drop_layers"])
        if not drop:
            raise RemodelError("--drop-layers is empty; name the layers to drop, e.g. 3,7")
        for j in drop:
            if not 0 <= j < n:
                raise RemodelError(f"--drop-layers index {j} is out of range (the model has {word} 0..{n - 1})")
        if len(set(drop)) != len(drop):
            raise RemodelError(f"--drop-layers lists a layer twice: {t['drop_layers']}")
        if len(drop) >= n:
            raise RemodelError(f"--drop-layers would drop every one of the {n} {word}; keep at least one")


def validate_targets(cfg: ModelConfig, targets: dict, family: str | None = None) -> dict:
    """Refuse impossible targets with one line naming the nearest valid values. -> the targets
    that are set (None values removed; drop_layers parsed to a sorted list)."""
    family = family or default_family(cfg)
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise RemodelError(f"unknown pruning targets {unknown} (known: {', '.join(TARGETS)})")
    t = {k: v for k, v in targets.items() if v is not None}
    if not t:
        raise RemodelError("nothing to prune: give at least one target (e.g. --hidden-size, --ffn-size, --num-layers)")
    for key, v in t.items():
        if key != "drop_layers":
            _check_value(cfg, key, v)
    _check_groups(cfg, t)
    _check_kind_rules(cfg, t)
    units = layer_units(cfg, family)
    _check_depth(cfg, t, units)
    if "drop_layers" in t:
        t["drop_layers"] = sorted(parse_layers(t["drop_layers"]))
    _check_exportable_target(cfg, t, units, family)
    return t


def _check_value(cfg: ModelConfig, key: str, v) -> None:
    """One width target: a positive integer no larger than the source, on an axis the model has."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise RemodelError(f"{flag(key)} must be an integer, got {v!r}")
    if v <= 0:
        raise RemodelError(f"{flag(key)} must be positive, got {v}")
    if key == "num_layers":
        return
    w = AXES[key]
    field = w.field
    if w.layer is not None and not any(key in k.widths for k in used(cfg, mtp=False)):  # no kind present has the width
        raise RemodelError(f"{flag(key)}: the model has no {KINDS[w.layer].name} layers (pattern {cfg.pattern})")
    src = w.of(cfg)
    if not src:
        raise RemodelError(f"{flag(key)}: the model has no {w.absent or w.help}")
    if v > src:
        raise RemodelError(f"{flag(key)} {v} is larger than the source's {field}={src}; "
                           f"pruning only removes units (nearest valid: {src})")


def group_width(name: str) -> str | None:
    """The prunable width that counts the groups width `name` is made of whole of (Width.multiple_of), when that
    count is itself pruned (Gated DeltaNet: key heads, for the value heads); None: the groups are fixed."""
    of = WIDTHS[name].multiple_of
    return next((n for n, w in AXES.items() if of and w.field == of), None)


def kept_widths(cfg: ModelConfig, t: dict) -> dict:
    """{width: what pruning to the targets t keeps} of the width targets in t and of the widths they imply: a width
    of whole groups whose groups are pruned keeps, when not targeted itself, every member of the kept groups
    (--linear-key-heads alone keeps the value heads of the kept key heads, as GATED_DELTANET.keep does)."""
    out = {k: v for k, v in t.items() if k in AXES}
    for name, w in AXES.items():
        g = group_width(name)
        if g in out and name not in out and w.of(cfg, w.multiple_of):
            out[name] = w.of(cfg) // w.of(cfg, w.multiple_of) * out[g]
    return out


def _check_groups(cfg: ModelConfig, t: dict) -> None:
    """Each width in whole groups where its spec says so (models.spec.Width.multiple_of: Mamba heads in
    whole groups, query heads in whole KV groups, Gated DeltaNet value heads in whole key-head groups), of the
    groups that are kept: where the group count is pruned too (key heads), the kept count, and at most the members
    those groups hold (a kept key head keeps at most its own value heads)."""
    for name, w in WIDTHS.items():
        src_g = w.of(cfg, w.multiple_of) if w.multiple_of and name in t else None
        if not src_g:
            continue
        gw, v = group_width(name), t[name]
        g = t.get(gw, src_g)
        most = w.of(cfg) // src_g * g  # the members of the kept groups
        groups = f"{flag(gw)} {g}" if gw in t else f"{w.multiple_of}={g}"
        if v % g:
            raise RemodelError(f"{flag(name)} {v} is not a multiple of {groups}{w.why}; "
                               f"nearest valid: {_nearest(v, g, most)}")
        if v > most:
            raise RemodelError(f"{flag(name)} {v} is more than the groups kept by {groups} hold ({most // g} each, "
                               f"{most} in all); nearest valid: {most}")


def _check_kind_rules(cfg: ModelConfig, t: dict) -> None:
    """Each changed width as every trunk kind's own rules allow (LayerKind.target_problem: expert counts the
    router can use, expert rows transformers can load), with the nearest widths that they allow."""
    kinds = used(cfg, mtp=False)
    for key, v in t.items():
        if key not in AXES or v == (src := AXES[key].of(cfg)):
            continue
        why = next((w for k in kinds if (w := k.target_problem(cfg, key, v))), None)
        if why:
            ok = lambda x: not any(k.target_problem(cfg, key, x) for k in kinds)  # noqa: E731
            near = [x for x in range(v, 0, -1) if ok(x)][:1] + [x for x in range(v, src + 1) if ok(x)][:1]
            raise RemodelError(f"{flag(key)} {v} {why}; nearest valid: {' or '.join(map(str, near)) or 'none'}")


def _nearest_valid(cfg: ModelConfig, target: ModelConfig, t: dict, rule) -> str:
    """The nearest widths of the one the user changed (the first of the rule's that was a target) that the
    rule allows, the others as targeted (at most the source's)."""
    w = widths(target)
    name = next((n for n in rule.of + rule.by if n in t), (rule.of + rule.by)[0])
    src = WIDTHS[name].of(cfg)
    ok = [v for v in range(src, 0, -1) if rule.holds({**w, name: v})]
    near = sorted(ok, key=lambda v: (abs(v - w[name]), -v))[:2]
    return f"{flag(name)} " + (" or ".join(map(str, sorted(near))) if near else "none")


def _check_exportable_target(cfg: ModelConfig, t: dict, units: list, family: str) -> None:
    """The whole target must still be a valid, exportable model of the source family."""
    sizes = {AXES[k].path: v for k, v in kept_widths(cfg, t).items()}
    if "drop_layers" in t or "num_layers" in t:
        kept = ([u for j, u in enumerate(units) if j not in t["drop_layers"]] if "drop_layers" in t
                else units[:t["num_layers"]])
        sizes["pattern"] = "".join(cfg.pattern[i] for u in kept for i in u)
    target = cfg.replace(**sizes)  # ModelConfig's own checks
    try:
        check_exportable(cfg, family)
    except RemodelError:
        return  # an in-memory model no family can hold: nothing more to keep
    check_exportable(target, family)
    w = widths(target)
    for rule in family_of(family).width_rules:  # the constraints the family's config imposes between widths
        if not rule.holds(w):
            raise RemodelError(f"{rule.refusal(w, family)}; nearest valid: {_nearest_valid(cfg, target, t, rule)}")
    config_to_hf(target, family)  # transformers' own config checks, still before any work


# ---- ranking ----------------------------------------------------------------------------------

def _score(scores: dict, name: str, shape: tuple, why: str) -> torch.Tensor:
    s = scores.get(name)
    if s is None:
        raise RemodelError(f"the scores have no {name!r} (needed for {why}); re-run `remodel score` on this model")
    if tuple(s.shape) != tuple(shape):
        raise RemodelError(f"scores {name!r} has shape {list(s.shape)}, the model implies {list(shape)}")
    nan = int(torch.isnan(s).sum())
    if nan:  # a unit scored NaN would rank anywhere: the kept set would be arbitrary
        raise RemodelError(f"scores {name!r} hold {nan} NaN value(s) of {s.numel()} (needed for {why}); "
                           "re-run `remodel score` or give other --scores")
    return s.float()


def plan_keep(cfg: ModelConfig, scores: dict, targets: dict, family: str | None = None) -> dict:
    """Scores + targets -> keep dict (sorted original indices per primary axis; see compress/axes.py)."""
    t = validate_targets(cfg, targets, family)
    keep = {}
    if "hidden_size" in t:
        keep["hidden"] = top(_score(scores, "hidden", (cfg.hidden_size,), "--hidden-size"), t["hidden_size"])
    for i, k in enumerate(layer_kinds(cfg)):  # each kind's keep rule (models.spec.LayerKind.keep)
        keep.update(k.keep(cfg, lambda *a: _score(scores, *a), t, f"layers.{i}."))
    for j, c in enumerate(cfg.mtp_full_pattern):
        mtp = _mtp_scores(cfg, scores, j)
        keep.update(KINDS[c].keep(cfg, lambda *a, s=mtp: _score(s, *a), t, f"mtp.layers.{j}."))
    units = layer_units(cfg, family)
    drop = []
    if "drop_layers" in t:
        drop = t["drop_layers"]
    elif "num_layers" in t:
        m = depth_metric(scores)
        s = _score(scores, m, (cfg.num_layers,), "--num-layers")
        per_unit = torch.stack([s[u].sum() for u in units])
        drop = top(-per_unit, len(units) - t["num_layers"]).tolist()
        drop = choose_any(cfg, family or default_family(cfg), per_unit.tolist(), drop)  # a set the family can write
    if drop:
        keep["layers"] = torch.tensor([i for j, u in enumerate(units) if j not in drop for i in u])
        gone = {f"layers.{i}." for j in drop for i in units[j]}
        keep = {k: v for k, v in keep.items() if not any(k.startswith(g) for g in gone)}
    return keep


def _mtp_scores(cfg: ModelConfig, scores: dict, j: int) -> dict:
    """`scores` for MTP block j: its own (`mtp.layers.j.*`, from an activation run, which runs the
    head: compress/importance.py), and for any it lacks (data-free baselines, scores from before MTP
    support) the last trunk layer of its kind's, as a stand-in that keeps its widths the trunk's."""
    c, own = cfg.mtp_full_pattern[j], f"mtp.layers.{j}."
    if c not in cfg.pattern:
        return scores
    src = f"layers.{cfg.pattern.rindex(c)}."
    return {**{own + k[len(src):]: v for k, v in scores.items() if k.startswith(src)}, **scores}


# ---- the pruned model ---------------------------------------------------------------------------

def kept_layers(cfg: ModelConfig, keep: dict) -> list[int]:
    return keep["layers"].tolist() if "layers" in keep else list(range(cfg.num_layers))


def _size(cfg, keep, layers, kind, axis, full):
    blocks = [f"layers.{i}" for i in layers if cfg.pattern[i] == kind]
    blocks += [f"mtp.layers.{j}" for j, c in enumerate(cfg.mtp_full_pattern) if c == kind]  # same widths
    sizes = {full if keep.get(f"{b}.{axis}") is None else keep[f"{b}.{axis}"].shape[-1] for b in blocks}
    if len(sizes) > 1:
        raise RemodelError(f"keep sets give {KINDS[kind].name} layers different {axis} sizes {sorted(sizes)}; "
                           "widths must be the same in every layer of a type")
    return sizes.pop() if sizes else full


def new_config(cfg: ModelConfig, keep: dict) -> ModelConfig:
    layers = kept_layers(cfg, keep)
    if not layers:
        raise RemodelError("pruning would remove every layer")
    sizes = {path_of(field, k.section_name): _size(cfg, keep, layers, c, unit, cfg.get(field, k.section_name))
             for c, k in KINDS.items() if k in used(cfg) for unit, field in k.units.items()}  # each present kind's units
    return cfg.replace(pattern="".join(cfg.pattern[i] for i in layers),
                       hidden_size=len(keep["hidden"]) if "hidden" in keep else cfg.hidden_size,
                       **sizes, extra=copy.deepcopy(cfg.extra))


def rename(name: str, keep: dict) -> str | None:
    """Our name in the pruned model (layers renumbered), or None when its layer is dropped."""
    i = layer_of(name)
    if i is None or "layers" not in keep:
        return name
    pos = (keep["layers"] == i).nonzero()
    if len(pos) == 0:
        return None
    return f"layers.{int(pos[0, 0])}." + name.split(".", 2)[2]


def prune_tensor(name: str, tensor: torch.Tensor, cfg: ModelConfig, keep: dict, table: dict | None = None):
    """Slice one of our tensors (original name) to the kept units of every axis it runs over."""
    return select(tensor, dim_indices(cfg, keep, name, table))


def prune_state(state: dict, cfg: ModelConfig, keep: dict) -> tuple[ModelConfig, dict]:
    """In-memory: our state dict -> (pruned config, pruned state dict with renumbered names)."""
    table, out = tensor_axes(cfg), {}
    for name, t in state.items():
        new = rename(name, keep)
        if new is not None and name in table:
            out[new] = prune_tensor(name, t, cfg, keep, table)
    return new_config(cfg, keep), out


@torch.no_grad()
def prune_model(model, keep: dict):
    """In-memory: HybridLM -> pruned HybridLM (for search and tests; checkpoints go through pipelines.commands.prune)."""
    from remodel.models.model import HybridLM

    cfg, state = prune_state(model.state_dict(), model.cfg, keep)
    like = next(model.parameters())
    new = HybridLM(cfg).to(device=like.device, dtype=like.dtype)  # the source's device and dtype
    new.load_state_dict(state, strict=True)
    return new.eval()
