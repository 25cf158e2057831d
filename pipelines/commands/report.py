"""remodel_report.json: what was done, inputs, figures."""
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch


def write_report(out_dir, report: dict) -> Path:
    report = {"remodel_report": 1, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "cpu_threads": torch.get_num_threads()}, **report}
    return write_json(Path(out_dir) / "remodel_report.json", report)


def write_json(path, obj) -> Path:
    """`obj` as JSON at `path`, atomically: a temporary file beside it, renamed over it (a reader, or a run
    killed meanwhile, sees the old file or the whole new one, never part of one)."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(obj, indent=2, default=str) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would create it, not mkstemp's 0600
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def _finite(obj, bad: list, where: str = ""):
    """obj with every NaN/inf float replaced by None (their paths appended to `bad`)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        bad.append(where or "value")
        return None
    if isinstance(obj, dict):
        return {k: _finite(v, bad, f"{where}.{k}" if where else str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v, bad, f"{where}[{i}]") for i, v in enumerate(obj)]
    return obj


def strict_json(obj, command: str) -> str:
    """Strict JSON (never NaN/Infinity, which JSON does not have): non-finite numbers become null,
    with one warning line on stderr naming them."""
    bad = []
    text = json.dumps(_finite(obj, bad), indent=2, default=str, allow_nan=False)
    if bad:
        print(f"remodel {command}: warning: non-finite values written as null: {', '.join(bad[:5])}"
              + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""), file=sys.stderr)
    return text
