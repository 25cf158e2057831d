"""Test-wide settings: keep idle OpenMP threads from spinning (on a 2-core
machine busy-waiting threads in one process slow every other process ~5x),
and keep tokenizers single-threaded; and the markers of the long tests (MARKS)."""
import gzip
import math
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# under pytest-xdist (`-n 2`, the README's command) each worker is one torch thread: two workers of two
# threads each on the 2-core machine wait on each other's OpenMP barriers; the processes tests start inherit it
XDIST = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if XDIST:
    os.environ["OMP_NUM_THREADS"] = "1"

# token sets cached by training runs go to a fresh folder per test session (per xdist worker), not ~/.cache
if "REMODEL_CACHE" not in os.environ or (XDIST and os.environ.get("REMODEL_TEST_CACHE_PID", str(os.getpid())) != str(os.getpid())):
    import tempfile
    os.environ["REMODEL_CACHE"] = tempfile.mkdtemp(prefix="remodel-test-cache-")
    os.environ["REMODEL_TEST_CACHE_PID"] = str(os.getpid())

# ---- shared tiny models (issue 26: one builder per layer kind and per family, no test module imports another)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from remodel.models.config import ModelConfig  # noqa: E402
from remodel.models.families import FAMILIES  # noqa: E402
from remodel.models.hf import config_from_hf  # noqa: E402
from remodel.models.model import HybridLM, init_weights  # noqa: E402

if XDIST:
    torch.set_num_threads(1)

_BASE = dict(vocab_size=96, hidden_size=24, norm_eps=1e-5)
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=6)
_MAMBA = dict(mamba_num_heads=6, mamba_head_dim=4, n_groups=2, ssm_state_size=5, conv_kernel=4, chunk_size=8)
_MOE = dict(n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=10)
_SWIGLU = dict(mlp_gated=True, mlp_act="silu", rope_theta=1e4)
# one tiny config per layer kind (its name in models.kinds) and per HF family (models.families)
KIND_CONFIGS = {
    "mamba": ModelConfig(pattern="MM", **_BASE, **_MAMBA),
    "attention": ModelConfig(pattern="**", **_BASE, **_ATTN),
    "mlp": ModelConfig(pattern="--", intermediate_size=40, **_BASE),
    "moe": ModelConfig(pattern="EE", moe_shared_expert_intermediate_size=12, **_BASE, **_MOE),
    "parallel": ModelConfig(pattern="PP", **_BASE, **_ATTN, **_MAMBA),
    "gated_deltanet": ModelConfig(pattern="DD", linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                  linear_value_head_dim=6, **_BASE),
    "attention_post_norm": ModelConfig(pattern="AA", **_BASE, **_ATTN),
    "mlp_post_norm": ModelConfig(pattern="==", intermediate_size=40, **_BASE),
    "short_conv": ModelConfig(pattern="CC", short_conv_kernel=3, short_conv_bias=True, **_BASE),
    "mamba1": ModelConfig(pattern="SS", **{"mamba1.d_state": 4}, d_conv=4, dt_rank=3, expand=2, proj_bias=True, **_BASE),
    "mla": ModelConfig(pattern="LL", mla=dict(mla_num_heads=4, q_lora_rank=10, kv_lora_rank=12, qk_nope_head_dim=6,
                                              qk_rope_head_dim=4, v_head_dim=5, mla_bias=True), **_BASE),
    "attention_full": ModelConfig(pattern="FF", **_BASE, **_ATTN),
    "kda": ModelConfig(pattern="KK", kda=dict(kda_num_heads=3, kda_head_dim=8, kda_conv_kernel=3, kda_chunk_size=8),
                       **_BASE),
}
FAMILY_CONFIGS = {
    "nemotron_h": ModelConfig(pattern="M*-E", intermediate_size=40, moe_shared_expert_intermediate_size=12,
                              **_BASE, **_ATTN, **_MAMBA, **_MOE),
    "llama": ModelConfig(pattern="*-" * 2, intermediate_size=40, **_BASE, **_ATTN, **_SWIGLU),
    "mistral": ModelConfig(pattern="*-" * 2, intermediate_size=40, sliding_window=16, **_BASE, **_ATTN, **_SWIGLU),
    "qwen2": ModelConfig(pattern="*-" * 2, intermediate_size=40, attention_bias=True, **_BASE, **_ATTN, **_SWIGLU),
    "qwen3": ModelConfig(pattern="*-" * 2, intermediate_size=40, qk_norm=True, **_BASE, **_ATTN, **_SWIGLU),
    "mixtral": ModelConfig(pattern="*E" * 2, router="softmax", **_BASE, **_ATTN, **_SWIGLU, **_MOE),
    "qwen2_moe": ModelConfig(pattern="*E" * 2, attention_bias=True, router="softmax", shared_expert_gate=True,
                             moe_shared_expert_intermediate_size=12, **_BASE, **_ATTN, **_SWIGLU, **_MOE),
    "qwen3_moe": ModelConfig(pattern="*E" * 2, qk_norm=True, router="softmax", **_BASE, **_ATTN, **_SWIGLU, **_MOE),
    "bamba": ModelConfig(pattern="M-*-", intermediate_size=40, partial_rotary_factor=0.5, time_step_min=0.0,
                         **_BASE, **{**_ATTN, "head_dim": 8}, **{**_MAMBA, "mamba_head_dim": 8}, **_SWIGLU),
    "granitemoehybrid": ModelConfig(pattern="ME*E", router="softmax", moe_shared_expert_intermediate_size=12,
                                    mlp_gated=True, mlp_act="silu", embedding_multiplier=3.0, residual_multiplier=0.4,
                                    attention_scale=0.2, logits_scaling=2.5, **_BASE, **_ATTN, **_MAMBA, **_MOE),
    "falcon_h1": ModelConfig(pattern="P-" * 2, intermediate_size=40, embedding_multiplier=3.0, lm_head_multiplier=0.4,
                             key_multiplier=0.6, attention_in_multiplier=1.3, attention_out_multiplier=0.7,
                             ssm_in_multiplier=1.4, ssm_out_multiplier=0.8, ssm_multipliers=(0.5, 1.5, 0.7, 1.2, 0.9),
                             mlp_multipliers=(1.6, 0.6), mamba_norm_before_gate=True,
                             **_BASE, **_ATTN, **_MAMBA, **_SWIGLU),
}

