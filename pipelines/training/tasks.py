"""lm-evaluation-harness tasks on a checkpoint (`remodel eval --tasks`), offline and on local data only.

The model runs as transformers' own (lm-eval's `hf` model: AutoModelForCausalLM, trust_remote_code=False,
local files only), so a figure here is the one `python -m lm_eval --model hf` gives for the same folder.
Tasks are lm-eval YAMLs found by its TaskManager (include_path) in the shipped data/tasks/ and in
--task-dir; a relative `dataset_kwargs.data_files` is read beside its YAML. lm-eval is the optional
extra `remodel[eval]`; its absence, an unknown task name and a bad --task-dir are one-line errors raised
by `check_tasks`, before any model is loaded.

A task folder is hostile input (issue 53). Before lm-eval opens a file, remodel reads every YAML itself
(scan_folders: regular files, bounded sizes and alias expansion, safe tags) and refuses, unless --trust-task-code,
what runs code: `!function`, `class`, custom datasets and prompts, dataset scripts or remote code, and
`include:` outside the folder. lm-eval then builds the tasks from those checked configs (checked_yaml),
its templates render in jinja's sandbox (_sandbox_templates), and every item is checked (_check_docs), all
before the model loads; lm-eval's and datasets' exceptions become one RemodelError line (_one_line).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path

from remodel.models.errors import RemodelError

from .task_folder import LINES, checked_yaml, register_groups, resolve_functions, scan_folders


# the shipped tasks: remodel_cloze, remodel_nextphrase (pipelines.data.data.DATA_DIR / "tasks", named here without
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
    _sandbox_templates()
    return lm_eval, TaskManager


def _sandbox_templates():
    """lm-eval renders every task template (doc_to_text, doc_to_choice, ...) with its module-level jinja
    Environment, lm_eval.utils.env, which lets a template reach Python (`lipsum.__globals__`); it is replaced
    by jinja's ImmutableSandboxedEnvironment with the same settings and filters."""
    import lm_eval.utils as lm_utils
    from jinja2 import BaseLoader, StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    if not isinstance(lm_utils.env, ImmutableSandboxedEnvironment):
        env = ImmutableSandboxedEnvironment(loader=BaseLoader, undefined=StrictUndefined, keep_trailing_newline=True)
        env.filters.update(lm_utils.env.filters)
        lm_utils.env = env


