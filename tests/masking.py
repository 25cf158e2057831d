"""The honest zero-masked reference of a width-pruned model, written by hand (not from the axes table):
the unpruned model with every dropped unit's output zeroed (and the norms and routers that would still see
it patched), whose logits pruning must reproduce (tests/test_families.py on every family's axes, and
tests/test_prune.py). An axis or layer kind it does not know fails loudly: a new one brings its masking here."""
import copy

import torch
import torch.nn.functional as F

from remodel.models.mamba import Gate, RMSNormThenGate
from remodel.models.moe import wide


def dropped(kept, n):
    m = torch.ones(n, dtype=torch.bool)
    m[kept] = False
    return m.nonzero()[:, 0]


def _kept_mean_rmsnorm(norm, n_kept):
    """Hidden RMSNorm over the kept channels only. The masked residual stream is exactly zero on the
    dropped channels, so sum(x^2) is the kept channels' sum; the pruned model divides it by H', the
    unpruned one would divide by H. This patch divides by H' (what pruning does), nothing else."""
    def forward(x):
        dtype, cd = x.dtype, torch.promote_types(x.dtype, torch.float32)
        x = x.to(cd)
        x = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / n_kept + norm.eps)
        return ((norm.weight.to(cd) + norm.offset) * x).to(dtype)
    norm.forward = forward


def _masked_group_norm(gn, mask):
    """Mamba's gated group RMSNorm averages y*silu(z) (or y, norm before gate) over each group's channels.
    Zeroing the dropped heads' out_proj columns hides their output but not their share of that average, so
    the reference zeroes them *before* the norm and averages over the kept channels of each group (every
    group keeps the same number, as group-aware pruning guarantees) -- exactly what the sliced norm computes.
    Without a norm (Falcon-H1's Gate) the zeroed out_proj columns are all there is to it."""
    if isinstance(gn, Gate):
        return
    G, before = gn.groups, isinstance(gn, RMSNormThenGate)
    kept_per_group = mask.view(G, -1).sum(-1)

    def forward(y, z):
        y = (y.float() if before else y.float() * F.silu(z.float())) * mask
        yg = y.view(*y.shape[:-1], G, -1)
        yg = yg * torch.rsqrt(yg.pow(2).sum(-1, keepdim=True) / kept_per_group[:, None] + gn.eps)
        out = gn.weight * yg.view(y.shape)
        return out * F.silu(z.float()) if before else out
    gn.forward = forward


def _masked_softmax_router(gate, drop):
    """Softmax router that can never select a dropped expert: its logit is -inf, so the softmax runs
    over the kept experts only -- what slicing the router rows computes."""
    cfg = gate.cfg

    def forward(x):
        logits = F.linear(wide(x), wide(gate.weight), None if gate.bias is None else wide(gate.bias))  # (as the router)
        logits[:, drop] = float("-inf")
        w, idx = logits.softmax(-1).topk(cfg.moe.num_experts_per_tok, dim=-1)
        if cfg.moe.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return logits, w * cfg.moe.routed_scaling_factor, idx
    gate.forward = forward


def _parts(layer):
    """{kind character: module} of a layer's mixer: itself, or a parallel mixer's attention and Mamba."""
    m = layer.mixer
    return {"*": m.attn, "M": m.mamba} if layer.kind == "P" else {layer.kind: m}


def _outputs(layer):
    """The Linears (or the experts' down_proj tensor) that write the layer's output to the residual stream."""
    outs = []
    for c, m in _parts(layer).items():
        if c == "E":
            outs += [m.experts.down_proj] + ([m.shared_experts.down_proj] if m.shared_experts is not None else [])
            outs += [m.experts.down_proj_bias] if m.cfg.moe.expert_bias else []
        else:
            outs.append(getattr(m, {"M": "out_proj", "*": "o_proj", "A": "o_proj", "F": "o_proj", "-": "down_proj",
                                       "=": "down_proj", "D": "out_proj", "C": "out_proj", "S": "out_proj",
                                       "L": "o_proj"}[c]))
    return outs


