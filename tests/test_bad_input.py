"""Bad input ends in a one-line error (exit 2, no traceback) with nothing new on disk and the inputs
unchanged; a killed run leaves nothing that outlives the next run (issue 19)."""
import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remodel import cli
from remodel.models.checkpoint import atomic_output_dir
from remodel.models.errors import RemodelError
from remodel.pipelines.commands.report import strict_json
from tests.cli_contract import fails, listing

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "data" / "embedded"
DEAD_PID = 2**22 + 12345  # above the default pid_max: never a live process


def snapshot(*paths) -> dict:
    """{file: sha256} of every file under `paths` (to prove the inputs are unchanged)."""
    out = {}
    for p in map(Path, paths):
        files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
        out.update({str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files})
    return out


@pytest.fixture()
def work(tmp_path):
    """tmp_path with a copy of the embedded model at tmp_path/model; checks nothing else appears."""
    import shutil
    shutil.copytree(EMBEDDED, tmp_path / "model")
    return tmp_path


def check_clean(work, before_listing, before_hash):
    assert listing(work) == before_listing
    assert snapshot(work) == before_hash


# 1. an output that cannot be created -----------------------------------------------------------------

@pytest.mark.parametrize("where", ["file_parent", "proc", "readonly"])
def test_unwritable_out_is_one_line_error(work, capsys, where):
    (work / "afile").write_text("x")
    out = {"file_parent": work / "afile" / "sub" / "out", "proc": Path("/proc/remodel-test/out"),
           "readonly": work / "ro" / "out"}[where]
    if where == "readonly":
        (work / "ro").mkdir()
        os.chmod(work / "ro", 0o555)
        if os.access(work / "ro", os.W_OK):
            pytest.skip("running as root: a read-only mode does not block writes")
    before = listing(work), snapshot(work)
    fails(capsys, "convert", work / "model", out, match="cannot create the output directory")
    check_clean(work, *before)


def test_permission_denied_out_is_one_line_error(work, capsys, monkeypatch):
    """EACCES as a non-root user would get it on a read-only parent (as root, chmod does not block)."""
    real = Path.mkdir

    def mkdir(self, *a, **k):
        if self.parent == work / "ro":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    (work / "ro").mkdir()
    monkeypatch.setattr(Path, "mkdir", mkdir)
    before = listing(work), snapshot(work)
    fails(capsys, "convert", work / "model", work / "ro" / "out", match="Permission denied")
    check_clean(work, *before)


def test_unwritable_out_other_commands(work, capsys):
    (work / "afile").write_text("x")
    before = listing(work), snapshot(work)
    fails(capsys, "upcycle", work / "model", work / "afile" / "o", "--experts", "8", "--top-k", "2",
          match="cannot create the output directory")
    fails(capsys, "score", work / "model", "--method", "random", "--out", work / "afile" / "s",
          match="cannot create the output directory")
    check_clean(work, *before)


# 2. text that is not UTF-8 -----------------------------------------------------------------------------

def test_non_utf8_data_is_one_line_error(work, capsys):
    bad = work / "binary.txt"
    bad.write_bytes(bytes(range(128, 256)) * 400)
    before = listing(work), snapshot(work)
    fails(capsys, "score", work / "model", "--data", bad, "--out", work / "s", match="binary.txt: not UTF-8")
    fails(capsys, "prune", work / "model", work / "p", "--data", bad, "--hidden-size", "128",
          match="binary.txt: not UTF-8")
    fails(capsys, "eval", work / "model", "--data", bad, match="binary.txt: not UTF-8")
    check_clean(work, *before)


@pytest.mark.parametrize("name", ["binary.txt", "binary.jsonl", "folder"])
def test_non_utf8_load_texts(tmp_path, name):
    """What train/distill --eval-data and every DATA path go through."""
    from remodel.pipelines.data.data import load_texts
    from remodel.pipelines.training.evaluate import evaluate
    p = tmp_path / name
    if name == "folder":
        p.mkdir()
        (p / "a.txt").write_text("fine\n")
        (p / "b.txt").write_bytes(b"\xff\xfe\x00bad\n")
    else:
        p.write_bytes(b'{"text": "\xff\xfe"}\n')
    with pytest.raises(RemodelError, match="not UTF-8"):
        load_texts(p)
    with pytest.raises(RemodelError, match="not UTF-8"):
        evaluate(EMBEDDED, p)


# 3. truncated or fake .gz --------------------------------------------------------------------------------

