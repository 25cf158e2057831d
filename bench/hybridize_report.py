"""bench/bench_hybridize.py's results as markdown tables (bench/results/hybridize.md): the per-layer replacement
KL, loss and task accuracy per arm and seed, the arms' seed means and paired differences, loss vs distillation
tokens, serving cost, and the issue's 5% verdict."""
from __future__ import annotations

from pathlib import Path

LAYERS = 8
ARMS = ("kl", "random", "even", "transfer")


def mean(xs: list) -> float:
    return sum(xs) / len(xs)


def acc(r: dict, task: str) -> str:
    t = (r.get("tasks") or {}).get(task)
    return f"{t['acc']:.3f} ± {t['stderr']:.3f}" if t else "-"


def kl_table(res: dict) -> list:
    rows = ["| mixer | " + " | ".join(f"layer {i}" for i in range(LAYERS)) + " |", "|---" * (LAYERS + 1) + "|"]
    for key, r in res["points"].items():
        if key.endswith(f"/{LAYERS // 4}"):
            rows.append(f"| {key.split('/')[0]} | " + " | ".join(f"{x:.3f}" for x in r["kl_per_layer"]) + " |")
    return rows


def arm_table(res: dict) -> list:
    """One row per (point, arm, seed): kept layers, held-out loss, vs source, task accuracy ± stderr."""
    src, st = res["source_loss"], {"tasks": res.get("source_tasks")}
    rows = ["| model | arm | seed | kept | held-out loss | vs source | remodel_cloze acc | remodel_nextphrase acc |",
            "|---|---|---|---|---|---|---|---|",
            f"| source (Llama, 8 attention) | - | - | all | {src:.3f} | - | {acc(st, 'remodel_cloze')} | "
            f"{acc(st, 'remodel_nextphrase')} |"]
    for key, p in res["points"].items():
        mixer, keep = key.split("/")
        rows.append(f"| {mixer} {keep}/{LAYERS} | initialised (kl layers, no training) | - | - | {p['init_loss']:.3f} | "
                    f"{100 * (p['init_loss'] / src - 1):+.1f}% | - | - |")
        for arm in ARMS:
            for r in p.get(arm, []):
                rows.append(f"| {mixer} {keep}/{LAYERS} | {arm} | {r['seed']} | {r['kept']} | {r['loss']:.3f} | "
                            f"{100 * (r['loss'] / src - 1):+.1f}% | {acc(r, 'remodel_cloze')} | "
                            f"{acc(r, 'remodel_nextphrase')} |")
    return rows


def paired(res: dict) -> list:
    """At each kept point: each arm's seed-mean loss, and kl's paired (same seed) differences to random and even."""
    rows = ["| mixer | kept | kl mean | random mean | even mean | random - kl (per seed) | even - kl (per seed) |",
            "|---|---|---|---|---|---|---|"]
    for key, p in res["points"].items():
        if not all(p.get(arm) for arm in ("kl", "random", "even")):
            continue
        m = {arm: mean([r["loss"] for r in p[arm]]) for arm in ("kl", "random", "even")}
        diff = {arm: ", ".join(f"{o['loss'] - k['loss']:+.3f}" for k, o in zip(p["kl"], p[arm]))
                for arm in ("random", "even")}
        mixer, keep = key.split("/")
        rows.append(f"| {mixer} | {keep}/{LAYERS} | {m['kl']:.3f} | {m['random']:.3f} | {m['even']:.3f} | "
                    f"{diff['random']} | {diff['even']} |")
    return rows


def curves(res: dict) -> dict:
    """{(mixer/kept, init): {steps: {tokens, loss}}}; older JSONs kept one kl-arm row per mixer at 1/4."""
    out = {}
    for key, c in res.get("curve", {}).items():
        if "tokens" in next(iter(c.values())):
            c = {"attention": c}
        for init, row in c.items():
            out[(key if "/" in key else f"{key}/{LAYERS // 4}", init)] = row
    return out


def curve_table(res: dict) -> list:
    rows_in = curves(res)
    head = next(iter(rows_in.values()))
    rows = ["| mixer, kept, init (first seed, kl's layers) | " + " | ".join(
        f"{n} steps ({c['tokens']:,} tokens)" for n, c in head.items()) + " |", "|---" * (1 + len(head)) + "|"]
    for (key, init), c in rows_in.items():
        mixer, keep = key.split("/")
        rows.append(f"| {mixer} {keep}/{LAYERS}, {init} | " + " | ".join(f"{x['loss']:.3f}" for x in c.values()) + " |")
    return rows


