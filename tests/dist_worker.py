"""torchrun worker for tests/test_parallel.py.

    torchrun --standalone --nproc_per_node N tests/dist_worker.py CASE [CASE ...]

Every rank trains a tiny Nemotron-H both ways, parallelized (pipelines.distributed.parallel) and as a plain
single-process reference on the concatenated batch, and rank 0 prints one `RESULT {json}` line per
case with the measured differences; the test asserts on them. Cases 'die' / 'hang' stop rank 1
mid-step.
"""
import copy
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from remodel.models.config import ModelConfig  # noqa: E402
from remodel.models.model import HybridLM, init_weights  # noqa: E402
from remodel.pipelines.distributed.parallel import (clip_grad_norm_, dp_mean, full_grads, full_state_dict, gather_model,  # noqa: E402
                                local_tensor, parallel_info, parallelize)
from remodel.pipelines.training.vocab_parallel import vocab_parallel_kl_div, vocab_parallel_lm_loss, vocab_shard  # noqa: E402

STEPS, B, L, LR = 3, 4, 16, 3e-3


def llama_cfg() -> ModelConfig:
    """Llama/Qwen3-style "*-": RoPE, qk_norm, q/k/v bias, SwiGLU, tied embeddings."""
    return ModelConfig(vocab_size=64, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, rope_theta=10000.0, attention_bias=True, qk_norm=True, intermediate_size=48,
                       mlp_act="silu", mlp_gated=True, tie_word_embeddings=True)


def qk_norm_full_cfg() -> ModelConfig:
    """OLMo 2 / OLMo-hybrid attention: q/k norms over all heads (qk_norm_full: under TP their weights split with
    the heads, the mean of squares summed over the group), post-norm 'A' / '=' beside pre-norm '*' / '-', biases."""
    return ModelConfig(vocab_size=64, hidden_size=32, pattern="A=*-", num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, rope_theta=10000.0, attention_bias=True, attention_out_bias=True, qk_norm_full=True,
                       intermediate_size=48, mlp_act="silu", mlp_gated=True)


def gpt_oss_cfg() -> ModelConfig:
    """gpt-oss: sinks, q/k/v/o biases, a sliding '*' and a full 'F' layer; router and expert biases, clamped SwiGLU."""
    return ModelConfig(vocab_size=64, hidden_size=32, pattern="*EFE", num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, rope_theta=10000.0, attention_bias=True, attention_out_bias=True, attention_sinks=True,
                       sliding_window=5, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       router="softmax", router_bias=True, expert_bias=True, swiglu_alpha=1.702, swiglu_limit=0.7,
                       mlp_act="silu", mlp_gated=True)


def tiny_cfg(tp4: bool = False) -> ModelConfig:
    """M, *, -, E layers; GQA; MoE with a shared expert; n_groups 2 (4 for tp 4)."""
    return ModelConfig(
        vocab_size=64, hidden_size=32, pattern="M*-EM*E", num_attention_heads=8 if tp4 else 4,
        num_key_value_heads=4 if tp4 else 2, head_dim=8, intermediate_size=48, mamba_num_heads=8,
        mamba_head_dim=4, n_groups=4 if tp4 else 2, ssm_state_size=8, chunk_size=8, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16)


def data(cfg):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (STEPS, B, L), generator=g)
    teacher = 2.0 * torch.randn(STEPS, B, L, cfg.vocab_size, generator=g)
    return ids, teacher