def bad_gz(work):
    good = gzip.compress(("in the beginning god created the heaven and the earth\n" * 2000).encode())
    (work / "trunc.txt.gz").write_bytes(good[: len(good) // 2])
    (work / "plain.txt.gz").write_text("plain text with a gzip name\n" * 100)
    return work / "trunc.txt.gz", work / "plain.txt.gz"


def test_bad_gzip_is_one_line_error(work, capsys):
    trunc, plain = bad_gz(work)
    before = listing(work), snapshot(work)
    for data in (trunc, plain):
        fails(capsys, "score", work / "model", "--data", data, "--out", work / "s", match="gzip")
        fails(capsys, "eval", work / "model", "--data", data, match="gzip")
        fails(capsys, "search", work / "model", work / "o", "--data", data, "--params", "2M", match="gzip")
    check_clean(work, *before)


# 4. stale temporary siblings ------------------------------------------------------------------------------

def _sibling(d: Path, content: str = "half"):
    """A sibling as a killed remodel leaves it: its SIBLING_MARKER (kind, pid, OUT as its name says) and the
    output folder inside."""
    from remodel.models.outputs import INNER, SIBLING_MARKER
    name, rest = d.name[1:].rsplit(".", 1)
    kind, pid, _ = rest.split("-")
    (d / INNER).mkdir(parents=True)
    (d / INNER / "model.safetensors").write_text(content)
    (d / SIBLING_MARKER).write_text(json.dumps({"made_by": "remodel", "kind": kind, "pid": int(pid), "out": name}))


def test_stale_siblings_removed_live_kept(work, capsys):
    out = work / "conv"
    stale_tmp = work / f".conv.tmp-{DEAD_PID}-0123abcd"
    stale_old = work / f".conv.old-{DEAD_PID}-4567abcd"  # OUT exists: a leftover, deleted
    (work / "conv").mkdir()
    live = work / f".conv.tmp-{os.getpid()}-89abcdef"
    other = work / f".other.tmp-{DEAD_PID}-0123abcd"
    for d in (stale_tmp, stale_old, live, other):
        _sibling(d)
    assert cli.main(["convert", str(work / "model"), str(out), "--dtype", "float32", "--overwrite"]) == 0
    assert not stale_tmp.exists() and not stale_old.exists()
    assert live.exists() and other.exists()  # a running process's, and another output's
    assert (out / "model.safetensors").exists()


def test_bare_siblings_of_a_kill_inside_mkdir_and_marker_removed(tmp_path):
    """A kill between the sibling's mkdir and its marker's write leaves it empty (or with an empty marker):
    the next run removes those; one holding anything else, or a non-empty unmarked file, stays."""
    from remodel.models.outputs import SIBLING_MARKER
    empty, bare = tmp_path / f".o.tmp-{DEAD_PID}-0123abcd", tmp_path / f".o.tmp-{DEAD_PID}-4567abcd"
    kept, kept2 = tmp_path / f".o.tmp-{DEAD_PID}-89abcdef", tmp_path / f".o.old-{DEAD_PID}-0123abcd"
    for d in (empty, bare, kept, kept2):
        d.mkdir()
    (bare / SIBLING_MARKER).write_text("")
    (kept / SIBLING_MARKER).write_text("")
    (kept / "user.txt").write_text("mine")
    (kept2 / SIBLING_MARKER).write_text("not json")
    with atomic_output_dir(tmp_path / "o") as t:
        (t / "f").write_text("x")
    assert sorted(q.name for q in tmp_path.iterdir()) == sorted(["o", kept.name, kept2.name])
    assert (kept / "user.txt").read_text() == "mine" and (kept2 / SIBLING_MARKER).read_text() == "not json"


def test_stale_old_restored_when_out_missing(tmp_path):
    """A kill between moving the previous OUT aside and renaming the new one in: OUT comes back."""
    old = tmp_path / f".o.old-{DEAD_PID}-0123abcd"
    _sibling(old, "previous")
    with pytest.raises(RemodelError, match="--overwrite"):
        with atomic_output_dir(tmp_path / "o"):
            pass
    assert (tmp_path / "o" / "model.safetensors").read_text() == "previous" and not old.exists()


def _kill_then_rerun(args, out, parent, probe, overwrite_rerun=False):
    """Start `cli.py args`, SIGKILL it once `probe()` is true (or after 60 s), rerun to completion (in process)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), *map(str, args)], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while p.poll() is None and not probe() and time.time() - t0 < 60:
        time.sleep(0.005)
    killed = p.poll() is None
    p.send_signal(signal.SIGKILL)
    p.wait()
    # the rerun through cli.main in this process (no second ~5 s of imports); its stderr is in pytest's report
    assert cli.main([*map(str, args), *(["--overwrite"] if overwrite_rerun else [])]) == 0
    return killed


@pytest.mark.parametrize("cmd", ["convert", "prune", "upcycle", "score"])
def test_kill9_then_rerun_leaves_only_out(work, cmd):
    parent = work / "outs"
    parent.mkdir()
    out = parent / "o"
    args = {"convert": ["convert", work / "model", out, "--dtype", "float32"],
            "prune": ["prune", work / "model", out, "--scores", work / "scores", "--hidden-size", "128"],
            "upcycle": ["upcycle", work / "model", out, "--experts", "8", "--granularity", "2", "--top-k", "2"],
            "score": ["score", work / "model", "--method", "magnitude", "--out", out]}[cmd]
    if cmd == "prune":
        assert cli.main(["score", str(work / "model"), "--method", "magnitude", "--out", str(work / "scores")]) == 0
    before = snapshot(work / "model")
    killed = _kill_then_rerun(args, out, parent, lambda: any(q.name.startswith(".o.tmp-") for q in parent.iterdir()))
    assert killed, "the process ended before a temporary sibling appeared"
    assert sorted(q.name for q in parent.iterdir()) == ["o"]
    assert (out / "remodel_report.json").exists()
    assert snapshot(work / "model") == before


@pytest.mark.parametrize("moment", ["checkpoint", "export"])
def test_kill9_distill_then_rerun_leaves_out_and_run(work, moment):
    """distill (with --resume, so the same command continues) killed once a checkpoint is being written or
    the export's temporary sibling exists, then rerun: the parent holds exactly OUT and OUT.run."""
    parent = work / "outs"
    parent.mkdir()
    out = parent / "o"
    data = work / "d.txt"
    import gzip
    with gzip.open(ROOT / "data/corpus/valid.txt.gz", "rt") as f:
        data.write_text(f.read())
    args = ["distill", "--teacher", work / "model", "--student", work / "model", out, "--data", data, "--steps",
            "6", "--seq-len", "64", "--batch", "2", "--checkpoint-every", "2", "--lm-loss-weight", "1", "--resume"]
    run = parent / "o.run"
    probe = {"checkpoint": lambda: run.is_dir() and any(q.name.startswith(".step-") for q in run.iterdir()),
             "export": lambda: any(q.name.startswith(".o.tmp-") for q in parent.iterdir())}[moment]
    before = snapshot(work / "model")
    assert _kill_then_rerun(args, out, parent, probe), "the run ended before the kill"
    assert sorted(q.name for q in parent.iterdir()) == ["o", "o.run"]
    assert json.loads((out / "remodel_report.json").read_text())["steps"] == 6
    assert snapshot(work / "model") == before


# 5. a failed run leaves no new parent directories -----------------------------------------------------------

def test_failed_run_leaves_no_new_parents(work, capsys):
    short = work / "short.txt"
    short.write_text("too short\n")
    before = listing(work), snapshot(work)
    fails(capsys, "score", work / "model", "--data", short, "--out", work / "NEW" / "deeper" / "s",
          match="fewer than one sequence")
    assert not (work / "NEW").exists()
    check_clean(work, *before)


# 6. non-finite weights and strict JSON ---------------------------------------------------------------------

def _poison(model_dir, name_part, value):
    """Set a few entries of the first tensor whose name contains `name_part` to `value` (in place)."""
    from safetensors.torch import load_file, save_file
    f = Path(model_dir) / "model.safetensors"
    t = load_file(f)
    name = next(k for k in sorted(t) if name_part in k)
    t[name].view(-1)[:3] = value
    save_file(t, f, metadata={"format": "pt"})
    return name


def test_upcycle_nan_weights_is_one_line_error(work, capsys):
    _poison(work / "model", "mixer.up_proj", float("nan"))
    before = listing(work), snapshot(work)
    line = fails(capsys, "upcycle", work / "model", work / "o", "--experts", "8", "--top-k", "2",
                 match="3 non-finite value(s)")
    assert "up_proj" in line
    check_clean(work, *before)


def test_eval_nan_loss_never_prints_nan(work, capsys):
    _poison(work / "model", "embeddings", float("inf"))
    data = work / "d.txt"
    data.write_text("in the beginning god created the heaven and the earth\n" * 50)
    before = listing(work), snapshot(work)
    fails(capsys, "eval", work / "model", "--data", data, "--seq-len", "16", "--batch", "2",
          match="not finite")
    assert "NaN" not in capsys.readouterr().out
    check_clean(work, *before)


def test_json_output_is_strict(capsys):
    text = strict_json({"loss": float("nan"), "x": [1.0, float("inf")], "ok": 2.5}, "eval")
    assert json.loads(text) == {"loss": None, "x": [1.0, None], "ok": 2.5}
    assert "NaN" not in text and "Infinity" not in text
    err = capsys.readouterr().err.strip()
    assert err == "remodel eval: warning: non-finite values written as null: loss, x[1]"


# 7. config validation ------------------------------------------------------------------------------------------

def _edit_config(model_dir, **kw):
    p = Path(model_dir) / "config.json"
    c = json.loads(p.read_text())
    for k, v in kw.items():
        if v is None:
            c.pop(k)
        else:
            c[k] = v
    p.write_text(json.dumps(c))


@pytest.mark.parametrize("cmd", ["inspect", "convert", "upcycle"])
def test_config_missing_field_named(work, capsys, cmd):
    _edit_config(work / "model", hidden_size=None)
    before = listing(work), snapshot(work)
    args = {"inspect": [], "convert": [work / "o"], "upcycle": [work / "o", "--experts", "8", "--top-k", "2"]}[cmd]
    line = fails(capsys, cmd, work / "model", *args, match="has no 'hidden_size'")
    assert "4096" in line  # says what transformers would have assumed
    check_clean(work, *before)


def test_config_wrong_type_is_a_complete_line(work, capsys):
    _edit_config(work / "model", hidden_size="256")
    before = listing(work), snapshot(work)
    line = fails(capsys, "inspect", work / "model")
    assert "'hidden_size'" in line and "expected int" in line and "'256'" in line, line
    check_clean(work, *before)


def test_inspect_flags_tensors_that_disagree(work, capsys):
    _edit_config(work / "model", intermediate_size=512)  # the weights say 768
    before = listing(work), snapshot(work)
    capsys.readouterr()
    assert cli.main(["inspect", str(work / "model")]) == 2
    out, err = capsys.readouterr()
    assert "DISAGREES WITH CONFIG" in out and "up_proj.weight has shape [768, 256]" in out
    assert err.count("\n") == 1 and "remodel inspect: error: 6 tensor(s) disagree with config.json" in err, err
    check_clean(work, *before)


# 10. help that teaches -------------------------------------------------------------------------------------------

def _subparsers():
    import argparse
    ap = cli.build_parser()
    act = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return act.choices


@pytest.mark.parametrize("name", sorted(_subparsers()))
def test_help_describes_every_option_with_default(name):
    p = _subparsers()[name]
    text = p.format_help()
    fmt = p._get_formatter()
    for a in p._actions:
        if a.dest == "help":
            continue
        assert a.help and a.help.strip(), f"{name}: {a.option_strings or a.dest} has no help line"
        if a.option_strings:
            line = fmt._get_help_string(a)
            assert "(default: " in line or "(required)" in line or "None" in line, (name, a.option_strings, line)
            assert a.option_strings[-1] in text


def test_help_teaches_upcycle_and_convert_progress(work, capsys):
    text = _subparsers()["upcycle"].format_help()
    assert "N = E x G" in " ".join(text.split())
    flat = " ".join(text.split())  # the defaults per source family, from the family registry
    router = next(x.help for x in _subparsers()["upcycle"]._actions if x.dest == "router")
    assert "default (None): sigmoid-raw for nemotron_h, lfm2 sources (sigmoid with --exact); topk-softmax for the others" \
        in router  # issue 59: the README's recommended router is the default
    assert "router scoring: topk-softmax and sigmoid renormalise" in flat
    assert "output family; default (None): nemotron_h for nemotron_h sources; qwen3_moe with q/k norm" in flat
    assert cli.main(["convert", str(work / "model"), str(work / "o")]) == 0
    assert "convert: 100%" in capsys.readouterr().err  # a progress bar over the tensors
    line = fails(capsys, "convert", work / "model", work / "o")
    assert "pass --overwrite" in line  # the flag, not the Python argument name


def test_errors_name_flags(work, capsys):
    fails(capsys, "score", work / "model", "--data", ROOT / "data/corpus/valid.txt.gz", "--out", work / "s",
          "--seq-len", "0", match="(--seq-len)")
    fails(capsys, "search", work / "model", work / "o", "--data", ROOT / "data/corpus/valid.txt.gz",
          "--params", "2M", "--candidates", "0", match="(--candidates)")
    assert not (work / "s").exists() and not (work / "o").exists()


def test_oserror_anywhere_is_one_line(monkeypatch, capsys):
    """A disk that fills up mid-run: one line naming the cause and the file, exit 2, no traceback."""
    def run(a):
        raise OSError(28, "No space left on device", "/out/.o.tmp-1-00000000/model.safetensors")
    monkeypatch.setattr(cli, "run", run)
    fails(capsys, "convert", "m", "o", match="No space left on device: /out/.o.tmp-1-00000000/model.safetensors")


def test_train_help_teaches():
    """distill/train: the budget rule, --keep-last 0, the warm-up cap, recompute modes, data forms; each
    default comes from TrainConfig (so the CLI and the API agree)."""
    from remodel.pipelines.training.train_config import FIELDS
    for name in ("distill", "train"):
        p = _subparsers()[name]
        text = " ".join(p.format_help().split())
        assert "give --steps or --tokens" in text and "0 keeps every one" in text and "capped at steps" in text
        assert "{none,selective,full}" in text and "'W1 A W2 B ...'" in text
        for a in p._actions:
            if a.dest in FIELDS:
                assert a.default == FIELDS[a.dest].default, (name, a.dest)