def serving_table(res: dict) -> list:
    rows = ["| model | context | cache bytes (KV + state) | KV | state | tokens/s (CPU) |", "|---|---|---|---|---|---|"]
    for name, per in res["serving"].items():
        for n, s in per.items():
            rows.append(f"| {name} | {n} | {s['cache_bytes']:,} | {s['kv_cache']:,} | {s['state']:,} | "
                        f"{s['tokens_per_s']:,.0f} |")
    return rows


def verdict(res: dict) -> str:
    """The issue's goal: attention-initialised hybrids within 5% of the source's held-out loss at 1/4 attention
    (the best attention-initialised arm's seed mean); the other kept points' figures beside it."""
    src, lines = res["source_loss"], []
    for key, r in res["points"].items():
        arm, best = min(((a, mean([x["loss"] for x in r[a]])) for a in ("kl", "even", "transfer") if r.get(a)),
                        key=lambda t: t[1])
        gap, (mixer, keep) = 100 * (best / src - 1), key.split("/")
        lines.append(f"{mixer} {keep}/{LAYERS}: best attention-initialised arm {arm} {best:.3f}, {gap:+.1f}% of the "
                     f"source ({'within' if gap <= 5 else 'outside'} 5%)")
    return "Goal (issue 57: within 5% of the source at 1/4 attention): " + "; ".join(lines) + "."


def task_line(s: dict) -> str:
    """The settings sentence on task accuracy (--task-limit 0: none measured)."""
    lim = s.get("task_limit")
    if lim == 0:
        return " No task accuracy (--task-limit 0)."
    return (f" Task accuracy (plain text, no repeats): lm-eval through transformers, "
            f"{'all items' if not lim else f'the first {lim} items of each task'} (remodel_cloze 150, "
            f"remodel_nextphrase 300; 4 choices, chance 0.25), arms of seed {s.get('task_seeds')}"
            f"{' kept ' + s['task_keeps'] if s.get('task_keeps') else ''}; stderr binomial.")


def body(res: dict) -> str:
    s = res["settings"]
    reused = " (by an earlier run of this script into --src-dir, same settings; reused)" \
        if res.get("source_reused") else ""
    later = "transfer" if s.get("transfer", 1) else ""
    keeps = " and ".join(f"{k}/{LAYERS}" for k in s["keeps"].split(","))
    head = (f"`{res['command']}`; {res['machine']}, shared with other jobs; {res['date']}; wall {res['wall_s']} s "
            f"(of which the source and its evaluation {res['source_seconds']} s). Source: 8-layer Llama, hidden "
            f"{s['hidden']}, trained here{reused} {s['src_steps']} steps of {s['src_batch']}x{s['src_seq_len']} "
            f"tokens at lr {s['src_lr']} on data/corpus/train.txt.gz with {s.get('repeat_share', 0.5):.0%} of its "
            f"{s.get('repeat_words')}-word chunks written twice (copying needs a look-back layer); held-out loss on valid.txt.gz, same transform "
            f"({s['eval_tokens']:,} tokens, seq {s['seq_len']}). Every arm {s['steps']} distillation steps of "
            f"8x{s['seq_len']} tokens at lr {s['lr']} (first {s.get('distill_lines')} lines of the train text). Seeds "
            f"{s['seeds']} for kl / random / even at {keeps} attention" + (f"; {later} seed {s['seeds'].split(',')[0]} only" if later
                                                              else "") +
            "." + task_line(s))
    parts = [head, "Per-layer KL when that attention layer alone is replaced by its attention-initialised mixer "
             "(--select kl's figure, nats/token on 16 calibration sequences):", *kl_table(res),
             "Held-out loss and task accuracy per arm and seed:", *arm_table(res),
             "Seed means and paired differences (positive: kl better):", *paired(res)]
    if res.get("curve"):
        parts += ["Held-out loss vs distillation tokens (attention init: the kl arm; random init on the same layers; separate "
                  "runs, each its own lr schedule):",
                  *curve_table(res)]
    if res.get("serving"):
        parts += ["Serving cost (seed 0 kl hybrids):", *serving_table(res)]
    parts.append(verdict(res))
    out, prev = [], ""
    for x in parts:  # a blank line between paragraphs and tables, none inside a table
        if out and not (x.startswith("|") and prev.startswith("|")):
            out.append("")
        out.append(x)
        prev = x
    return "\n".join(out)


def write_md(res: dict, path, notes: str = "") -> None:
    """bench/results/hybridize.md: the title, this run's tables, and the notes section kept from the old file."""
    p = Path(path)
    old = p.read_text() if p.exists() else ""
    keep = old[old.index("\nNotes"):] if "\nNotes" in old else ""
    text = "# Hybridize\n\n### Hybridize (bench/bench_hybridize.py)\n\n" + body(res) + "\n" + (notes or keep)
    tmp = p.with_suffix(".md.tmp")
    tmp.write_text(text if text.endswith("\n") else text + "\n")
    tmp.replace(p)