def _mask_hidden(ref, kept):
    d = dropped(kept, ref.cfg.hidden_size)
    ref.embeddings.weight[:, d] = 0  # the residual stream starts, and stays, zero on d
    for layer in ref.layers:
        for out in _outputs(layer):
            if isinstance(out, torch.nn.Linear):
                out.weight[d] = 0
                if out.bias is not None:
                    out.bias[d] = 0
            else:  # experts' down_proj [E, H, F] (or their biases [E, H])
                out[:, d] = 0
        _kept_mean_rmsnorm(layer.norm, len(kept))
    _kept_mean_rmsnorm(ref.norm_f, len(kept))


def _mask_mamba(cfg, m, keep, p):
    mask = torch.zeros(cfg.mamba.mamba_num_heads, cfg.mamba.mamba_head_dim)
    heads = keep.get(p + "mamba_heads", torch.arange(cfg.mamba.mamba_num_heads))
    chans = keep.get(p + "mamba_head_dim", torch.arange(cfg.mamba.mamba_head_dim))
    mask[heads[:, None], chans[None, :]] = 1
    mask = mask.reshape(-1)
    m.out_proj.weight[:, mask == 0] = 0
    _masked_group_norm(m.norm, mask)


def _mask_gdn(cfg, m, keep, p):
    """Gated DeltaNet: dropped value heads (a dropped key-head group's among them) and value channels write
    nothing through out_proj; dropped value channels and key channels are zero inputs of the rule (zero rows of
    q / k / v projections: the state never holds them, the L2 norms do not see them). The per-head gated norm then
    averages over the kept value channels, and q's scale dk**-0.5 becomes dk'**-0.5: the rule's output is
    linear in q, so the norm's input is scaled by sqrt(dk / dk') -- what the sliced model computes."""
    hk, hv, dk, dv = (cfg.gated_deltanet.linear_num_key_heads, cfg.gated_deltanet.linear_num_value_heads, cfg.gated_deltanet.linear_key_head_dim,
                      cfg.gated_deltanet.linear_value_head_dim)
    heads = keep.get(p + "lin_v_heads", torch.arange(hv))
    vch, kch = keep.get(p + "lin_dv", torch.arange(dv)), keep.get(p + "lin_dk", torch.arange(dk))
    mask = torch.zeros(hv, dv)
    mask[heads[:, None], vch[None, :]] = 1
    m.out_proj.weight[:, mask.reshape(-1) == 0] = 0
    for h in range(hv):
        m.in_proj_v.weight[h * dv + dropped(vch, dv)] = 0
    for h in range(hk):
        m.in_proj_q.weight[h * dk + dropped(kch, dk)] = 0
        m.in_proj_k.weight[h * dk + dropped(kch, dk)] = 0
    norm, n, c = m.norm, len(vch), (dk / len(kch)) ** 0.5

    def forward(x, gate):
        cd = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(cd) * c
        xf = xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) / n + norm.eps)
        return (norm.weight * xf.to(x.dtype) * F.silu(gate.to(cd))).to(x.dtype)
    norm.forward = forward


def _mask_full_q_norm(cfg, m, heads):
    """An all-heads q norm (qk_norm_full) of a pruned model sees only the kept heads: the dropped heads' query
    rows are zeroed and the norm divides by the kept channels."""
    hd = cfg.attention.head_dim
    for h in dropped(heads, cfg.attention.num_attention_heads):
        m.q_proj.weight[h * hd:(h + 1) * hd] = 0
        if m.q_proj.bias is not None:
            m.q_proj.bias[h * hd:(h + 1) * hd] = 0
    _kept_mean_rmsnorm(m.q_norm, len(heads) * hd)


