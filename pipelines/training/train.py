"""Python API of `remodel train` and `remodel distill`.

    train(student_dir, out, data, teacher_dir=None, steps=100, ...)

takes any pipelines.training.train_config.TrainConfig field as a keyword (the defaults and their meaning live
there, shared with the command line and the report) and runs pipelines.training.trainer, in one process or,
under torchrun, on every rank. Returns the report on rank 0 (also in OUT/remodel_report.json).
"""
from __future__ import annotations

from .train_config import make_config
from .trainer import run


def train(student_dir, out, data, **settings) -> dict | None:
    """Train `student_dir` on `data` (distil from `teacher_dir` when given) and write OUT; see the module doc."""
    return run(make_config(student_dir=student_dir, out=out, data=data, **settings))