# a family without a hand-written entry above has its first tiny model (Family.tiny, in its own module)
FAMILY_CONFIGS.update({name: config_from_hf({"model_type": name, **next(iter(f.tiny.values()))})
                       for name, f in FAMILIES.items() if name not in FAMILY_CONFIGS and f.tiny})


@pytest.fixture(params=sorted(KIND_CONFIGS))
def kind_config(request):
    """(kind name, tiny config whose every layer is that kind): a new kind's tests are one entry above."""
    return request.param, KIND_CONFIGS[request.param]


@pytest.fixture(params=sorted(FAMILY_CONFIGS))
def family_config(request):
    """(family name, tiny config it exports exactly): a new family's tests are one entry above."""
    return request.param, FAMILY_CONFIGS[request.param]


def tiny_configs():
    base = dict(vocab_size=96, hidden_size=24, norm_eps=1e-5)
    attn = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=6)
    mamba = dict(mamba_num_heads=6, mamba_head_dim=4, n_groups=2, ssm_state_size=5, conv_kernel=4, chunk_size=8)
    moe = dict(n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=10)
    return {
        "hybrid_shared": ModelConfig(pattern="M*-EM-", intermediate_size=40, moe_shared_expert_intermediate_size=12,
                                     **base, **attn, **mamba, **moe),
        "hybrid_noshared_latent_bias": ModelConfig(pattern="ME*E", moe_latent_size=8, mamba_proj_bias=True,
                                                   use_conv_bias=False, **base, **attn, **mamba, **moe),
        "llama_tied_bias": ModelConfig(pattern="*-" * 3, intermediate_size=40, mlp_gated=True, mlp_act="silu",
                                       rope_theta=1e4, attention_bias=True, attention_out_bias=True,
                                       tie_word_embeddings=True, **base, **attn),
        "qwen2_moe": ModelConfig(pattern="*E" * 2, mlp_gated=True, mlp_act="silu", rope_theta=1e4,
                                 attention_bias=True, router="softmax", shared_expert_gate=True,
                                 moe_shared_expert_intermediate_size=12, **base, **attn, **moe),
        "qwen3_moe": ModelConfig(pattern="*E" * 2, mlp_gated=True, mlp_act="silu", rope_theta=1e4, qk_norm=True,
                                 router="softmax", **base, **attn, **moe),
    }



