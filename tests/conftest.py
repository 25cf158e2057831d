"""Test-wide settings: keep idle OpenMP threads from spinning (on a 2-core
machine busy-waiting threads in one process slow every other process ~5x),
and keep tokenizers single-threaded; and the markers of the long tests (MARKS)."""
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# token sets cached by training runs go to a fresh folder per test session, not ~/.cache
if "REMODEL_CACHE" not in os.environ:
    import tempfile
    os.environ["REMODEL_CACHE"] = tempfile.mkdtemp(prefix="remodel-test-cache-")

# ---- markers ---------------------------------------------------------------------------------------
# `python -m pytest -q tests` runs everything (CI); `python -m pytest -q -m "not slow" tests` is the
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
        "test_llama_family_roundtrip": "slow",
        "test_llama_to_mixtral_family_refused_and_qwen_export": "slow",
        "test_malformed_inputs_one_line_error_nothing_written": "slow",
        "test_refuses_non_empty_out_and_writing_into_model": "slow",
        "test_conversion_memory_bounded": "slow",
    },
    "test_demo.py": {
        "test_demo_quick": "slow",
    },
    "test_embedded.py": {
        "test_held_out_perplexity_matches_record": "quality",
        "test_moe_held_out_loss": "quality",
        "test_load_does_not_import_dynamo": "slow",
    },
    "test_expert_prune_quality.py": {
        "test_routed_reconstruction_beats_frequency_and_random_on_the_trained_moe": "quality",
    },
    "test_fused_loss.py": {
        "test_peak_memory_far_below_logits": "slow",
        "test_vocab_parallel_group_matches_single_process": "multiprocess",
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
        for name in sorted(names):
            item.add_marker(name)
    if session.testsfailed or not _whole_folder(config):
        return  # a file that failed to import, or a partial run: unmatched entries prove nothing
    stale = [f"{f}::{t}" for f, tests in MARKS.items() for t in tests if (f, t) not in used]
    if stale:
        raise pytest.UsageError("tests/conftest.py MARKS names tests that were not collected (renamed or "
                                "removed? update the table): " + ", ".join(stale))
