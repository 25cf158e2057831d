"""Every head criterion before and after a short distillation (issue 55 Deliver 3): merges the `--tag _criteria`
run of bench_head_scores.py (every criterion but the default, magnitude and the seeds distilled) with the run that
distilled those (`_distill.json`, same distillation seed 0), checks that the rows both hold agree, and prints the
markdown table of bench/results/head_criteria_*.md: held-out loss before / after per cut, whether a criterion is
below magnitude and every random seed after, and the Spearman rank correlation over criteria of before vs after.

    python bench/head_distill_report.py bench/head_scores_gdn_distill.json bench/head_scores_gdn_distill_criteria.json
"""
from __future__ import annotations

import argparse
import json


def ranks(xs: list) -> list:
    """Average ranks (ties share the mean of their positions), 0-based."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out, i = [0.0] * len(xs), 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(a: list, b: list) -> float:
    """Spearman rank correlation with average ranks for ties."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else float("nan")


def merged(base_path: str, new_path: str) -> dict:
    """The new run's rows with the base run's distilled rows added; a shared row's before-losses must agree."""
    base, new = (json.load(open(p)) for p in (base_path, new_path))
    for name, r in base["rows"].items():
        diff = max(abs(r["loss"][c] - new["rows"][name]["loss"][c]) for c in r["loss"])
        if diff > 1e-4:
            raise SystemExit(f"{name}: before-loss differs by {diff:.5f} between the runs: not the same model")
        if "distilled" in r:
            new["rows"][name]["distilled"] = r["distilled"]
    return new


def report(res: dict) -> str:
    cuts, rows = list(res["cuts"]), res["rows"]
    rnd = [n for n in rows if n.startswith("random")]
    crit = [n for n in rows if n not in rnd]
    mean = lambda r, key: sum(r[key][c] for c in cuts) / len(cuts)
    lines = ["| criterion | " + " | ".join(f"{c}: before / after" for c in cuts)
             + " | mean: before / after | below magnitude and every seed after (before) |",
             "|---|" + "---|" * (len(cuts) + 2)]
    for n in crit + rnd:
        r, flags = rows[n], []
        for c in cuts:
            ok = {k: n not in ("magnitude",) + tuple(rnd) and r[k][c] < rows["magnitude"][k][c]
                  and all(r[k][c] < rows[s][k][c] for s in rnd) for k in ("distilled", "loss")}
            flags.append(("yes" if ok["distilled"] else "no") + (" (yes)" if ok["loss"] else " (no)"))
        lines.append(f"| {n} | " + " | ".join(f"{r['loss'][c]:.4f} / {r['distilled'][c]:.4f}" for c in cuts)
                     + f" | {mean(r, 'loss'):.4f} / {mean(r, 'distilled'):.4f} | "
                     + ("" if n == "magnitude" or n in rnd else ", ".join(flags)) + " |")
    rho = lambda names, c: spearman([rows[n]["loss"][c] for n in names], [rows[n]["distilled"][c] for n in names])
    rhom = lambda names: spearman([mean(rows[n], "loss") for n in names], [mean(rows[n], "distilled") for n in names])
    lines.append("")
    for label, names in ((f"the {len(crit)} criteria", crit), (f"the {len(crit) + len(rnd)} rows with the seeds",
                                                                  crit + rnd)):
        lines.append(f"Spearman before vs after over {label}: " + ", ".join(f"{c} {rho(names, c):+.2f}"
                                                                            for c in cuts)
                     + f", mean loss {rhom(names):+.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("distilled", help="the run that distilled the default, magnitude and the seeds (_distill.json)")
    ap.add_argument("criteria", help="the --tag _criteria run (every other criterion distilled)")
    ap.add_argument("out", nargs="?", help="also write the merged JSON here (default: print only)")
    a = ap.parse_args()
    res = merged(a.distilled, a.criteria)
    print(report(res))
    if a.out:
        with open(a.out, "w") as f:
            f.write(json.dumps(res, indent=1) + "\n")