LATENT = ModelConfig(vocab_size=96, hidden_size=32, pattern="ME*E", num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, mamba_num_heads=8, mamba_head_dim=4, n_groups=2, ssm_state_size=8, chunk_size=8,
                     n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                     moe_shared_expert_intermediate_size=24, moe_latent_size=24, router="sigmoid",
                     routed_scaling_factor=2.0)
SOFTMAX = ModelConfig(vocab_size=96, hidden_size=32, pattern="*E*E", num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, rope_theta=10000.0, mlp_act="silu", mlp_gated=True, n_routed_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
                      router="softmax")
IDS = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(1))



@torch.no_grad()
def random_model(cfg, seed=0, bias=0.3, std=0.15, gain=0.3, final_norm=False, d_std=None, mtp=False, noise_seed=None):
    """The one random tiny HybridLM of the tests: weights N(0, std); norm gains N(1, gain) (the final norm's
    too with final_norm), Mamba's D N(0, d_std) when given, and a N(0, bias) routing correction bias (sigmoid
    routers; the MTP head's too with mtp), drawn from one generator seeded noise_seed (default seed + 100)."""
    model = init_weights(HybridLM(cfg), std=std, seed=seed)
    g = torch.Generator().manual_seed(seed + 100 if noise_seed is None else noise_seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or (final_norm and name.endswith("norm_f.weight")):
            p.copy_(1 + gain * torch.randn(p.shape, generator=g))
        elif d_std is not None and name.endswith(".D"):
            p.copy_(d_std * torch.randn(p.shape, generator=g))
    moes = model.moe_layers() + ([b.mixer for b in model.mtp.layers if b.spec.routed] if mtp and cfg.mtp_layers else [])
    for m in moes if cfg.moe.router == "sigmoid" else []:
        m.gate.e_score_correction_bias.copy_(bias * torch.randn(cfg.moe.n_routed_experts, generator=g))
    return model.eval()


def corpus_split(d, held_out: int = 150) -> None:
    """d/train.txt and d/valid.txt: the embedded corpus's training lines, the last `held_out` of them held out
    (disjoint: train is every other line)."""
    from remodel.pipelines.data.data import embedded_corpus
    with gzip.open(embedded_corpus()[0], "rt", encoding="utf-8") as f:
        lines = [x for x in f.read().splitlines() if x.strip()]
    (Path(d) / "train.txt").write_text("\n".join(lines[:-held_out]) + "\n")
    (Path(d) / "valid.txt").write_text("\n".join(lines[-held_out:]) + "\n")


def train_lm(model, blocks, steps: int, batch: int, lr: float = 3e-3):
    """`model` trained in place from scratch: `steps` AdamW steps of next-token loss on consecutive `batch`-row
    slices of the token blocks; -> the model in eval mode."""
    from remodel.compress.importance import head_weight, lm_loss_sums
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for s in range(steps):
        ids = blocks[s * batch:(s + 1) * batch]
        h, _ = model.hidden(ids)
        total, n = lm_loss_sums(h, head_weight(model), ids)
        (total / n).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def write_checkpoint(model, path, tokenizer=True, **save_kw):
    """Save `model` as a HF checkpoint at `path` with the embedded test tokenizer's files beside it."""
    import shutil

    from remodel.models.load import save_model
    from remodel.pipelines.data.data import embedded_tokenizer_path
    save_model(model, path, **save_kw)
    for f in embedded_tokenizer_path().iterdir() if tokenizer else []:
        shutil.copy(f, Path(path) / f.name)
    return Path(path)



@torch.no_grad()
def randomise(model, seed=0):
    """Move every weight away from its init: norms ~N(1, .1) (zero-centred ones, initialised to 0, ~N(0, .1)),
    linears N(0, .15), Mamba scalars random."""
    g = torch.Generator().manual_seed(seed)

    def normal(p, mean, std):
        p.copy_(torch.randn(p.shape, generator=g) * std + mean)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and p.dim() == 1:
            normal(p, 0.0 if not p.any() else 1.0, 0.1)
        elif leaf == "dt_bias":
            normal(p, -2.0, 1.5)
            p[0] = -9.0  # softplus falls below time_step_min for head 0: the clamp is exercised
        elif leaf == "A_log":
            p.copy_(torch.rand(p.shape, generator=g) * 3 - 1)
        elif leaf == "D":
            normal(p, 1.0, 0.5)
        elif leaf == "bias":
            normal(p, 0.0, 0.1)
        elif "embed" in name:
            normal(p, 0.0, 0.5)
        else:
            normal(p, 0.0, 0.2 if "conv1d" in name or "gate" in name else 0.15)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            normal(b, 0.0, 0.1)
    return model


def tensors(d):
    """Every tensor of a safetensors checkpoint directory (sharded or not)."""
    from safetensors.torch import load_file
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def released_config(name) -> dict:
    """A shipped config.json of models/configs by its name."""
    import json
    return json.loads((Path(__file__).resolve().parents[1] / "models" / "configs" / f"{name}.json").read_text())


def hf_counts(d: dict) -> tuple[int, int]:
    """(total, active per token) of transformers' model: routed expert tensors count k/E of their size."""
    m = hf_meta_model(d)
    total = sum(p.numel() for p in m.parameters())
    routed = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)  # never `.shared_experts.`
    E = d.get("num_local_experts") or d.get("n_routed_experts") or 0
    k = d.get("num_experts_per_tok") or 0
    return total, total - routed + (routed * k // E if E else 0)


def hf_meta_model(d: dict):
    """transformers' CausalLM of an HF config.json dict, on the meta device (parameter counts and names); of a
    family nesting its text model beside a vision tower (Family.nested), its ForConditionalGeneration."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig
    d = PretrainedConfig._decode_special_floats(d)  # config_to_hf writes inf as {"__float__": "Infinity"}
    h = AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k not in ("model_type", "architectures")})
    fam = FAMILIES.get(d["model_type"])
    with torch.device("meta"):
        return (AutoModelForImageTextToText if fam is not None and fam.nested else AutoModelForCausalLM).from_config(h)


def assert_same_tensors(a_dir, b_dir, what=""):
    """Two checkpoint directories hold the same tensor names, dtypes and values, bit for bit."""
    a, b = tensors(a_dir), tensors(b_dir)
    assert set(a) == set(b), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (what, k)


def assert_left_padding(hf, ours, x):
    """Row 1 of `x` [2, L] left-padded by 7 tokens: our logits on the kept tokens equal transformers' (1e-4),
    and the mask changes something (they differ from an unmasked run). -> our masked logits."""
    mask = torch.ones_like(x)
    mask[1, :7] = 0
    with torch.no_grad():
        ref, out, plain = hf(x, attention_mask=mask).logits, ours(x, attention_mask=mask), ours(x)
    keep = mask.bool()
    assert (out[keep] - ref[keep]).abs().max().item() <= 1e-4
    assert (plain[1, 7:] - out[1, 7:]).abs().max().item() > 1e-3
    return out


# the recomputation tests' models (also run in a child process by test_recompute's FSDP2 script)
RV, RB, RL = 128, 2, 96
_RBASE = dict(vocab_size=RV, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=64, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8,
            chunk_size=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
RECOMPUTE_CONFIGS = {
    "nemotron": dict(pattern="M*-EM", moe_shared_expert_intermediate_size=16, **_RBASE),
    "llama_moe": dict(pattern="*-*E", mlp_act="silu", mlp_gated=True, rope_theta=10000.0, qk_norm=True,
                      router="softmax", **_RBASE),
}


def recompute_build(name, seed=0):
    torch.manual_seed(seed)
    return init_weights(HybridLM(ModelConfig(**RECOMPUTE_CONFIGS[name])), std=0.1, seed=seed)


def recompute_batch(seed=1, mask=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, RV, (RB, RL), generator=g)
    am = None
    if mask:
        am = torch.ones(RB, RL, dtype=torch.long)
        am[1, :7] = 0  # left padding in one row
    return ids, am


def recompute_step(model, ids, am):
    """Loss (LM + a router z-loss, so gradients also flow through router_logits) and its gradients."""
    model.zero_grad(set_to_none=True)
    logits = model(ids, attention_mask=am)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, RV), ids[:, 1:].reshape(-1))
    for moe in model.moe_layers():
        loss = loss + 1e-2 * moe.router_logits.logsumexp(-1).pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}




# ---- markers ---------------------------------------------------------------------------------------
# README's command runs everything (CI: the rest on two xdist workers, then the serial tests below, alone);
# `python -m pytest -q tests` runs the same tests in one process; `python -m pytest -q -m "not slow" tests` is the
# edit-test loop. The markers (registered in pyproject.toml) are given here, not in the test files:
#   multiprocess  torchrun / several processes (process groups, killed ranks)
#   timing        asserts a speed ratio
#   quality       trains or evaluates for a quality figure
#   slow          left out of the edit-test loop: every test of the three kinds above, plus the longest
#                 of the rest (durations measured with `--durations=0` on the shared 2-core machine:
#                 the whole suite 13m17s idle (504 tests), the not-slow rest 1m30s, 2026-11-24)
# MARKS: test file -> test function (the name without its [parameters]; "*" = every test of the file)
# -> markers. A test marked in its own file with multiprocess / timing / quality is made slow too.
# An entry that matches no collected test fails a run that collects the whole tests/ folder.
MARKS = {
    "test_bad_input.py": {
        "test_kill9_distill_then_rerun_leaves_out_and_run": "slow",
        "test_kill9_then_rerun_leaves_only_out": "slow",
    },
    "test_checkpoint.py": {
        "test_copy_memory_is_bounded": "slow",
    },
    "test_convert_cli.py": {
        "test_roundtrip_identical_and_loads_in_transformers": "slow",
        "test_llama_to_mixtral_family_refused_and_qwen_export": "slow",
        "test_malformed_inputs_one_line_error_nothing_written": "slow",
        "test_refuses_non_empty_out_and_writing_into_model": "slow",
        "test_conversion_memory_bounded": "slow",
    },
    "test_demo.py": {
        "test_demo_quick": "slow",
    },
    "test_recipe.py": {
        "test_shrink_recipe_end_to_end_then_every_step_skipped": "slow",
        "test_dense_to_moe_recipe_end_to_end": "slow",
        "test_killed_run_resumes_from_its_last_complete_step": "slow",
    },
    "test_tasks.py": {
        "test_eval_tasks_equals_lm_eval_cli": "slow",
    },
    "test_shipped_tasks.py": {
        "test_nextphrase_separates_unpruned_from_pruned": "quality",
    },
    "test_embedded.py": {
        "test_held_out_perplexity_matches_record": "quality",
        "test_moe_held_out_loss": "quality",
        "test_load_does_not_import_dynamo": "slow",
    },
    "test_hybridize_quality.py": {
        "test_attention_init_beats_random_after_the_same_distillation": "quality",
        "test_stage_one_moves_the_hybrid_towards_the_source": "quality",
        "test_gdn_attention_init_beats_random_after_the_same_distillation": "quality",
        "test_kda_attention_init_beats_random_after_the_same_distillation": "quality",
        "test_layer_transfer_against_stream_transfer": "quality",
    },
    "test_expert_prune_quality.py": {
        "test_routed_reconstruction_beats_frequency_and_random_on_the_trained_moe": "quality",
    },
    "test_hybridize_quality_qwen3.py": {
        "test_qwen3_gdn_attention_init_beats_random_through_the_cli": "quality",
    },
    "test_hybridize_stream.py": {
        "test_hybridize_memory_is_bounded": "slow serial",
    },
    "test_head_criteria_quality.py": {
        "test_default_beats_magnitude_and_random_on_gdn_heads": "quality",
    },
    "test_mamba_head_quality.py": {
        "test_default_beats_magnitude_on_mamba_heads": "quality",
    },
    "test_fused_loss.py": {
        "test_peak_memory_far_below_logits": "slow",
        "test_vocab_parallel_group_matches_single_process": "multiprocess",
    },
    "test_families.py": {
        "test_distill_dp2_tp2_equals_one_process": "multiprocess",
    },
    "test_fuzz.py": {
        "*": "slow",
    },
    "test_gpu_paths.py": {
        "test_bench_gpu_smoke": "slow",
    },
    "test_moe_prune.py": {
        "test_cli_scores_experts_and_prunes_latent": "slow",
    },
    "test_mtp.py": {
        "test_convert_is_byte_identical_with_mtp": "slow",
        "test_cli_prune_keeps_mtp_pruned_and_loads_in_transformers": "slow",
    },
    "test_packaging.py": {
        "test_install_target_has_one_namespace": "slow",
    },
    "test_parallel.py": {
        "test_training_matches_single_process": "multiprocess",
        "test_vocab_parallel_losses": "multiprocess",
        "test_dead_or_stalled_rank_does_not_hang": "multiprocess",
    },
    "test_released_configs.py": {
        "test_search_over_a_released_config_miniature": "slow",
    },
    "test_plan.py": {
        "test_search_matches_brute_force": "slow",
        "test_extremes_are_the_grid_extremes": "slow",
        "test_fast_on_56b": "timing",
        "test_56b_to_47b_minipuzzle_shape": "slow",
        "test_8b_to_4b_minitron_ssm_shape": "slow",
        "test_active_params_budget_moe": "slow",
        "test_memory_budget_filters": "slow",
        "test_every_candidate_is_a_valid_prune_target": "slow",
    },
    "test_prune.py": {
        "test_pruning_memory_is_bounded": "slow",
        "test_prune_from_data_scores_then_reuses_them": "slow",
    },
    "test_prune_quality.py": {
        "test_activation_beats_random_on_the_embedded_model": "quality",
        "test_baseline_scores_through_score_and_prune": "slow",
    },
    "test_recompute.py": {
        "test_composes_with_fsdp2": "slow",
        "test_trainer_applies_the_flag_by_saved_bytes": "slow",
    },
    "test_scan.py": {
        "test_blocked_scan_equals_recurrence": "slow",
    },
    "test_score.py": {
        "test_streaming_memory_stays_under_cap": "slow",
    },
    "test_search.py": {
        "test_search_end_to_end": "slow",
        "test_scaled_56b_plan_picks_the_47b_class": "slow",
        "test_dry_run_smoke": "slow",
    },
    "test_super.py": {
        "test_super_75b_plan_prunes_every_axis": "slow",
        "test_dry_run_smoke": "slow",
    },
    "test_tokens.py": {
        "test_shipped_corpus_equals_pack": "slow",
        "test_sampler_matches_todays_batches": "slow",
        "test_rss_flat_with_10x_corpus": "slow",
    },
    "test_tokenize_stream.py": {
        "test_same_bytes_as_in_ram": "slow",
        "test_sigkill_then_rerun_resumes_identically": "multiprocess",
        "test_a_killed_worker_fails_in_one_line_and_the_rerun_resumes": "multiprocess",
        "test_concurrent_runs_on_one_corpus_share_one_tokenization": "multiprocess",
        "test_peak_rss_flat_with_10x_corpus": "slow",
    },
    "test_token_validation.py": {
        "test_tokenize_workers_die_with_a_killed_parent": "multiprocess",
    },
    "test_train.py": {
        "test_resume_after_sigkill_is_exact": "multiprocess",
        "test_kill_while_writing_a_checkpoint_keeps_the_previous": "multiprocess",
        "test_teacher_frozen_and_outputs": "slow",
        "test_distillation_beats_lm_only_at_equal_tokens": "quality",
        "test_resume_refuses_changed_data_and_trains_on_a_blend": "slow",
        "test_fused_loss_trains_like_the_unfused": "slow",
    },
    "test_train_parallel.py": {
        "test_launches_succeed": "multiprocess",
        "test_matches_one_process": "multiprocess",
        "test_resume_is_exact_and_layout_free": "multiprocess",
        "test_dead_or_stalled_rank_ends_the_job": "multiprocess",
        "test_dcp_checkpoint_resumes_under_other_layouts": "multiprocess",
    },
}

KINDS = ("multiprocess", "timing", "quality")  # each of these implies slow
# serial: never beside another test. The README's command runs the rest on two pytest-xdist workers, then these
# alone (`-n 2 --dist loadfile -m "not serial" ... && -m serial`): every multiprocess and timing test, the tests
# that assert a peak RSS (below), and a test sharing a module fixture of its file with one of these.
# (xdist's `--dist loadgroup` would do it in one pass, but pytest-xdist 3.8 cannot group under pytest 9:
# it renames item._nodeid, which pytest 9 no longer reads.)
SERIAL_KINDS = ("multiprocess", "timing")
PEAK_RSS = {
    "test_checkpoint.py": {"test_copy_memory_is_bounded"},
    "test_convert_cli.py": {"test_conversion_memory_bounded"},
    "test_fused_loss.py": {"test_peak_memory_far_below_logits"},
    "test_hybridize_stream.py": {"test_hybridize_memory_is_bounded"},
    "test_prune.py": {"test_pruning_memory_is_bounded"},
    "test_score.py": {"test_streaming_memory_stays_under_cap"},
    "test_sharded_memory.py": {"test_each_rank_peaks_well_under_one_process"},
    "test_tokens.py": {"test_rss_flat_with_10x_corpus"},
    "test_tokenize_stream.py": {"test_peak_rss_flat_with_10x_corpus"},
}
TESTS_DIR = Path(__file__).resolve().parent


def _whole_folder(config) -> bool:
    """True when this run collects all of tests/ (no file or node ids, no --ignore / --lf narrowing)."""
    args = [a for a in config.args if not a.startswith("-")] or [str(config.rootpath / p) for p in
                                                                   config.getini("testpaths")]
    if not args or any(Path(config.invocation_params.dir, a).resolve() != TESTS_DIR for a in args):
        return False
    narrowing = ("ignore", "ignore_glob", "deselect", "lf", "failedfirst", "stepwise")
    return not any(_opt(config, o) for o in narrowing)


def _opt(config, name):
    try:
        return config.getoption(name)
    except ValueError:
        return None


@pytest.hookimpl(tryfirst=True)  # before -m / -k deselect anything, so the markers count there
def pytest_collection_modifyitems(session, config, items):
    used = set()
    for item in items:
        table = MARKS.get(item.path.name, {})
        names = set()
        for key in (item.originalname if hasattr(item, "originalname") else item.name, item.name, "*"):
            if key in table:
                used.add((item.path.name, key))
                names.update(table[key].split())
        names.update(m.name for m in item.iter_markers() if m.name in KINDS)
        if names & set(KINDS):
            names.add("slow")
        if names & set(SERIAL_KINDS) or getattr(item, "originalname", item.name) in PEAK_RSS.get(item.path.name, ()):
            names.add("serial")
        for name in sorted(names):
            item.add_marker(name)
    _serial_with_its_fixtures(items)
    if session.testsfailed or not _whole_folder(config):
        return  # a file that failed to import, or a partial run: unmatched entries prove nothing
    stale = [f"{f}::{t}" for f, tests in MARKS.items() for t in tests if (f, t) not in used]
    if stale:
        raise pytest.UsageError("tests/conftest.py MARKS names tests that were not collected (renamed or "
                                "removed? update the table): " + ", ".join(stale))


def _module_fixtures(item) -> set:
    """(file, name) of the module-scoped fixtures defined in the item's own test file that it uses."""
    info = getattr(item, "_fixtureinfo", None)
    module = item.getparent(pytest.Module)
    if info is None or module is None:
        return set()
    return {(item.path.name, n) for n, defs in info.name2fixturedefs.items()
            if defs and defs[-1].scope == "module" and defs[-1].baseid == module.nodeid}


def _serial_with_its_fixtures(items):
    """A test sharing a module fixture of its file with a serial test is serial too: the fixture (a launch)
    then runs once, in the serial phase."""
    shared = set().union(*(_module_fixtures(i) for i in items if i.get_closest_marker("serial")))
    for item in items:
        if not item.get_closest_marker("serial") and _module_fixtures(item) & shared:
            item.add_marker("serial")


_HF_BUILT = {}


def hf_pair(model_type, root, name, seed, **hf_config):
    """(a transformers `model_type` model from hf_config with randomised weights (fp32, eval), ours loaded
    from its save_pretrained, the checkpoint dir), built once per (root, name): the one builder of the
    per-family parity tests (transformers is the oracle)."""
    key = (str(root), name)
    if key not in _HF_BUILT:
        from transformers import AutoConfig, AutoModelForCausalLM

        from remodel.models.load import load_model
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **hf_config)).float().eval()
        randomise(hf, seed=seed)
        d = Path(root) / name
        hf.save_pretrained(d)
        _HF_BUILT[key] = hf, load_model(d), d
    return _HF_BUILT[key]


