"""bench/gpu_summary.json: the current GPU figures of issue 42, flat and stable, from one device run's outputs.

Reads the JSON the run wrote into DIR (gpu_profile.py's, bench_gpu.py's windows / mfu / gap parts,
bench_fused_loss.py's --json) and the last JSON line of bench_moe.py's log (DIR/moe.log). A figure this run
did not measure is null, never a value carried over from an earlier run.

    python bench/gpu_summary.py DIR [--out bench/gpu_summary.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

KEYS = ("device", "date", "mfu_1p3b_bf16", "vs_transformers", "fp8_vs_bf16", "fp8_loss_gap_rel", "distill_vs_plain",
        "loss_peak_gib", "moe_vs_dense")


def _get(d, *path):
    """d[path[0]][path[1]]... as a float, or None where any step is missing or not a number."""
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return float(d) if isinstance(d, (int, float)) and not isinstance(d, bool) else None


def _reports(folder: Path) -> dict:
    """Every JSON object in the folder, merged (later files' keys win), plus bench_moe's rows."""
    merged = {}
    for f in sorted(folder.glob("*.json")):
        if f.name == "gpu_summary.json":  # an earlier summary is not a report (its nulls would win)
            continue
        try:
            obj = json.loads(f.read_text())
        except ValueError:
            continue
        if isinstance(obj, dict):
            for k, v in obj.items():
                if isinstance(v, dict) and isinstance(merged.get(k), dict):
                    merged[k] = {**merged[k], **v}
                else:
                    merged[k] = v
    log = folder / "moe.log"
    if log.exists():
        lines = [ln for ln in log.read_text().splitlines() if ln.startswith("{")]
        if lines:
            merged["moe_rows"] = {r["window"]: r for r in json.loads(lines[-1]).get("rows", [])}
    return merged


def summary(folder: Path) -> dict:
    r = _reports(folder)
    w8 = ("windows", "nemotron_h_8b_window")
    prof = r.get("windows", {}).get("8b", {}) if isinstance(r.get("windows"), dict) else {}
    vs = {"1x1024": _get(prof, "vs_transformers", "1x1024", "ratio"),
          "1x4096": _get(prof, "vs_transformers", "1x4096", "ratio"),
          "2x4096": _get(prof, "ours_over_transformers")}
    if vs["2x4096"] is None:
        vs["2x4096"] = _get(r, *w8, "bf16", "plain", "over_transformers")
    moe = r.get("moe_rows", {})
    return {"device": r.get("device"), "date": r.get("date") or time.strftime("%Y-%m-%d"),
            "mfu_1p3b_bf16": _get(r, "mfu_1p3b_bf16", "mfu_spec"),
            "vs_transformers": vs,
            "fp8_vs_bf16": _get(r, *w8, "fp8_speedup_plain"),
            "fp8_loss_gap_rel": _get(r, "fp8_loss_gap", "rel_gap"),
            "distill_vs_plain": _get(r, *w8, "bf16", "distill", "over_plain"),
            "loss_peak_gib": _get(r, "ce", "fused", "peak_gib"),
            "moe_vs_dense": {"nano": _get(moe, "nano", "grouped_over_dense"),
                             "super": _get(moe, "super", "grouped_over_dense")}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="the folder of one device run's JSON outputs")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "gpu_summary.json"),
                    help="where to write (default: %(default)s)")
    a = ap.parse_args(argv)
    s = summary(Path(a.dir))
    Path(a.out).write_text(json.dumps(s, indent=1) + "\n")
    print(json.dumps(s, indent=1))
    return s


if __name__ == "__main__":
    main()
