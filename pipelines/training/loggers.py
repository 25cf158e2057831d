"""Optional experiment logging of `train` / `distill` (rank 0 only), beside metrics.csv and the report:

  --log-dir DIR          TensorBoard event files, through torch.utils.tensorboard.SummaryWriter (needs the
                         tensorboard package: pip install 'remodel[tensorboard]'); `tensorboard --logdir DIR`
  --wandb-project NAME   a Weights & Biases run in that project (needs wandb: pip install 'remodel[wandb]';
                         WANDB_MODE=offline logs without a network), its config the run's recorded arguments

Every step logs its history row's numbers (each loss term, lr, grad_norm, tokens_per_s; an MoE row's numbers
one level down) as train/<name>, and the held-out evaluations (--eval-data) as eval/<name> at the first step
(before) and the last (after). Neither package is imported unless its flag is given; a missing one is a one-line
error naming the flag, raised with the other option checks (before any work, nothing written).
"""
from __future__ import annotations

import numbers
from pathlib import Path

from remodel.models.errors import RemodelError


def _summary_writer():
    try:
        import tensorboard  # noqa: F401 - the package torch.utils.tensorboard writes with (the extra)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise RemodelError("--log-dir writes TensorBoard event files and needs the tensorboard package "
                           "(pip install 'remodel[tensorboard]')") from None
    return SummaryWriter


def _wandb():
    try:
        import wandb
    except ImportError:
        raise RemodelError("--wandb-project needs the wandb package (pip install 'remodel[wandb]')") from None
    return wandb


def check_loggers(c) -> None:
    """One-line refusals of --log-dir / --wandb-project (a missing package, a file where the folder goes)."""
    if c.log_dir is not None:
        if Path(c.log_dir).exists() and not Path(c.log_dir).is_dir():
            raise RemodelError(f"--log-dir {c.log_dir}: is a file (TensorBoard writes a folder)")
        _summary_writer()
    if c.wandb_project is not None:
        if not str(c.wandb_project).strip():
            raise RemodelError("--wandb-project must name a project, got an empty string")
        _wandb()


def _numbers(row: dict, prefix: str) -> dict:
    """{prefix/name: float} of a history row's numbers (a dict's one level down; 'step' left out)."""
    out = {}
    for k, v in row.items():
        if isinstance(v, dict):
            out.update(_numbers(v, f"{prefix}/{k}"))
        elif isinstance(v, numbers.Real) and not isinstance(v, bool) and k != "step":
            out[f"{prefix}/{k}"] = float(v)
    return out


class Loggers:
    """The run's TensorBoard writer and W&B run (either may be absent; nothing at all off rank 0)."""

    def __init__(self, c, args: dict, lead: bool):
        self.tb = self.run = None
        if lead and c.log_dir is not None:
            self.tb = _summary_writer()(log_dir=str(c.log_dir))
        if lead and c.wandb_project is not None:
            self.run = _wandb().init(project=c.wandb_project, config=dict(args), name=Path(args["out"]).name)

    def log(self, values: dict, step: int) -> None:
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        if self.run is not None and values:
            self.run.log(values, step=step)

    def step(self, row: dict) -> None:
        self.log(_numbers(row, "train"), row["step"])

    def eval(self, ev: dict | None, step: int) -> None:
        """eval/<name> of a held-out evaluation (None: none was run)."""
        if isinstance(ev, dict):
            self.log(_numbers(ev, "eval"), step)

    def finish(self, ev: dict | None, step: int) -> None:
        """The evaluation after training, then the writers closed."""
        self.eval(ev, step)
        self.close()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
        if self.run is not None:
            self.run.finish()
        self.tb = self.run = None