def _mask_moe(cfg, m, keep, p):
    experts = keep.get(p + "experts", torch.arange(cfg.moe.n_routed_experts))
    if p + "experts" in keep and cfg.moe.router == "softmax":
        _masked_softmax_router(m.gate, dropped(experts, cfg.moe.n_routed_experts))
    elif p + "experts" in keep:
        # the router must never select a dropped expert: selection runs on score + correction bias, so a
        # -inf bias masks the selection logit (sigmoid(-inf logit) alone would leave the bias selectable);
        # kept experts' weights use the unbiased scores, as when sliced
        m.gate.e_score_correction_bias[dropped(experts, cfg.moe.n_routed_experts)] = float("-inf")
    if p + "expert_ffn" in keep:
        for row, e in enumerate(experts.tolist()):
            m.experts.down_proj[e][:, dropped(keep[p + "expert_ffn"][row], cfg.moe.moe_intermediate_size)] = 0
    if p + "shared_ffn" in keep:
        S = cfg.moe.moe_shared_expert_intermediate_size
        m.shared_experts.down_proj.weight[:, dropped(keep[p + "shared_ffn"], S)] = 0


KNOWN = {"hidden", "ffn", "attn_heads", "mamba_heads", "mamba_head_dim", "experts", "expert_ffn", "shared_ffn",
         "lin_k_heads", "lin_v_heads", "lin_dk", "lin_dv", "sc_inner", "m1_inner", "mla_heads"}


@torch.no_grad()
def masked_reference(model, keep):
    """A copy of `model` with everything `keep` drops zero-masked (see the module docstring)."""
    unknown = {k.rsplit(".", 1)[-1] for k in keep if k != "layers"} - KNOWN
    assert not unknown, f"tests/masking.py has no masking for the axes {sorted(unknown)}: add it"
    ref = copy.deepcopy(model)
    cfg = ref.cfg
    if "hidden" in keep:
        _mask_hidden(ref, keep["hidden"])
    for i, layer in enumerate(ref.layers):
        p = f"layers.{i}."
        for c, m in _parts(layer).items():
            if c in "-=" and p + "ffn" in keep:
                m.down_proj.weight[:, dropped(keep[p + "ffn"], cfg.mlp.intermediate_size)] = 0
            if c in "*AF" and p + "attn_heads" in keep:
                for h in dropped(keep[p + "attn_heads"], cfg.attention.num_attention_heads):
                    m.o_proj.weight[:, h * cfg.attention.head_dim:(h + 1) * cfg.attention.head_dim] = 0
                if cfg.attention.qk_norm_full:  # the q norm averages over the kept heads' channels: zero queries, kept mean
                    _mask_full_q_norm(cfg, m, keep[p + "attn_heads"])
            if c == "M" and (p + "mamba_heads" in keep or p + "mamba_head_dim" in keep):
                _mask_mamba(cfg, m, keep, p)
            if c == "E":
                _mask_moe(cfg, m, keep, p)
            if c == "D" and any(p + a in keep for a in ("lin_v_heads", "lin_dk", "lin_dv")):
                _mask_gdn(cfg, m, keep, p)
            if c == "C" and p + "sc_inner" in keep:  # a dropped channel of y = C * conv(B * x) writes nothing
                m.out_proj.weight[:, dropped(keep[p + "sc_inner"], m.out_proj.weight.shape[1])] = 0
            if c == "S" and p + "m1_inner" in keep:  # a dropped channel adds nothing to dt / B / C, writes nothing
                gone = dropped(keep[p + "m1_inner"], m.out_proj.weight.shape[1])
                m.x_proj.weight[:, gone], m.out_proj.weight[:, gone] = 0, 0
            if c == "L" and p + "mla_heads" in keep:  # a dropped MLA head's values write nothing through o_proj
                vd = cfg.mla.v_head_dim
                for h in dropped(keep[p + "mla_heads"], cfg.mla.mla_num_heads):
                    m.o_proj.weight[:, h * vd:(h + 1) * vd] = 0
            assert c in "*M-ED=ACSLF", f"tests/masking.py has no masking for layer kind {c!r}: add it"
    return ref
