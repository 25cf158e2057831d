"""Multi-head latent attention, every width masked at run time by hooks (written from the layer's maths, not from
the axes table): o_proj's input for dropped heads and value channels; the queries' and kv_b_proj's no-RoPE channels,
the queries scaled by s' / s since the softmax scale (nope + rope)**-0.5 follows the kept width; the latent channels
at kv_a_proj / q_a_proj's output with their RMSNorm averaging over the kept ones."""
import torch

from tests.kinds import dropped

AXES = {"mla_heads", "mla_v_dim", "mla_nope", "mla_kv_rank", "mla_q_rank"}


def outputs(m):
    return [m.o_proj]


def mask(cfg, m, keep, p):
    mask_mla(cfg, m, keep, p)


def kept_mean_norm(norm, n_kept):
    """A forward hook making `norm` (RMSNorm) average over the n_kept channels its zeroed input keeps."""
    def hook(module, args, out):
        x = args[0]
        cd = torch.promote_types(x.dtype, torch.float32)
        y = x.to(cd) * torch.rsqrt(x.to(cd).pow(2).sum(-1, keepdim=True) / n_kept + norm.eps)
        return ((norm.weight.to(cd) + norm.offset) * y).to(x.dtype)
    return norm.register_forward_hook(hook)


def _mask_latent(proj, norm, kept, size):
    m = torch.ones(proj.weight.shape[0])
    m[dropped(kept, size)] = 0  # the latent's first `size` rows (kv_a_proj: then k_pe, kept)
    proj.register_forward_hook(lambda mod, a, out: out * m.to(out.dtype))
    kept_mean_norm(norm, len(kept))


def mask_mla(cfg, m, keep, p):
    """Hooks on MLA mixer `m` (layer prefix p, e.g. 'layers.2.') computing it with what `keep` drops zeroed (see
    the module docstring); heads included."""
    c = cfg.mla
    n, nope, rd, vd, R = c.mla_num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    k = lambda u, size: keep.get(p + u, torch.arange(size or 0))  # noqa: E731
    heads, vch, nch = k("mla_heads", n), k("mla_v_dim", vd), k("mla_nope", nope)
    o = torch.zeros(n, vd)
    o[heads[:, None], vch[None, :]] = 1
    m.o_proj.register_forward_pre_hook(lambda mod, a, o=o.flatten(): (a[0] * o.to(a[0].dtype),))
    q = torch.ones(n, nope + rd, dtype=torch.float64)  # the scale ratio exact for a float64 model too
    q[:, dropped(nch, nope)] = 0
    q = q.flatten() * ((nope + rd) / (len(nch) + rd)) ** 0.5  # the pruned layer's softmax scale
    (m.q_proj if c.q_lora_rank is None else m.q_b_proj).register_forward_hook(
        lambda mod, a, out, q=q: out * q.to(out.dtype))
    kv = torch.ones(n, nope + vd)
    kv[:, dropped(nch, nope)] = 0
    m.kv_b_proj.register_forward_hook(lambda mod, a, out, kv=kv.flatten(): out * kv.to(out.dtype))
    _mask_latent(m.kv_a_proj_with_mqa, m.kv_a_layernorm, k("mla_kv_rank", R), R)
    if c.q_lora_rank is not None:
        _mask_latent(m.q_a_proj, m.q_a_layernorm, k("mla_q_rank", c.q_lora_rank), c.q_lora_rank)