def train(model, ids, teacher, group, clip, rows, grads):
    """STEPS AdamW steps of CE + 0.5 KL(teacher) on rows of the global batch -> (losses, grad norms);
    grads(model) is called after the first backward."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, norms = [], []
    for s in range(STEPS):
        x, t = ids[s, rows], teacher[s, rows]
        logits = model(x)
        loss = (vocab_parallel_lm_loss(logits[:, :-1], x[:, 1:], group)
                + 0.5 * vocab_parallel_kl_div(logits, vocab_shard(t, group), group, temperature=2.0))
        loss.backward()
        if s == 0:
            grads(model)
        norms.append(float(clip(model)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(dp_mean(loss, model)))
    return losses, norms


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def case_train(name, mesh_shape, dims, tp_dim, ep_dim, dp_dim, tp4=False, cfg=None, clip=0.05):
    """clip: below the gradient norms (~0.065, llama ~0.025), so clipping is active at every step."""
    cfg = cfg or tiny_cfg(tp4)
    torch.manual_seed(0)
    model = init_weights(HybridLM(cfg), seed=0)
    if cfg.attention.qk_norm_full:  # every channel its own q/k norm weight: a misplaced slice shows
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(("q_norm.weight", "k_norm.weight")):
                    p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    ref = copy.deepcopy(model)
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    ids, teacher = data(cfg)
    with torch.no_grad():
        ref_logits = ref(ids[0])

    g_ref, g_par = {}, {}
    ref_losses, ref_norms = train(ref, ids, teacher, None,
                                  lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), clip), slice(None),
                                  lambda m: g_ref.update({n: p.grad.clone() for n, p in m.named_parameters()}))

    mesh = init_device_mesh(DEVICE, mesh_shape, mesh_dim_names=dims)
    t0 = time.time()
    parallelize(model, mesh, tp_dim=tp_dim, ep_dim=ep_dim, dp_dim=dp_dim)
    info = parallel_info(model)
    fwd = torch.tensor([float("nan")])
    if not info.fsdp:  # (FSDP2 leaves the root's parameters unsharded after a forward: none before the optimizer)
        with torch.no_grad():  # the parallel forward itself: this rank's vocab shard, worst over the ranks
            fwd[0] = rel(model(ids[0]), vocab_shard(ref_logits, info.vocab_group))
        dist.all_reduce(fwd, op=dist.ReduceOp.MAX)
    per = B // info.dp
    rows = slice(info.dp_rank * per, (info.dp_rank + 1) * per)
    losses, norms = train(model, ids, teacher, info.vocab_group, lambda m: clip_grad_norm_(m, clip), rows,
                          lambda m: g_par.update(full_grads(m)))
    sd = full_state_dict(model)
    full = gather_model(model)
    seconds = time.time() - t0
    if RANK == 0:
        ref_sd = ref.state_dict()
        assert set(sd) == set(ref_sd), set(sd) ^ set(ref_sd)
        w = {k: rel(sd[k], ref_sd[k]) for k in ref_sd}
        fro = {k: float((sd[k].double() - ref_sd[k].double()).norm() / ref_sd[k].double().norm()) for k in ref_sd}
        worst = max(w, key=w.get)
        assert set(g_par) == set(g_ref), set(g_par) ^ set(g_ref)
        gr = {k: rel(g_par[k], g_ref[k]) for k in g_ref}
        moved = (sum(float((ref_sd[k] - init[k]).double().norm() ** 2) for k in ref_sd)
                 / sum(float(init[k].double().norm() ** 2) for k in ref_sd)) ** 0.5
        with torch.no_grad():  # the gathered single-process model computes what the reference does
            logits_rel = rel(full(ids[0]), ref(ids[0]))
        emit(name, loss_rel=max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
             norm_rel=max(abs(a - b) / abs(b) for a, b in zip(norms, ref_norms)),
             grad_rel=max(gr.values()), grad_worst=max(gr, key=gr.get), fwd_rel=None if info.fsdp else float(fwd),
             norm_grads={k: gr[k] for k in gr if k.endswith(("q_norm.weight", "k_norm.weight"))},
             norm_shards={k: list(local_tensor(v).shape) for k, v in model.named_parameters()
                          if k.endswith(("q_norm.weight", "k_norm.weight"))},
             weight_rel=w[worst], worst=worst, weight_fro=max(fro.values()), logits_rel=logits_rel, moved=moved,
             losses=losses, ref_losses=ref_losses, ref_norms=ref_norms, clipped=sum(n > clip for n in ref_norms),
             tp=info.tp, ep=info.ep, dp=info.dp, seconds=round(seconds, 2))


def case_vocab(name):
    """Vocab-parallel CE and KL against unsharded torch references: values and gradients."""
    group = dist.group.WORLD
    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(2)
    V = 16 * n
    s_full = 3.0 * torch.randn(3, 5, V, generator=g, dtype=torch.float64).float()
    t_full = 3.0 * torch.randn(3, 5, V, generator=g, dtype=torch.float64).float()
    labels = torch.randint(0, V, (3, 5), generator=g)
    labels[0, 1] = labels[2, 3] = -100
    mask = torch.rand(3, 5, generator=g) > 0.3
    Vl = V // n

    def ref_and_ours(fn_ref, fn_ours):
        a = s_full.clone().requires_grad_(True)
        va = fn_ref(a)
        va.backward()
        b = s_full[..., r * Vl:(r + 1) * Vl].clone().requires_grad_(True)
        vb = fn_ours(b)
        vb.backward()
        return abs(va.item() - vb.item()) / abs(va.item()), rel(b.grad, a.grad[..., r * Vl:(r + 1) * Vl])

    def ce_ref(z):
        per = F.cross_entropy(z.reshape(-1, V), labels.reshape(-1), reduction="none", ignore_index=-100)
        keep = ((labels != -100) & mask).reshape(-1).float()
        return (per * keep).sum() / keep.sum()

    def kl_ref(z):
        per = F.kl_div(F.log_softmax(z / 2.0, -1), F.log_softmax(t_full / 2.0, -1), log_target=True,
                       reduction="none").sum(-1)
        return per[mask].mean()

    tl = t_full[..., r * Vl:(r + 1) * Vl]
    out = {}
    out["ce_value"], out["ce_grad"] = ref_and_ours(ce_ref, lambda z: vocab_parallel_lm_loss(z, labels, group, mask))
    out["kl_value"], out["kl_grad"] = ref_and_ours(kl_ref, lambda z: vocab_parallel_kl_div(z, tl, group, 2.0, mask))
    res = torch.tensor([max(out.values())])
    dist.all_reduce(res, op=dist.ReduceOp.MAX)  # worst over ranks (each checks its own gradient shard)
    if RANK == 0:
        emit(name, worst=float(res), **out)


def case_die(name, hang=False):
    """Rank 1 dies (or, with hang, stalls forever) mid-step, between forward and backward; the others
    must exit non-zero instead of hanging (a dead peer resets gloo's connections; a stalled one trips
    the process group's timeout)."""
    cfg = tiny_cfg()
    model = parallelize(init_weights(HybridLM(cfg), seed=0), init_device_mesh(DEVICE, (WORLD,), mesh_dim_names=("tp",)))
    ids, teacher = data(cfg)
    for s in range(STEPS):
        loss = vocab_parallel_lm_loss(model(ids[s])[:, :-1], ids[s][:, 1:], parallel_info(model).vocab_group)
        if s == 1 and RANK == 1:
            with open(os.environ["DIE_FILE"], "w") as f:
                f.write(str(time.time()))
            if hang:
                time.sleep(3600)
            os._exit(1)
        loss.backward()
    emit(name, survived=True)  # not reached on the surviving ranks


def emit(name, **kw):
    print("RESULT " + json.dumps({"case": name, **kw}), flush=True)


CASES = {
    "vocab": lambda: case_vocab("vocab"),
    "tp": lambda: case_train("tp", (WORLD,), ("tp",), "tp", None, None, tp4=WORLD == 4),
    "tp_llama": lambda: case_train("tp_llama", (WORLD,), ("tp",), "tp", None, None, cfg=llama_cfg(), clip=0.02),
    "tp_qk_norm_full": lambda: case_train("tp_qk_norm_full", (WORLD,), ("tp",), "tp", None, None, cfg=qk_norm_full_cfg(),
                                          clip=0.02),
    "ep_dp": lambda: case_train("ep_dp", (WORLD,), ("dp",), None, "dp", "dp"),
    "ep_dp_gpt_oss": lambda: case_train("ep_dp_gpt_oss", (WORLD,), ("dp",), None, "dp", "dp", cfg=gpt_oss_cfg(), clip=0.02),
    "tp_ep": lambda: case_train("tp_ep", (WORLD,), ("tp",), "tp", "tp", None, tp4=WORLD == 4),
    "dp_tp": lambda: case_train("dp_tp", (2, WORLD // 2), ("dp", "tp"), "tp", None, "dp"),
    "dp_tp_ep_dp": lambda: case_train("dp_tp_ep_dp", (2, WORLD // 2), ("dp", "tp"), "tp", "dp", "dp"),
    "dp_tp_ep_tp": lambda: case_train("dp_tp_ep_tp", (2, WORLD // 2), ("dp", "tp"), "tp", "tp", "dp"),
    "die": lambda: case_die("die"),
    "hang": lambda: case_die("hang", hang=True),
}

if __name__ == "__main__":
    DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(1)
    dist.init_process_group(dist.get_default_backend_for_device(DEVICE), 
                            timeout=datetime.timedelta(seconds=float(os.environ.get('DIST_TIMEOUT', 20))))
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    for c in sys.argv[1:]:
        CASES[c]()
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
