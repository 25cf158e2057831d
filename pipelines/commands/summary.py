"""The short human summary a command's report ends with (stderr, beside the JSON on stdout)."""
from __future__ import annotations

from .inspection import fmt_count


def _change(before: int, after: int) -> str:
    return f"{fmt_count(before)} -> {fmt_count(after)} ({100 * (after - before) / before:+.1f}%)" if before else \
        f"{fmt_count(before)} -> {fmt_count(after)}"


def prune_summary(r: dict) -> str:
    b, a = r["params_before"], r["params_after"]
    active = f"; active {_change(b['active'], a['active'])}" if b["active"] != b["total"] else ""
    return (f"prune: parameters {_change(b['total'], a['total'])}{active}; pattern {r['pattern_before']} -> "
            f"{r['pattern_after']}; written to {r['output']}")


def upcycle_summary(r: dict) -> str:
    p, d = r["params"], r.get("deviation") or {}
    dev = (f"; deviation from dense at init: rel {d['rel_diff']:.3g}, max |logit diff| {d['max_abs_logit_diff']:.3g}"
           if "rel_diff" in d else "")
    return (f"upcycle: parameters {_change(p['dense'], p['moe_total'])} total, {fmt_count(p['moe_active'])} active; "
            f"{r['experts']} experts (G={r['granularity']}, top-k {r['top_k']}, router {r['router']['mode']}){dev}; "
            f"written to {r['output']}")


def run_summary(r: dict) -> str:
    ran = sum(s["status"] == "ran" for s in r["steps"])
    return (f"run: {len(r['steps'])} steps ({ran} ran, {len(r['steps']) - ran} skipped) in {r['seconds']:.1f} s; "
            f"outputs in {r['workdir']}, report {r['workdir']}/recipe_report.json")


SUMMARIES = {"prune": prune_summary, "upcycle": upcycle_summary, "run": run_summary}


def summary(r) -> str | None:
    """The summary line of report `r` (a command's dict), or None for a command without one."""
    if not isinstance(r, dict) or r.get("command") not in SUMMARIES:
        return None
    return SUMMARIES[r["command"]](r)