# ---- hybridize: a tiny Llama / Qwen3 saved by transformers, the shapes its tests read -----------------------------
HYBRID_SOURCE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, intermediate_size=40, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def hybrid_sources(tmp_path_factory):
    """{model_type: (transformers model with randomised weights, its checkpoint dir)} for llama and qwen3."""
    root = tmp_path_factory.mktemp("hybrid_src")
    return {t: hf_pair(t, root, t, 7, **HYBRID_SOURCE)[::2] for t in ("llama", "qwen3")}


def loaded_as(out, arch: str):
    """transformers' model of checkpoint `out` in fp32 eval mode, checked to be of class `arch`."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    assert type(m).__name__ == arch
    return m


def attention_skipped(hf, layers, ids):
    """A transformers model's logits with the attention of `layers` contributing nothing (a silent mixer there)."""
    hooks = [hf.model.layers[j].self_attn.register_forward_hook(lambda m, a, o: (torch.zeros_like(o[0]),) + o[1:])
             for j in layers]
    try:
        with torch.no_grad():
            return hf(ids).logits
    finally:
        for h in hooks:
            h.remove()


def cli_pair(family, case, root):
    """(transformers model, ours, checkpoint dir) of a family's tiny case at the embedded tokenizer's vocabulary,
    the tokenizer copied beside it: a checkpoint the CLI reads as a user's (score, prune, eval)."""
    import shutil

    from remodel.pipelines.data.data import embedded_tokenizer_path
    hf, ours, d = hf_pair(family, root, "model", 5, **dict(FAMILIES[family].tiny[case], vocab_size=2048))
    for f in embedded_tokenizer_path().iterdir():
        shutil.copy(f, d / f.name)
    return hf, ours, d


