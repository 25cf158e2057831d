"""OLMo-hybrid (transformers' `olmo_hybrid`, OlmoHybridForCausalLM): decoder layer j is our pair of layers 2j
and 2j+1. A linear-attention decoder layer is pre-norm: a Gated DeltaNet 'D' (HF `linear_attn`, its norm
input_layernorm) and a SwiGLU MLP '-' (post_attention_layernorm). An attention decoder layer is post-norm
(OLMo 2): attention 'A' (HF `self_attn`, then post_attention_layernorm) and MLP '=' (then
post_feedforward_layernorm), both post_norm kinds. So the pattern is e.g. "D-D-D-A=". Attention normalises
the whole q and k projections (qk_norm_full) and rotates whole heads, or none when the config has no
rope_parameters (NoPE, the released checkpoints); the DeltaNet doubles beta (linear_allow_neg_eigval) and its
gated output norm keeps FLA's eps 1e-5."""
from __future__ import annotations

from remodel.models.attention import ATTENTION
from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.gated_deltanet import GATED_DELTANET
from remodel.models.kinds import KINDS, used

from .family import Family, read_rope

BLOCK_TYPES = {"linear_attention": "D-", "full_attention": "A="}  # HF layer type -> our pair of layers
GDN_NORM_EPS = 1e-5  # transformers' OlmoHybridRMSNormGated(eps=1e-5), FLA's default, whatever rms_norm_eps
_LINEAR = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
           "linear_conv_kernel_dim")
_GDN = {"in_proj_q": "q_proj", "in_proj_k": "k_proj", "in_proj_v": "v_proj", "in_proj_z": "g_proj",
        "in_proj_b": "b_proj", "in_proj_a": "a_proj", "norm": "o_norm", "out_proj": "o_proj"}  # q/k/v_conv1d: the same


