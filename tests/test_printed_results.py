"""Issue 59, items 4 and 5: upcycle's defaults are README's recommendation (top-k = 2G, the raw sigmoid router
for nemotron_h, G = 4), option help texts stay short, prune and upcycle end with a human summary line, and
progress bars print lines (no carriage returns) when stderr is not a terminal."""
import json
from pathlib import Path

from remodel import cli
from remodel.pipelines.commands.inspection import fmt_count

EMBEDDED = Path(__file__).resolve().parents[1] / "data" / "embedded"  # a dense nemotron_h (3.36M parameters)


def test_upcycle_defaults_are_the_recommended_settings(tmp_path, capsys):
    assert cli.main(["upcycle", str(EMBEDDED), str(tmp_path / "u"), "--experts", "16"]) == 0
    err = capsys.readouterr().err
    r = json.loads((tmp_path / "u" / "remodel_report.json").read_text())
    assert (r["granularity"], r["top_k"], r["router"]["mode"]) == (4, 8, "sigmoid-raw")
    summary = [x for x in err.splitlines() if x.startswith("upcycle: parameters")]
    p = r["params"]
    assert summary == [summary[0]] and f"{fmt_count(p['dense'])} -> {fmt_count(p['moe_total'])}" in summary[0]
    assert f"{fmt_count(p['moe_active'])} active" in summary[0] and "deviation from dense" in summary[0]
    assert p["moe_active"] < p["moe_total"]  # 8 of 16 experts per token
    assert "\r" not in err  # stderr is no terminal here: the bar printed lines
    assert cli.main(["upcycle", str(EMBEDDED), str(tmp_path / "x"), "--experts", "16", "--exact"]) == 0
    assert json.loads((tmp_path / "x" / "remodel_report.json").read_text())["router"]["mode"] == "sigmoid"


def test_upcycle_help_is_a_few_lines_per_option(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    sub = next(a for a in cli.build_parser()._actions if a.choices and "upcycle" in a.choices).choices["upcycle"]
    text = sub.format_help().split("options:")[1]
    blocks, cur = [], []
    for line in text.splitlines()[1:]:
        if line.startswith("  -") and cur:
            blocks.append(cur)
            cur = []
        cur.append(line)
    blocks.append(cur)
    help_lines = [[x for x in b if x[:24].strip() == "" or (x[22:24] == "  " and x[24:].strip())] for b in blocks]
    assert len(blocks) >= 12 and max(len(b) for b in help_lines) <= 5, max(blocks, key=len)  # --to had 20


def test_prune_summary_and_piped_progress(tmp_path, capsys):
    s = tmp_path / "s"
    assert cli.main(["score", str(EMBEDDED), "--method", "magnitude", "--out", str(s)]) == 0
    capsys.readouterr()
    assert cli.main(["prune", str(EMBEDDED), str(tmp_path / "p"), "--scores", str(s), "--ffn-size", "512"]) == 0
    err = capsys.readouterr().err
    r = json.loads((tmp_path / "p" / "remodel_report.json").read_text())
    before, after = r["params_before"]["total"], r["params_after"]["total"]
    assert after < before
    assert f"prune: parameters {fmt_count(before)} -> {fmt_count(after)}" in err
    assert "\r" not in err and any(x.startswith("prune:") and "tensor" in x for x in err.splitlines())
