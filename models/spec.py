"""The spec of a layer kind: what every operation (scoring, pruning, search, inspect, upcycling,
parallelism) reads about a kind instead of testing its pattern character.

Each kind module (models/mamba.py, attention.py, mlp.py, moe.py) holds its nn.Module and one
`LayerKind` instance; models/kinds.py lists them. A new kind is one such module and one registry line.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


# ---- the width vocabulary: the `remodel prune` / `plan` flags, the search axes, the config fields ----
@dataclass(frozen=True)
class Width:
    """One model width, declared once by the kind that owns it (LayerKind.declares; the trunk's in
    TRUNK_WIDTHS). name: flag / search axis; field: its config field; layer: the layer char of the kind
    that declares it (None: every layer; filled in by models/kinds.py); unit: the keep-dict axis it prunes (None: not prunable); divisor: the
    search-space step (None: a multiple of the groups, or not searched); short: a table column label;
    multiple_of: the ModelConfig field whose value every kept width is a multiple of (the search step too),
    why: what that rule keeps whole; step_lcm: a field the search step is also a multiple of when > 1;
    absent: what the model lacks when the field is 0 or None."""
    name: str
    field: str
    layer: str | None
    unit: str | None
    divisor: int | None
    short: str
    help: str
    multiple_of: str | None = None
    why: str = ""
    step_lcm: str | None = None
    absent: str = ""  # what a model lacks when the field is 0 / None (an optional part of its kind)
    section: str | None = None  # the config section holding `field` (None: the trunk; filled in by its kind)

    @property
    def path(self) -> str:
        """Its field's path in ModelConfig ("hidden_size", "mamba.mamba_num_heads")."""
        return f"{self.section}.{self.field}" if self.section else self.field

    def of(self, cfg, name: str | None = None):
        """This width's size in `cfg`, or of its sibling field `name` (multiple_of, step_lcm)."""
        if name is None:
            return cfg.value(self.path)
        return cfg.value(f"{self.section}.{name}" if self.section else name)


TRUNK_WIDTHS = (
    Width("vocab_size", "vocab_size", None, None, None, "vocab", "vocabulary size"),
    Width("hidden_size", "hidden_size", None, "hidden", 256, "hidden", "residual width (embedding channels)"))
# {name: Width}: the trunk's, then each kind's own declarations, entered as the kind is made
# (LayerKind.__post_init__): a kind's methods see every width it reads. models.kinds.WIDTHS is this
# registry once every kind is made (the one the prune / plan flags and the search read).
WIDTHS: dict = {w.name: w for w in TRUNK_WIDTHS}


def widths(cfg, **changes) -> dict:
    """{width name: size} of `cfg`, with `changes` applied (any value, even 0: nothing is validated)."""
    return {**{n: w.of(cfg) or 0 for n, w in WIDTHS.items() if cfg.reads(w.section)}, **changes}


@dataclass(frozen=True)
class Param:
    """A parameter of a layer kind: its name under the mixer, one axis per dimension, and the
    conditions (ModelConfig flags, or names in models.layout's conditions) that must all hold for it to exist."""
    leaf: str
    axes: tuple
    when: tuple = ()


def mlp_params(prefix: str, unit: str, bias: tuple, present: tuple = (), gated: str = "mlp_gated") -> tuple:
    """up/gate/down of a (gated) MLP over `unit`; the gate when the flag `gated` holds, biases when every flag of
    `bias` holds."""
    out = (Param(prefix + "up_proj.weight", (unit, "hidden"), present),
           Param(prefix + "gate_proj.weight", (unit, "hidden"), present + (gated,)),
           Param(prefix + "down_proj.weight", ("hidden", unit), present))
    if bias:
        out += (Param(prefix + "up_proj.bias", (unit,), bias), Param(prefix + "gate_proj.bias", (unit,), bias + (gated,)),
                Param(prefix + "down_proj.bias", ("hidden",), bias))
    return out


@dataclass(frozen=True)
class Site:
    """An activation-importance site: score `name` accumulated from the input (or output) of the
    submodule `module` of the mixer, columns `part` of it (None: all), times the input-column norm of
    the weight `norm_of` when given (Wanda-style)."""
    name: str
    module: str
    read: str = "input"  # or "output"
    part: slice | None = None
    norm_of: str | None = None


