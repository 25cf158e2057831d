"""remodel_report.json: what was done, inputs, figures."""
import json
import platform
import time
from pathlib import Path

import torch


def write_report(out_dir, report: dict) -> Path:
    report = {"remodel_report": 1, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "cpu_threads": torch.get_num_threads()}, **report}
    p = Path(out_dir) / "remodel_report.json"
    p.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return p