def cli_inspect_and_score(d, ours, out, capsys):
    """`remodel inspect d` prints `ours`'s exact parameter count, then `remodel score d` on the embedded corpus
    writes `out`: -> its scores (the first steps of every CLI-family test)."""
    from remodel import cli
    from remodel.compress.scores import load_scores
    from remodel.pipelines.data.data import embedded_corpus
    assert cli.main(["inspect", str(d)]) == 0
    assert f"{sum(p.numel() for p in ours.parameters()):,}" in capsys.readouterr().out
    assert cli.main(["score", str(d), "--data", str(embedded_corpus()[1]), "--out", str(out), "--samples", "8",
                     "--seq-len", "32"]) == 0
    return load_scores(out)[0]


def cli_flags(targets: dict) -> list:
    """prune's width flags of {width: target}."""
    return [x for k, v in targets.items() for x in ("--" + k.replace("_", "-"), str(v))]


def reloaded_equals_in_memory(out, model):
    """transformers' model from `out` and ours from `out` give the in-memory pruned model's logits."""
    from transformers import AutoModelForCausalLM

    from remodel.models.load import load_model
    x = torch.randint(0, model.cfg.vocab_size, (2, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want, ours = AutoModelForCausalLM.from_pretrained(out).float().eval()(x).logits, model(x), load_model(out)(x)
    assert (got - want).abs().max().item() <= 1e-4 and (ours - want).abs().max().item() <= 1e-5


def _smaller(cfg, name: str) -> int:
    """A smaller value of width `name` that prune accepts for the model's family (its divisibility rules, and
    the family's own: a Mamba width that is a multiple of hidden), a quarter less or the nearest below it."""
    from remodel.compress.prune import validate_targets
    from remodel.models.errors import RemodelError
    from remodel.models.kinds import WIDTHS
    w = WIDTHS[name]
    v, step = w.of(cfg), math.lcm(*(cfg.get(f) or 1 for f in (w.multiple_of, w.step_lcm) if f))
    for t in sorted((t for t in range(v - 1, 0, -1) if t % step == 0), key=lambda t: (t > v - max(1, v // 4), -t)):
        try:
            validate_targets(cfg, {name: t})
            return t
        except RemodelError:
            continue
    raise AssertionError(f"no smaller {name} than {v} is a valid target of {cfg.pattern!r}")


def prune_axes(cfg) -> dict:
    """{width: smaller target} for hidden and every width the kinds of `cfg` prune (a width it has)."""
    from remodel.models.kinds import used
    from remodel.models.kinds import WIDTHS
    names = {"hidden_size"} | {n for k in used(cfg) for n in k.widths}
    return {n: _smaller(cfg, n) for n, w in WIDTHS.items() if w.unit and n in names and w.of(cfg)}


@pytest.fixture(autouse=True, scope="module")
def _worker_thread_count():
    """Under pytest-xdist a module that sets its own thread count (test_embedded's 2) leaves its worker at one."""
    yield
    if XDIST:
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny ops (`pytestmark = pytest.mark.usefixtures("one_thread")`): on a
    shared, oversubscribed CPU OpenMP's barriers would dominate them."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
