"""lm-evaluation-harness tasks on a checkpoint (`remodel eval --tasks`), offline and on local data only.

The model runs as transformers' own (lm-eval's `hf` model: AutoModelForCausalLM, trust_remote_code=False,
local files only), so a figure here is the one `python -m lm_eval --model hf` gives for the same folder.
Tasks are lm-eval YAMLs found by its TaskManager (include_path) in the shipped data/tasks/ and in
--task-dir; a relative `dataset_kwargs.data_files` is read beside its YAML. lm-eval is the optional
extra `remodel[eval]`; its absence, an unknown task name and a bad --task-dir are one-line errors raised
by `check_tasks`, before any model is loaded.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path

from remodel.models.errors import RemodelError


# the shipped tasks: remodel_cloze, remodel_nextline (pipelines.data.data.DATA_DIR / "tasks", named here without
# importing that module: it imports datasets, ~50 MB that prune's and search's streaming memory must not carry)
TASK_DIR = Path(__file__).resolve().parents[2] / "data" / "tasks"
METRICS = ("acc", "acc_norm", "exact_match")  # what the table shows, when a task reports it


def _lm_eval():
    """lm_eval, imported offline (no hub or dataset download) and quiet; a one-line error when missing."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets.config
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True  # read at their import,
    datasets.config.constants.HF_HUB_OFFLINE = True  # huggingface_hub's; pipelines.data already imported both
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise RemodelError("--tasks needs lm-evaluation-harness, an optional extra: pip install remodel[eval]") from None
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return lm_eval, TaskManager


def _absolute(files, base: Path):
    """data_files (a str, list or split -> str/list dict) with each relative path that exists beside
    the YAML made absolute (lm-eval would read it from the current directory)."""
    if isinstance(files, dict):
        return {k: _absolute(v, base) for k, v in files.items()}
    if isinstance(files, (list, tuple)):
        return [_absolute(v, base) for v in files]
    if isinstance(files, str) and not os.path.isabs(files) and (base / files).exists():
        return str(base / files)
    return files


def check_tasks(names: list[str], task_dir=None) -> tuple[object, list]:
    """(lm-eval TaskManager, the task specs to run) for `names`; one-line errors for a missing lm-eval,
    a --task-dir that is not a folder, and a name no local task has (listing the ones there are)."""
    if not names:
        raise RemodelError("--tasks needs at least one task name")
    dirs = [TASK_DIR]
    if task_dir is not None:
        d = Path(task_dir).expanduser()
        if not d.is_dir():
            raise RemodelError(f"{d}: not a folder of lm-eval task YAMLs (--task-dir)")
        dirs.append(d)
    _, TaskManager = _lm_eval()
    with _quiet():
        tm = TaskManager(include_path=[str(d) for d in dirs], include_defaults=False)
    unknown = [n for n in names if n not in tm.all_tasks]
    if unknown:
        raise RemodelError(f"unknown task {unknown[0]!r} (--tasks); the local tasks are: {', '.join(tm.all_tasks)}")
    return tm, [_spec(tm, n) for n in names]


def check_task_options(tasks, task_dir=None, limit=None):
    """check_tasks' result for the --tasks names, or None when none are given (then --task-dir and --limit,
    which only serve --tasks, are refused): what eval, prune and search call before any work."""
    if tasks is None:
        if task_dir is not None or limit is not None:
            raise RemodelError("--task-dir and --limit apply to --tasks, which is not given")
        return None
    return check_tasks(tasks, task_dir)


def add_tasks(report: dict, model_dir, checked, limit: int | None = None) -> dict:
    """`report` with `tasks`: the accuracy of the written checkpoint `model_dir` on the checked tasks
    (check_task_options' result; None: the report as it is). prune and search put their result's here."""
    if checked is not None:
        report["tasks"] = run_tasks(model_dir, [], limit=limit, checked=checked)
    return report


def _spec(tm, name: str):
    """A YAML task as its config dict with data_files resolved beside the YAML; a group or tag by name."""
    from lm_eval.tasks._yaml_loader import load_yaml
    entry = tm.task_index[name]
    if entry.yaml_path is None or "task" not in (cfg := load_yaml(entry.yaml_path, resolve_func=True)):
        return name
    kw = cfg.get("dataset_kwargs") or {}
    if "data_files" in kw:
        cfg["dataset_kwargs"] = {**kw, "data_files": _absolute(kw["data_files"], Path(entry.yaml_path).parent)}
    return cfg


@contextlib.contextmanager
def _quiet():
    """lm-eval's own prints, warnings and progress bars kept off normal output (its errors still raise);
    transformers' notices too (its "install causal_conv1d / mamba_ssm" one is about CUDA kernels)."""
    from transformers.utils import logging as hf_logging

    from .fp8 import import_torchao_quietly
    import_torchao_quietly()  # transformers' loading imports torchao, which prints CUDA-library notices
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(level)


@contextlib.contextmanager
def _no_env_report():
    """lm-eval adds an environment report to every result (torch's collect_env, which runs pip, lscpu and
    more in subprocesses, ~1 s a call, and git hashes); remodel reads only the scores, so it is skipped."""
    import lm_eval.evaluator as ev
    names = [n for n in ("add_env_info", "get_git_commit_hash") if hasattr(ev, n)]
    saved = {n: getattr(ev, n) for n in names}
    for n in names:
        setattr(ev, n, lambda *a, **k: None)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(ev, n, f)


def run_tasks(model_dir, names: list[str], task_dir=None, limit: int | None = None, batch: int = 8,
              device: str = "auto", checked=None) -> dict:
    """{task: {metric: value, metric_stderr: value, "samples": n}} of lm-eval's `hf` model on `model_dir`.
    checked: check_tasks' result when the caller already validated the names."""
    import torch

    from remodel.models.load import load_config

    from ..distributed.runtime import pick_device, refuse_remote_code
    tm, specs = checked or check_tasks(names, task_dir)
    load_config(model_dir)  # one-line errors for a folder that is no checkpoint, or one with code to run
    refuse_remote_code(model_dir)
    lm_eval, _ = _lm_eval()
    dev = pick_device(device)
    args = {"pretrained": str(model_dir), "trust_remote_code": False, "local_files_only": True,
            "dtype": "bfloat16" if dev.type == "cuda" else "float32", "device": str(dev), "batch_size": batch}
    with _quiet(), _no_env_report(), torch.no_grad():
        out = lm_eval.simple_evaluate(model="hf", model_args=args, tasks=specs, task_manager=tm, limit=limit,
                                      log_samples=False, bootstrap_iters=0 if limit else 100000)
    res, n = out["results"], out.get("n-samples", {})
    return {t: {**{k.split(",")[0]: v for k, v in r.items() if k not in ("alias", "sample_len") and isinstance(v, (int, float))},
                "samples": (n.get(t) or {}).get("effective")} for t, r in res.items()}


def format_tasks(results: dict) -> str:
    """One table row per task: its accuracy figures and how many items were scored."""
    rows = [f"{'task':<24}{'metric':<12}{'value':>8}{'stderr':>9}{'n':>6}"]
    for t, r in results.items():
        for m in [m for m in METRICS if m in r] or [k for k in r if not k.endswith("_stderr") and k != "samples"][:1]:
            err = r.get(f"{m}_stderr")
            err = f"{err:>9.4f}" if isinstance(err, (int, float)) else f"{'-':>9}"
            rows.append(f"{t:<24}{m:<12}{r[m]:>8.4f}{err}{r.get('samples') or '':>6}")
    return "\n".join(rows)
