"""`remodel eval`: held-out loss, perplexity and tokens/s (pipelines/training/evaluate.py) and lm-eval
tasks (pipelines/training/tasks.py) on one checkpoint. Every option is checked before a model is loaded."""
from __future__ import annotations

import math
from dataclasses import dataclass

from remodel.models.errors import RemodelError

from ..training import tasks as task_runs


@dataclass(frozen=True)
class TaskRequest:
    """The lm-eval tasks asked for: names (None: no tasks), --task-dir, --limit, and --trust-task-code (run the
    Python a task folder names; refused otherwise)."""
    names: list | None = None
    task_dir: object = None
    limit: int | None = None
    trust_task_code: bool = False


def eval_job(model_dir, data=None, *, seq_len: int = 256, batch: int = 8, max_tokens=None,
             request: TaskRequest = TaskRequest()) -> dict:
    """{loss, ppl, tokens/s... (with `data`), tasks: {task: figures} (with request.names)}; one-line errors for
    nothing to evaluate, a bad task option, and a loss that is not finite."""
    tasks, task_dir, limit, trust_task_code = request.names, request.task_dir, request.limit, request.trust_task_code
    if not data and tasks is None:
        raise RemodelError("nothing to evaluate: give --data (loss, perplexity) and/or --tasks (lm-eval tasks)")
    if tasks is not None and trust_task_code:  # MODEL checked before a trusted task folder's code runs
        from remodel.models.load import load_config

        from ..distributed.runtime import refuse_remote_code
        load_config(model_dir)
        refuse_remote_code(model_dir)
    checked = task_runs.check_task_options(tasks, task_dir, limit, trust_task_code)  # before any model is loaded
    r = {}
    if data:
        from ..training.evaluate import evaluate
        r = evaluate(model_dir, data, seq_len=seq_len, batch=batch, max_tokens=max_tokens)
    loss = r.get("loss")
    if isinstance(loss, float) and not math.isfinite(loss):
        raise RemodelError(f"{model_dir}: the loss is {loss} (not finite): the model's weights or activations "
                           "hold NaN/inf or overflow")
    if checked is not None:
        r["tasks"] = task_runs.run_tasks(model_dir, [], limit=limit, batch=batch, checked=checked)
    return r
