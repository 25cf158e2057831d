"""AI21's Jamba (transformers' `jamba`, JambaForCausalLM): decoder layer j is our pair of layers 2j (a Mamba-1
mixer 'S', HF's `mamba`, or attention '*' without positional encoding, HF's `self_attn`; its norm HF's
input_layernorm) and 2j+1 (a SwiGLU MLP '-' or a softmax-routed MoE 'E', HF's `feed_forward`; its norm
pre_ff_layernorm), so the pattern is e.g. "S-*ES-SE". Attention sits where j % attn_layer_period ==
attn_layer_offset, experts where j % expert_layer_period == expert_layer_offset (transformers derives
layers_block_type and layers_num_experts from them: we write the smallest period and offset that give our
pattern). The router takes the top-k of a softmax over all experts and does not renormalise them; the experts
are as wide as the dense MLPs (intermediate_size). The Mamba-1 mixer's dt / B / C RMSNorms and every other norm
use rms_norm_eps. On disk each expert is its own gate_proj / up_proj / down_proj."""
from __future__ import annotations

from collections import Counter

from remodel.models.attention import ATTENTION
from remodel.models.config import MAX_LAYERS, ModelConfig
from remodel.models.kinds import used
from remodel.models.mamba1 import MAMBA1
from remodel.models.moe import MOE

from .family import Family, feed_forward_keys

BLOCK_TYPES = {"mamba": "S", "attention": "*"}  # HF layer type -> our mixer layer
_FFN = {False: "-", True: "E"}  # whether HF layer j has experts -> our feed-forward layer
_LEAVES = ("gate_proj", "up_proj", "down_proj")
# one config.json key sizes both the dense MLPs and each expert (HF's feed_forward of either kind)
ONE_KEY = {"intermediate_size": ("mlp.intermediate_size", "moe.moe_intermediate_size")}
_PERIODS = {k: (0, MAX_LAYERS) for k in ("attn_layer_period", "attn_layer_offset", "expert_layer_period",
                                         "expert_layer_offset")}


def period_of(flags: list) -> tuple[int, int] | None:
    """The smallest (period, offset), offset < period, with flags[j] == (j % period == offset); None if none.
    Linear in len(flags): two marked layers fix the period (their gap), one fixes the offset."""
    n, marked = len(flags), [j for j, f in enumerate(flags) if f]
    if not marked:
        return n + 1, n
    o = marked[0]
    if len(marked) == 1:
        return max(o + 1, n - o), o
    p = marked[1] - o
    ok = all((j % p == o) == bool(f) for j, f in enumerate(flags))
    return (p, o) if ok else None


def flag_forms(n: int, c: int) -> set:
    """Every flag tuple of length n with c flags set, j % period == offset (period_of holds them all)."""
    if c <= 1:
        return {tuple(j == o for j in range(n)) for o in (range(n) if c else [-1])}
    return {tuple(j % p == o for j in range(n)) for p in range(1, n) for o in range(p) if len(range(o, n, p)) == c}