@contextlib.contextmanager
def _one_line(what: str):
    """lm-eval's and datasets' exceptions as one RemodelError line naming `what` (never a traceback)."""
    try:
        yield
    except (RemodelError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - every library fault becomes the one error line
        raise RemodelError(f"{what}: {_describe(e)}") from None


def _describe(e: BaseException) -> str:
    """'Type: first line of the message', and its root cause's too (datasets wraps the parse error)."""
    def line(x):
        msg = (str(x).strip().splitlines() or [""])[0][:300]
        return f"{type(x).__name__}{': ' + msg if msg else ''}"
    root, seen = e, set()
    while (root.__cause__ or root.__context__) is not None and id(root) not in seen:
        seen.add(id(root))
        root = root.__cause__ or root.__context__
    return line(e) if root is e else f"{line(e)} ({line(root)})"


class _SkipTestDoc(Exception):
    """Raised in place of lm-eval's one-document test inside ConfigurableTask.__init__ (_no_test_doc)."""


@contextlib.contextmanager
def _no_test_doc():
    """ConfigurableTask built without its one-document test (the first item's text, target and choices,
    which fail as a bare IndexError or KeyError): _check_docs then checks every item, naming it and the field."""
    from lm_eval.api.task import ConfigurableTask
    init, to_text = ConfigurableTask.__init__, ConfigurableTask.doc_to_text

    def doc_to_text(self, doc, *a, **k):
        if self.__dict__.pop("_remodel_building", False):
            raise _SkipTestDoc
        return to_text(self, doc, *a, **k)

    def __init__(self, *a, **k):
        self._remodel_building = True
        try:
            init(self, *a, **k)
        except _SkipTestDoc:
            pass
        finally:
            self.__dict__.pop("_remodel_building", None)

    ConfigurableTask.__init__, ConfigurableTask.doc_to_text = __init__, doc_to_text
    try:
        yield
    finally:
        ConfigurableTask.__init__, ConfigurableTask.doc_to_text = init, to_text


def _validate(tm, specs, names, trust: bool):
    """Every requested task built by lm-eval (data loaded, templates rendered in the sandbox) and each of its
    items checked: documents present, choices non-empty, labels integral and in range, enough few-shot docs."""
    for name, spec in zip(names, specs):
        entry = tm.task_index.get(name)
        src = entry.yaml_path if entry is not None and entry.yaml_path else name
        with _quiet(), checked_yaml(tm.remodel_configs, trust), _no_test_doc(), _one_line(f"{src}: task {name!r}"):
            loaded = tm.load([spec])
        for tname, task in loaded["tasks"].items():
            e = tm.task_index.get(tname)
            path = Path(e.yaml_path).resolve() if e is not None and e.yaml_path else None
            lines = LINES.get(path, {})
            at = lambda field, p=path or src, lines=lines: lines.get(field) or str(p)  # noqa: E731
            with _one_line(f"{path or src}: task {tname!r}"):
                _check_docs(task, tname, at)


def _check_docs(task, name: str, at):
    """Every item of `task`: its text, target and choices render; a multiple-choice label is an index of its
    (non-empty) choices or one of them; enough few-shot documents. at(field) -> "file:line" of the field."""
    where = lambda field: f"{at(field)}: task {name!r}"  # noqa: E731
    docs = task.eval_docs
    if len(docs) == 0:
        raise RemodelError(f"{where('test_split')}: no documents in its evaluation split (--task-dir)")
    shots = task.get_config("num_fewshot") or 0
    if shots:
        fs = task.fewshot_docs()
        have = len(fs) if fs is not None else 0
        same = fs is None or task.get_config("fewshot_split") in (None, task.get_config("test_split"))
        if have < shots + same:
            raise RemodelError(f"{where('num_fewshot')}: num_fewshot {shots} needs {shots + same} few-shot "
                               f"documents, the few-shot split has {have}")
    mc = task.get_config("output_type") == "multiple_choice"
    for i, doc in enumerate(docs):
        field = "doc_to_text"
        try:
            text = task.doc_to_text(doc)
            field = "doc_to_target"
            target = task.doc_to_target(doc)
            field = "doc_to_choice"
            choices = task.doc_to_choice(doc) if mc or task.get_config("doc_to_choice") is not None else None
        except RemodelError:
            raise
        except Exception as e:  # noqa: BLE001
            raise RemodelError(f"{where(field)}: item {i} ({field}): {_describe(e)}") from None
        if not mc:
            continue
        if not isinstance(choices, list) or not choices:
            raise RemodelError(f"{where('doc_to_choice')}: item {i} (doc_to_choice): no choices ({choices!r})")
        golds = [text] if isinstance(text, int) and not isinstance(text, bool) else (
            target if isinstance(target, list) else [target])
        for g in golds:
            if isinstance(g, str):
                if g not in choices:
                    raise RemodelError(f"{where('doc_to_target')}: item {i} (doc_to_target): label {g!r} is "
                                       f"neither an index nor one of its {len(choices)} choices")
            elif isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < len(choices):
                raise RemodelError(f"{where('doc_to_target')}: item {i} (doc_to_target): label {g!r} is not an "
                                   f"index in [0, {len(choices) - 1}] of its {len(choices)} choices")


def check_tasks(names: list[str], task_dir=None, trust: bool = False) -> tuple[object, list]:
    """(lm-eval TaskManager, the task specs to run) for `names`; one-line errors for a missing lm-eval,
    a --task-dir that is not a folder, a name no local task has (listing the ones there are), and every
    task-folder fault (code without --trust-task-code, bounds, bad items), before any model is loaded."""
    if not names:
        raise RemodelError("--tasks needs at least one task name")
    dirs = [TASK_DIR]
    if task_dir is not None:
        d = Path(task_dir).expanduser()
        if not d.is_dir():
            raise RemodelError(f"{d}: not a folder of lm-eval task YAMLs (--task-dir)")
        dirs.append(d)
    _, TaskManager = _lm_eval()
    with _one_line(f"{dirs[-1]} (--task-dir)"):
        configs = scan_folders(dirs, trust)  # every YAML read and checked by remodel before lm-eval opens one
    with _quiet(), _one_line(f"{dirs[-1]} (--task-dir)"):
        tm = TaskManager(include_path=[str(d) for d in dirs], include_defaults=False)
    unknown = [n for n in names if n not in tm.all_tasks]
    if unknown:
        raise RemodelError(f"unknown task {unknown[0]!r} (--tasks); the local tasks are: {', '.join(tm.all_tasks)}")
    register_groups(tm, configs)
    tm.remodel_configs, tm.remodel_trust = configs, trust
    specs = [_spec(tm, n) for n in names]
    _validate(tm, specs, names, trust)
    return tm, specs


def check_task_options(tasks, task_dir=None, limit=None, trust: bool = False):
    """check_tasks' result for the --tasks names, or None when none are given (then --task-dir, --limit and
    --trust-task-code, which only serve --tasks, are refused): what eval, prune and search call before any work."""
    if tasks is None:
        if task_dir is not None or limit is not None:
            raise RemodelError("--task-dir and --limit apply to --tasks, which is not given")
        if trust:
            raise RemodelError("--trust-task-code applies to --tasks, which is not given")
        return None
    return check_tasks(tasks, task_dir, trust)


def add_tasks(report: dict, model_dir, checked, limit: int | None = None, source=None) -> dict:
    """`report` with `tasks`: the accuracy of the written checkpoint `model_dir` on the checked tasks
    (check_task_options' result; None: the report as it is). prune and search put their result's here; with
    `source` (the model it was made from) also `tasks_before`, its accuracy on the same items."""
    if checked is not None:
        report["tasks"] = run_tasks(model_dir, [], limit=limit, checked=checked)
        if source is not None:
            report["tasks_before"] = run_tasks(source, [], limit=limit, checked=checked)
    return report


def _spec(tm, name: str):
    """A YAML task as its checked config dict (data_files resolved beside the YAML); a group or tag by name
    (lm-eval builds its members from the checked configs too, checked_yaml)."""
    entry = tm.task_index[name]
    if entry.yaml_path is None:
        return name
    cfg = tm.remodel_configs.get(Path(entry.yaml_path).resolve())
    if cfg is None or "group" in cfg or not isinstance(cfg.get("task"), str) or "class" in cfg:
        return name
    import copy
    cfg = copy.deepcopy(cfg)
    return resolve_functions(cfg, True) if tm.remodel_trust else cfg


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
              device: str = "auto", checked=None, trust: bool = False) -> dict:
    """{task: {metric: value, metric_stderr: value, "samples": n}} of lm-eval's `hf` model on `model_dir`.
    checked: check_tasks' result when the caller already validated the names; trust: --trust-task-code."""
    import torch

    from remodel.models.load import load_config

    from ..distributed.runtime import pick_device, refuse_remote_code
    tm, specs = checked or check_tasks(names, task_dir, trust)
    load_config(model_dir)  # one-line errors for a folder that is no checkpoint, or one with code to run
    refuse_remote_code(model_dir)
    lm_eval, _ = _lm_eval()
    dev = pick_device(device)
    args = {"pretrained": str(model_dir), "trust_remote_code": False, "local_files_only": True,
            "dtype": "bfloat16" if dev.type == "cuda" else "float32", "device": str(dev), "batch_size": batch,
            "use_cache": False}  # loglikelihood needs no cache; an attention-free hybrid's cache cannot count tokens
    with (_quiet(), _no_env_report(), torch.no_grad(), checked_yaml(tm.remodel_configs, tm.remodel_trust),
          _one_line(f"{model_dir}: lm-eval on {', '.join(n if isinstance(n, str) else n['task'] for n in specs)}")):
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