def top(s: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest (ties: lower index first), in increasing order."""
    return torch.argsort(s, descending=True, stable=True)[:k].sort().values


def top_per_group(s: torch.Tensor, groups: int, k_total: int) -> torch.Tensor:
    """Keep k_total/groups of the largest within every one of `groups` equal contiguous groups."""
    r, k = s.numel() // groups, k_total // groups
    return torch.cat([g * r + top(s[g * r:(g + 1) * r], k) for g in range(groups)])


def sq(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum of squares over every dimension but `dim` -> 1-D (a weight's per-unit squared norm)."""
    return t.square().sum(dim=[d for d in range(t.dim()) if d != dim]) if t.dim() > 1 else t.square()


@dataclass(frozen=True)
class LayerKind:
    """One layer kind. char: its pattern character; name: its word ('mamba'); params: its layout (every
    parameter with named axes); units: the keep-dict axes it prunes, each with the ModelConfig field it
    sets; tp_plan: its tensor-parallel plan (pipelines.distributed.styles applies it); sizes: {axis: size(cfg, widths)} of the axes it owns; segments: {axis: ((segment, axis), ...)}
    of its concatenated axes, in storage order; products: composite axes indexed as outer unit x inner axis ('attn_q' = heads x head_dim);
    scored: {score site: its axes}, the scores an activation run writes for one layer; widths: the
    WIDTHS it reads; tp_axes: the axes tensor parallelism splits; inputs: what its mixer
    reads beside the hidden states; routed: it holds routed experts (top-k of E per token)."""
    char: str
    name: str
    params: tuple
    units: dict = field(default_factory=dict)
    sizes: dict = field(default_factory=dict)
    segments: dict = field(default_factory=dict)
    products: dict = field(default_factory=dict)
    scored: dict = field(default_factory=dict)
    widths: tuple = ()
    declares: tuple = ()  # the Widths this kind owns (their layer is filled in by models/kinds.py)
    tp_axes: tuple = ()
    fixed: tuple = ()  # its axes pruning never cuts (a conv kernel, SSM B/C groups)
    hidden_units: tuple = ()  # its keep-dict axes sized as hidden_size: hidden pruning keeps as many (its keep picks)
    inputs: tuple = ()
    routed: bool = False
    upcycles_to: str | None = None  # the kind (pattern character) its layers become when upcycled to MoE
    # tensor parallelism, as data: {submodule path ('' the mixer): style}; styles: 'colwise' / 'rowwise'
    # (DTensor's stock Linear styles), 'shard' (its own parameters cut segment by segment as the layout
    # table says), 'shard_entry' (that, and its input enters the parallel region), 'shared_norm' (one
    # replicated weight serving this rank's heads). Every TP-split parameter's module must have an entry.
    tp_plan: dict = field(default_factory=dict)
    color: str = "tab:gray"  # in the per-layer figures
    config: type | None = None  # its config section (models/section.py); ModelConfig holds one instance
    post_norm: bool = False  # the block normalises the mixer's output (x + norm(mixer(x)), OLMo 2) not its input
    section: str = ""  # the config section it reads when another kind declares it (default: its own name)
    reads: tuple = ()  # further sections its module reads (a composed kind's parts'; MoE's experts: the MLP's act)

    def __post_init__(self):
        """Enter the widths this kind declares in WIDTHS, under its layer character (once: a second kind
        declaring one of them is refused)."""
        for w in self.declares:
            w = replace(w, layer=self.char, section=self.section_name)
            if WIDTHS.setdefault(w.name, w) != w:
                raise ValueError(f"width {w.name!r} declared twice (kind {self.name!r})")

    @property
    def section_name(self) -> str:
        """The name of the config section this kind reads (its own, or the kind it derives from)."""
        return self.section or self.name

    @property
    def sections(self) -> tuple:
        """Every config section this kind's module is given (ModelConfig.view): its own and `reads`."""
        return (self.section_name, *self.reads)

    @property
    def norm_name(self) -> str:
        """The block's norm module: 'norm' before the mixer, 'post_norm' after it (its own checkpoint name)."""
        return "post_norm" if self.post_norm else "norm"

    # ---- axes ---------------------------------------------------------------------------
    def axis_size(self, cfg, axis: str, w: dict | None = None) -> int:
        """Size of one of this kind's axes under the widths w (default: cfg's own)."""
        w = w or widths(cfg)
        if axis in self.segments:
            return sum(self.sizes[a](cfg, w) for _, a in self.segments[axis])
        return self.sizes[axis](cfg, w)

    def segment_sizes(self, cfg, axis: str) -> dict:
        """{segment: size} of a concatenated axis, in storage order."""
        w = widths(cfg)
        return {name: self.sizes[a](cfg, w) for name, a in self.segments[axis]}

    def segment_span(self, cfg, axis: str, first: str, last: str | None = None) -> slice:
        """The slice of a concatenated axis holding the segments first..last (inclusive)."""
        sizes = self.segment_sizes(cfg, axis)
        names = list(sizes)
        start = sum(sizes[n] for n in names[:names.index(first)])
        return slice(start, start + sum(sizes[n] for n in names[names.index(first):names.index(last or first) + 1]))

    # ---- the model --------------------------------------------------------------------
    def slot_section(self, section):
        """The config section a slot of this kind reads, given its kind's section (a derived kind may vary it)."""
        return section

    def build(self, cfg):
        """The rank-free nn.Module of one layer of this kind."""
        raise NotImplementedError

    def validate(self, cfg, need) -> None:
        """ModelConfig checks of the fields this kind reads (need(ok, message))."""

    def summary(self, cfg) -> dict:
        """The config fields `remodel inspect` shows for this kind."""
        return {}

    # ---- counts -------------------------------------------------------------------------
    def cache_bytes(self, cfg, w: dict, batch: int, seq_len: int, kv_bytes: int = 2, state_bytes: int = 4,
                    conv_bytes: int = 2) -> dict:
        """{cache name: bytes} of one layer's inference cache at widths w."""
        return {}

    def init_param(self, cfg, local: str, p, g, std: float) -> bool:
        """Initialise `local` (a parameter of this kind's mixer: A_log, dt_bias, a conv) in place as transformers'
        _init_weights does for it, drawing from generator g; False: the generic rule (Linear weights normal(std),
        biases zero, norms one) applies."""
        return False

    def head_units(self, cfg) -> list:
        """[(score name, [channel index per unit])]: the heads (or head groups) whose removal the leave-one-out
        scorer measures (compress/head_loo.py), as channels of the input remove_channels masks."""
        return []

    def measured_units(self, cfg) -> list:
        """The head_units the default criterion (`score --method activation_measured`) ranks by their measured
        leave-one-out cost over the loss batches rather than by activation: units few per layer (a forward each)
        where the bench found activation blind (issue 55). Default: none."""
        return []

    def remove_channels(self, mixer, keep, fired):
        """Remove, until the returned handle's remove(), the channels not in `keep` (bool) of the mixer as pruning
        them would; `fired()` is called each time the removal applies (a fused kernel may skip it)."""
        raise NotImplementedError(f"{self.name} has no removable head units")

    @staticmethod
    def zero_inputs(linear, keep, fired):
        """remove_channels for a kind whose heads end in per-head work: a pre-hook zeroing `linear`'s input
        channels not in `keep` (its output projection's)."""
        def hook(module, args):
            fired()
            return (args[0] * keep.to(device=args[0].device, dtype=args[0].dtype),) + tuple(args[1:])
        return linear.register_forward_pre_hook(hook)

    state_row = ""  # the `inspect` row of its inference state ('KV cache'); every cache_bytes name adds to it

    def state_rows(self, cfg, w: dict, batch: int, seq_len: int, bytes_: tuple = (2, 4, 2)) -> dict:
        """{inspect row: bytes} of one layer's inference state: the row each kind names for itself."""
        b = sum(self.cache_bytes(cfg, w, batch, seq_len, *bytes_).values())
        return {self.state_row: b} if b else {}

    def buffer_elements(self, cfg, w: dict) -> int:
        """Elements of the fp32 buffers one layer stores (not parameters)."""
        return 0

    def mixing_flops(self, cfg, seq_len: int) -> int:
        """Forward FLOPs per token beyond its parameters' matmuls (attention: scores and values)."""
        return 0

    # ---- compression ----------------------------------------------------------------------
    def sites(self, cfg) -> tuple:
        """The activation-importance Sites of one layer (routed kinds add their own recording)."""
        return ()

    def in_sites(self, cfg) -> tuple:
        """The Sites of `score --method activation_in`: a kind whose default reads a unit past its input projection
        names the input projection's reading here (Mamba-2's former default); every other kind reads as sites()."""
        return self.sites(cfg)

    def keep(self, cfg, score, t: dict, p: str) -> dict:
        """Keep entries (prefix p) of one layer from its scores under the width targets t;
        score(site, shape, flag) returns the checked score tensor."""
        return {}

    def magnitude(self, cfg, local: str, t: torch.Tensor) -> list:
        """[(site, squared-norm term)] a tensor (its name under the mixer) adds to the layer's
        data-free magnitude scores."""
        return []

    def target_problem(self, cfg, width: str, v: int) -> str | None:
        """Why its layers cannot hold `v` as the width `width` (a rule beyond Width.multiple_of), as the
        words after '--flag v'; None: they can. Pruning and the search both ask it."""
        return None

    def check_tp(self, cfg, tp: int, need) -> None:
        """Refuse widths tensor parallelism over tp ranks cannot split."""
