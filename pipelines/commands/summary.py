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
            f"{r['pattern_after']}{_accuracy(r)}; written to {r['output']}")


def _accuracy(r: dict) -> str:
    """'; acc remodel_cloze 0.75 -> 0.7, ...': each task's accuracy before -> after (prune --tasks), or ''."""
    before, after = r.get("tasks_before") or {}, r.get("tasks") or {}
    pairs = [f"{t} {before[t]['acc']:.3g} -> {after[t]['acc']:.3g}" for t in after
             if "acc" in after[t] and "acc" in before.get(t, {})]
    return f"; acc {', '.join(pairs)}" if pairs else ""


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


def training_summary(r: dict) -> str:
    """distill / train: teacher, student before -> after perplexity on the held-out tokens (named), and the
    last step's loss terms by name."""
    from ..training.evaluate import describe
    ev, held, parts = r.get("eval") or {}, r.get("held_out") or {}, []
    if "after" in ev:
        figs = [f"teacher {ev['teacher']['ppl']:.4g}"] if "teacher" in ev else []
        figs += [f"student {ev['before']['ppl']:.4g} -> {ev['after']['ppl']:.4g}" if "before" in ev
                 else f"student {ev['after']['ppl']:.4g}"]
        parts.append(f"held-out ppl {', '.join(figs)}; after: {describe(ev['after'], held.get('data'))}")
    last = r.get("last_step_losses") or {}
    if last:
        parts.append("last step " + ", ".join(f"{k} {v:.4g}" for k, v in last.items()))
    return f"{r['command']}: {r['steps']} steps, {r['tokens']:,} tokens; " + "; ".join(parts + [f"written to {r['args']['out']}"])


def eval_summary(r: dict) -> str:
    """eval: the perplexity with its tokens (data, blocks, sequence length)."""
    from ..training.evaluate import describe
    return "eval: " + describe(r)


SUMMARIES = {"prune": prune_summary, "upcycle": upcycle_summary, "run": run_summary, "distill": training_summary,
             "train": training_summary}


def summary(r) -> str | None:
    """The summary line of report `r` (a command's dict), or None for a command without one."""
    if not isinstance(r, dict) or r.get("command") not in SUMMARIES:
        return None
    return SUMMARIES[r["command"]](r)