class Jamba(Family):
    def depth_forms(self, types, removed):
        """The patterns left after dropping removed[t] units of each type t: attention and experts each every period
        units from an offset, with the counts of each type left."""
        left = Counter(types)
        left.subtract(removed)
        if min(left.values(), default=0) < 0:
            return []
        n = sum(left.values())
        attn, moe = (flag_forms(n, sum(c for t, c in left.items() if t[k] == ch)) for k, ch in ((0, "*"), (1, "E")))
        forms = (tuple(("*" if a else "S") + _FFN[e] for a, e in zip(fa, fe)) for fa in attn for fe in moe)
        return [f for f in forms if Counter(f) == +left]


    def required(self, h):
        need = [("num_hidden_layers",), ("intermediate_size",)]
        if "attention" in h.layers_block_type:
            need.append(("num_attention_heads",))
        return need

    def from_hf(self, h, extra):
        experts = [n > 1 for n in h.layers_num_experts]
        H, heads = h.hidden_size, h.num_attention_heads
        return ModelConfig(
            vocab_size=h.vocab_size, hidden_size=H, norm_eps=h.rms_norm_eps,
            pattern="".join(BLOCK_TYPES[t] + _FFN[e] for t, e in zip(h.layers_block_type, experts)),
            tie_word_embeddings=bool(h.tie_word_embeddings),
            num_attention_heads=heads, num_key_value_heads=h.num_key_value_heads,
            head_dim=getattr(h, "head_dim", None) or H // heads,
            **{f: getattr(h, key) for key, fs in ONE_KEY.items() for f in fs}, mlp_act=h.hidden_act, mlp_gated=True,
            n_routed_experts=h.num_experts if any(experts) else 0, num_experts_per_tok=h.num_experts_per_tok,
            router="softmax", norm_topk_prob=False,
            **{"mamba1.d_state": h.mamba_d_state}, d_conv=h.mamba_d_conv, dt_rank=h.mamba_dt_rank, expand=h.mamba_expand,
            conv_bias=bool(h.mamba_conv_bias), proj_bias=bool(h.mamba_proj_bias), dt_bc_norm=True,
            dt_bc_norm_eps=h.rms_norm_eps, extra=extra)

    def check(self, cfg, need):
        need(not cfg.mtp_layers, f"MTP layers are not stored by {self.name}")
        mixers, ffns = cfg.pattern[0::2], cfg.pattern[1::2]
        need(cfg.num_layers % 2 == 0 and set(mixers) <= set(BLOCK_TYPES.values()) and set(ffns) <= set(_FFN.values()),
             f"needs the layer pattern of (Mamba-1 'S' or attention '*') + (MLP '-' or MoE 'E') pairs, "
             f"got {cfg.pattern!r}")
        need(period_of([c == "*" for c in mixers]) is not None and period_of([c == "E" for c in ffns]) is not None,
             f"{self.name} places attention and experts every period layers from an offset: {cfg.pattern!r} is not so")
        need(cfg.norm_offset == 0, f"{self.name}'s RMSNorms scale by w (norm_offset 0)")
        need(cfg.mlp.mlp_gated and cfg.mlp.mlp_act == "silu" and not cfg.mlp.mlp_bias, "needs SwiGLU MLPs without bias")
        if ATTENTION in used(cfg):
            a = cfg.attention
            need(a.rope_theta is None, f"{self.name} attention has no positional encoding")
            need(not (a.qk_norm or a.qk_norm_full or a.attn_output_gate or a.attention_bias or a.attention_out_bias),
                 f"{self.name} attention has no q/k norm, output gate or bias")
            need(a.sliding_window is None, f"{self.name} has no sliding-window attention")
        if MOE in used(cfg):
            m = cfg.moe
            need(m.router == "softmax" and not m.norm_topk_prob and m.n_group == 1 and m.routed_scaling_factor == 1.0,
                 f"{self.name} routes by the top-k of a softmax, not renormalised")
            need(not m.moe_shared_expert_intermediate_size and m.moe_latent_size is None,
                 f"{self.name} has no shared expert or latent MoE")
        if MAMBA1 in used(cfg):
            s = cfg.mamba1
            need(s.dt_bc_norm and s.dt_bc_norm_eps == cfg.norm_eps,
                 f"{self.name}'s Mamba-1 normalises dt, B and C with rms_norm_eps")

    def to_hf(self, cfg):
        mixers, ffns = cfg.pattern[0::2], cfg.pattern[1::2]
        ap, ao = period_of([c == "*" for c in mixers])
        ep, eo = period_of([c == "E" for c in ffns])
        a, m, s = cfg.attention, cfg.moe, cfg.mamba1
        moe = MOE in used(cfg)
        return dict(
            num_hidden_layers=cfg.num_layers // 2, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
            attn_layer_period=ap, attn_layer_offset=ao, expert_layer_period=ep, expert_layer_offset=eo,
            num_attention_heads=a.num_attention_heads or 1, num_key_value_heads=a.num_key_value_heads or 1,
            head_dim=a.head_dim or cfg.hidden_size,
            **self.one_key_values(cfg),
            num_experts=m.n_routed_experts if moe else 1, num_experts_per_tok=m.num_experts_per_tok if moe else 1,
            mamba_d_state=s.d_state, mamba_d_conv=s.d_conv, mamba_expand=s.expand, mamba_dt_rank=s.dt_rank,
            mamba_conv_bias=s.conv_bias, mamba_proj_bias=s.proj_bias)

    def key_map(self):
        """Our layer 2j's mixer is HF layer j's `mamba` or `self_attn`, 2j+1's MLP or MoE its `feed_forward`
        (the router `router`, each expert under experts.{e})."""
        out = feed_forward_keys("model.final_layernorm.weight")
        out.update({f"layers.{{a}}.mixer.{p.leaf}": f"model.layers.{{a}}.mamba.{p.leaf}" for p in MAMBA1.params})
        out.update({f"layers.{{a}}.mixer.{t}.weight": f"model.layers.{{a}}.self_attn.{t}.weight"
                    for t in ("q_proj", "k_proj", "v_proj", "o_proj")})
        out["layers.{m}.mixer.gate.weight"] = "model.layers.{m}.feed_forward.router.weight"
        out.update({f"layers.{{m}}.mixer.experts.{p}": f"model.layers.{{m}}.feed_forward.experts.{{e}}.{p}.weight"
                    for p in _LEAVES})
        return out

    def claims(self, cfg):
        return self.holds(cfg)


TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, intermediate_size=40, num_attention_heads=4,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
            expert_layer_period=1, expert_layer_offset=0, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
            mamba_dt_rank=4)
JAMBA = Jamba("jamba", "JambaForCausalLM", depth=2, block_types=BLOCK_TYPES, padding_idx=True, moe=True,
              routers=("softmax-topk",), raw=_PERIODS, one_key=ONE_KEY,
              # the first case (the suite prunes it) has experts in every layer: with dense MLPs beside them an
              # MLP or expert width alone is refused (transformers' Jamba sizes both by intermediate_size). The
              # second is the release's shape (experts every other layer) with attention first, no conv bias,
              # tied embeddings, a shorter kernel (projection biases: tests/test_jamba.py; with them transformers'
              # left padding reaches the real tokens through in_proj's bias and the conv)
              tiny={"plain": TINY,
                    "mixed_tied": dict(TINY, attn_layer_period=4, attn_layer_offset=0, expert_layer_period=2,
                                              expert_layer_offset=1, mamba_conv_bias=False,
                                              tie_word_embeddings=True, mamba_d_conv=3, mamba_dt_rank=3)})

REGISTER = (JAMBA,)  # the families this module adds to models.families.FAMILIES, in order