class OlmoHybrid(Family):
    def required(self, h):
        return [("num_hidden_layers",), ("intermediate_size",), ("layer_types",)]

    def from_hf(self, h, extra):
        if h.hidden_act != "silu":
            raise RemodelError(f"unsupported hidden_act {h.hidden_act!r} for {self.name} (only silu)")
        unknown = sorted(set(h.layer_types) - set(BLOCK_TYPES))
        if unknown:
            raise RemodelError(f"'layer_types' has unknown types {unknown} (known: {', '.join(BLOCK_TYPES)})")
        rp = getattr(h, "rope_parameters", None)
        theta = read_rope(h, self.name)[0] if rp and rp.get("rope_theta") is not None else None  # None: NoPE
        return ModelConfig(
            vocab_size=h.vocab_size, hidden_size=h.hidden_size, norm_eps=h.rms_norm_eps,
            pattern="".join(BLOCK_TYPES[t] for t in h.layer_types), tie_word_embeddings=bool(h.tie_word_embeddings),
            num_attention_heads=h.num_attention_heads, num_key_value_heads=h.num_key_value_heads,
            head_dim=getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads,
            rope_theta=theta, qk_norm_full=True, attention_bias=bool(h.attention_bias),
            attention_out_bias=bool(h.attention_bias), intermediate_size=h.intermediate_size, mlp_act="silu",
            mlp_gated=True, linear_allow_neg_eigval=bool(h.linear_allow_neg_eigval), linear_norm_eps=GDN_NORM_EPS,
            **{k: getattr(h, k) for k in _LINEAR}, extra=extra)

    def check(self, cfg, need):
        need(not cfg.mtp_layers, f"MTP layers are not stored by {self.name}")
        pairs = [cfg.pattern[i:i + 2] for i in range(0, cfg.num_layers, 2)]
        need(cfg.num_layers % 2 == 0 and set(pairs) <= set(BLOCK_TYPES.values()),
             f"needs the layer pattern of Gated DeltaNet 'D-' and post-norm attention 'A=' pairs, got {cfg.pattern!r}")
        need(set(pairs) == set(BLOCK_TYPES.values()), f"{self.name} needs both a 'D-' and an 'A=' decoder layer")
        need(cfg.norm_offset == 0, f"{self.name} RMSNorms scale by w (norm_offset 0)")
        need(cfg.mlp.mlp_gated and cfg.mlp.mlp_act == "silu" and not cfg.mlp.mlp_bias, "needs SwiGLU MLPs without bias")
        if KINDS["A"] in used(cfg):
            need(cfg.attention.qk_norm_full and not cfg.attention.qk_norm, f"{self.name} attention normalises q and k over all heads")
            need(cfg.attention.rope_scaling is None and cfg.attention.partial_rotary_factor == 1,
                 f"{self.name} attention uses default RoPE on whole heads (or none)")
            need(cfg.attention.attention_bias == cfg.attention.attention_out_bias, "q/k/v and o_proj bias must match")
            need(cfg.attention.sliding_window is None, f"{self.name} has no sliding-window attention")
        if GATED_DELTANET in used(cfg):
            need(not cfg.gated_deltanet.linear_conv_bias, f"{self.name}'s Gated DeltaNet conv has no bias")
            need(cfg.gated_deltanet.linear_norm_eps == GDN_NORM_EPS, f"{self.name}'s gated output norm has eps {GDN_NORM_EPS}")

    def to_hf(self, cfg):
        rope = None if cfg.attention.rope_theta is None else {"rope_type": "default", "rope_theta": cfg.attention.rope_theta}
        return dict(
            num_hidden_layers=cfg.num_layers // 2, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
            layer_types=[next(t for t, p in BLOCK_TYPES.items() if p[0] == c) for c in cfg.pattern[0::2]],
            num_attention_heads=cfg.attention.num_attention_heads, num_key_value_heads=cfg.attention.num_key_value_heads,
            head_dim=cfg.attention.head_dim, attention_bias=cfg.attention.attention_bias, rope_parameters=rope,
            intermediate_size=cfg.mlp.intermediate_size, linear_allow_neg_eigval=cfg.gated_deltanet.linear_allow_neg_eigval,
            **{k: cfg.get(k) for k in _LINEAR})

    def key_map(self):
        """Layer 2j is HF layer j's `linear_attn` (input_layernorm before it) or `self_attn`
        (post_attention_layernorm after it); 2j+1 its `mlp` (post_attention_layernorm before it, or
        post_feedforward_layernorm after it). Checkpoint names, as transformers saves and the released
        checkpoints hold them (its conversion_mapping): input_layernorm is attention_layer_norm,
        post_attention_layernorm feedforward_layer_norm; the conv is q_conv1d, k_conv1d, v_conv1d (ours too;
        transformers concatenates them into one conv1d in memory). Where q/k and v differ in size, transformers'
        own save_pretrained writes three equal chunks of that conv under these names instead: read through
        `regrouped`; our exports hold the true q, k, v convs (as FLA's layer, where the released checkpoints
        come from, stores them; not checked against a released file here), which transformers reads alike."""
        out = {"embeddings.weight": "model.embed_tokens.weight",
               "layers.{a}.norm.weight": "model.layers.{a}.attention_layer_norm.weight",
               "layers.{a}.post_norm.weight": "model.layers.{a}.feedforward_layer_norm.weight",
               "layers.{m}.norm.weight": "model.layers.{m}.feedforward_layer_norm.weight",
               "layers.{m}.post_norm.weight": "model.layers.{m}.post_feedforward_layernorm.weight",
               "norm_f.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
        out.update({f"layers.{{a}}.mixer.{p.leaf}": f"model.layers.{{a}}.self_attn.{p.leaf}" for p in ATTENTION.params})
        for p in GATED_DELTANET.params:
            ours, _, rest = p.leaf.partition(".")
            out[f"layers.{{a}}.mixer.{p.leaf}"] = f"model.layers.{{a}}.linear_attn.{_GDN.get(ours, ours)}" + (
                f".{rest}" if rest else "")
        out.update({f"layers.{{m}}.mixer.{p}.weight": f"model.layers.{{m}}.mlp.{p}.weight"
                    for p in ("gate_proj", "up_proj", "down_proj")})
        return out

    def regrouped(self, ours, hf_name):
        """Our q/k/v convs from the concatenation of the checkpoint's three: transformers' save_pretrained writes
        its one in-memory conv as three equal chunks under those names (not the q, k, v convs where they differ
        in size)."""
        if not ours.endswith("_conv1d.weight"):
            return None
        mixer, hf = ours.rsplit(".", 2)[0], hf_name.rsplit(".", 2)[0]
        return ([f"{mixer}.{x}_conv1d.weight" for x in "qkv"], [f"{hf}.{x}_conv1d.weight" for x in "qkv"])

    def claims(self, cfg):
        return self.holds(cfg)


# q, k and v convs of one size (2 x 12 = 4 x 6 channels): transformers' save_pretrained writes its in-memory conv
# as three equal chunks (torch.chunk), the q, k, v convs only where they are equal (see key_map): so the suite's
# byte-identical export holds; tests/test_olmo_hybrid.py reads unequal ones
TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, intermediate_size=40, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12,
            linear_value_head_dim=6, linear_conv_kernel_dim=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            pad_token_id=0, eos_token_id=1,  # the defaults lie outside a tiny vocab
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
OLMO_HYBRID = OlmoHybrid("olmo_hybrid", "OlmoHybridForCausalLM", depth=2, block_types=BLOCK_TYPES,
                         variants=("qk_norm_full", "delta_rule"), padding_idx=True,
                         # beta in (0, 1), three value heads per key head, attention first with every bias, tied, NoPE
                         tiny={"plain": TINY,
                               "grouped_biased_tied_nope": dict(
                                   TINY, linear_num_value_heads=6, linear_key_head_dim=18, linear_conv_kernel_dim=3,
                                   attention_bias=True,
                                   tie_word_embeddings=True, linear_allow_neg_eigval=False, rope_parameters=None,
                                   rms_norm_eps=1e-5 * 3, layer_types=["full_attention", "linear_attention"] * 2)})

REGISTER = (OLMO_HYBRID,)  # the families this module adds to models.families.FAMILIES, in order
