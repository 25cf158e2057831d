"""Nothing run, nothing lost (issue 39): code named by a tokenizer's `auto_map` never runs (not even with
`y` on stdin), and remodel never deletes what it did not create: a user's folder at a work or run
directory's name, a symlinked run directory, an input inside the run directory. Each case is a one-line
error (exit 2) with the user's files byte-for-byte intact and nothing new written."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from remodel import cli
from remodel.models.errors import RemodelError
from remodel.pipelines.data import megatron, shards
from remodel.pipelines.data.data import embedded_tokenizer_path
from remodel.pipelines.training import train_state as state
from tests.cli_contract import fails, listing

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "data" / "embedded"
VALID = ROOT / "data" / "corpus" / "valid.txt.gz"
PKG_PARENT = Path(cli.__file__).parents[1]  # what `import remodel` needs on the path (links not followed)
EVIL = ("from pathlib import Path\nfrom transformers import PreTrainedTokenizerFast\n"
        "Path({marker!r}).write_text('pwned')\n\n\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")


def _snapshot(d: Path) -> dict:
    """Every file under d (not following links) with its bytes: what must survive a refused command."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(Path(d).rglob("*")) if p.is_file()}


def _user_folder(d: Path) -> dict:
    d.mkdir(parents=True)
    (d / "notes.txt").write_bytes(b"my notes\n")
    (d / "sub").mkdir()
    (d / "sub" / "data.bin").write_bytes(bytes(range(256)))
    return _snapshot(d)


def _plant_auto_map(folder: Path, marker: Path, file: str = "tokenizer_config.json", key: str = "AutoTokenizer"):
    """auto_map in `file` naming evil.py beside it, which writes `marker` when imported."""
    (folder / "evil.py").write_text(EVIL.format(marker=str(marker)))
    cfg = json.loads((folder / file).read_text()) if (folder / file).exists() else {}
    cfg["auto_map"] = {key: [None, "evil.EvilTokenizer"] if key == "AutoTokenizer" else "evil.X"}
    if file == "tokenizer_config.json":
        cfg["tokenizer_class"] = "EvilTokenizer"  # what makes transformers import evil.py
    (folder / file).write_text(json.dumps(cfg))


def _cli_subprocess(args, cwd):
    """The CLI in a fresh process with `y` answering every prompt (a script piped through `yes`)."""
    code = "import sys; from remodel import cli; sys.exit(cli.main(sys.argv[1:]))"
    path = os.pathsep.join(p for p in (str(PKG_PARENT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], input="y\n" * 50, capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def _one_line_refusal(r, cmd, *needles):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith(f"remodel {cmd}: error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


# ---- Deliver 0: never run code from a file ------------------------------------------------------------

def test_auto_map_tokenizer_never_runs_on_tokenize_or_eval(tmp_path):
    marker = tmp_path / "PWNED"
    tok = tmp_path / "tok"
    shutil.copytree(embedded_tokenizer_path(), tok)
    _plant_auto_map(tok, marker)
    model = tmp_path / "model"
    shutil.copytree(EMBEDDED, model)
    _plant_auto_map(model, marker)
    before = listing(tmp_path)
    r = _cli_subprocess(["tokenize", VALID, tmp_path / "out", "--tokenizer", tok], tmp_path)
    _one_line_refusal(r, "tokenize", str(tok / "tokenizer_config.json"), "auto_map", "--tokenizer")
    r = _cli_subprocess(["eval", model, "--data", VALID, "--seq-len", "16", "--max-tokens", "64"], tmp_path)
    _one_line_refusal(r, "eval", str(model / "tokenizer_config.json"), "auto_map", "MODEL")
    assert not marker.exists()
    assert listing(tmp_path) == before


def test_auto_map_of_a_tokenizer_in_config_json_is_refused(tmp_path, capsys):
    marker = tmp_path / "PWNED"
    tok = tmp_path / "tok"
    shutil.copytree(embedded_tokenizer_path(), tok)
    _plant_auto_map(tok, marker, file="config.json")
    before = _snapshot(tmp_path)
    fails(capsys, "tokenize", VALID, tmp_path / "out", "--tokenizer", tok, match=f"{tok / 'config.json'}: its auto_map")
    assert not marker.exists() and _snapshot(tmp_path) == before


def test_model_code_auto_map_in_config_json_is_not_run_and_not_refused(tmp_path):
    """A Nemotron-H style config.json auto_map (AutoConfig / AutoModel, for its modeling code) is left
    alone: remodel runs its own model code and loads the tokenizer with trust_remote_code=False."""
    from remodel.pipelines.distributed.runtime import load_tokenizer
    marker = tmp_path / "PWNED"
    model = tmp_path / "model"
    shutil.copytree(EMBEDDED, model)
    _plant_auto_map(model, marker, file="config.json", key="AutoConfig")
    assert len(load_tokenizer(model)) == len(load_tokenizer(EMBEDDED))
    assert not marker.exists()


# ---- Deliver 1: tokenize work folders -------------------------------------------------------------------

@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
def test_megatron_keeps_a_user_folder_at_the_work_name(tmp_path, capsys, flags):
    kept = _user_folder(tmp_path / ".out.tokens")
    before = listing(tmp_path)
    fails(capsys, "tokenize", VALID, tmp_path / "out", "--tokenizer", EMBEDDED, "--format", "megatron", *flags,
          match="was not made by remodel")
    assert _snapshot(tmp_path / ".out.tokens") == kept and listing(tmp_path) == before


def test_megatron_never_follows_a_symlinked_work_set(tmp_path, capsys):
    kept = _user_folder(tmp_path / "mine")
    (tmp_path / ".out.tokens").symlink_to(tmp_path / "mine")
    before = listing(tmp_path)
    fails(capsys, "tokenize", VALID, tmp_path / "out", "--tokenizer", EMBEDDED, "--format", "megatron",
          "--overwrite", match="is a symbolic link")
    assert _snapshot(tmp_path / "mine") == kept and listing(tmp_path) == before


@pytest.mark.parametrize("flags", [[], ["--format", "megatron"]])
def test_tokenize_keeps_a_user_folder_at_the_partial_name(tmp_path, capsys, flags):
    name = ".out.partial" if not flags else "..out.tokens.partial"
    kept = _user_folder(tmp_path / name)
    before = listing(tmp_path)
    fails(capsys, "tokenize", VALID, tmp_path / "out", "--tokenizer", EMBEDDED, *flags, match="was not made by remodel")
    assert _snapshot(tmp_path / name) == kept and listing(tmp_path) == before


def test_a_refused_megatron_run_leaves_no_work_set(tmp_path, capsys, monkeypatch):
    """A refusal after the tokens are written (here: the Megatron writer's) removes `.OUT.tokens`; an OUT
    inside DATA is refused before any tokenizing."""
    def refuse(*a, **k):
        raise RemodelError("refused by the writer")
    monkeypatch.setattr(megatron, "write_megatron", refuse)
    fails(capsys, "tokenize", VALID, tmp_path / "out", "--tokenizer", EMBEDDED, "--format", "megatron",
          match="refused by the writer")
    assert listing(tmp_path) == set()
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(VALID, data / "valid.txt.gz")
    fails(capsys, "tokenize", data, data / "out", "--tokenizer", EMBEDDED, "--format", "megatron",
          match="overlaps input")
    assert listing(tmp_path) == {"data", "data/valid.txt.gz"}


def test_megatron_work_set_is_marked_and_removed(tmp_path, capsys):
    assert cli.main([str(a) for a in ("tokenize", VALID, tmp_path / "out", "--tokenizer", EMBEDDED,
                                      "--format", "megatron")]) == 0
    assert listing(tmp_path) == {"out", "out/data.bin", "out/data.idx", "out/remodel_report.json"}
    work = tmp_path / ".w.partial"
    with shards.locked_work(work, "k"):
        assert json.loads((work / shards.WORK_MARKER).read_text())["made_by"] == "remodel"
    shards.remove_work(work)
    assert not work.exists()


# ---- Deliver 1: train run directories ---------------------------------------------------------------

def _train(out, *flags, model=EMBEDDED):
    return ("train", model, out, "--data", VALID, "--steps", "1", "--seq-len", "16", "--batch", "2",
            "--log-every", "0", *flags)


@pytest.mark.parametrize("flags", [[], ["--overwrite"], ["--resume"]])
def test_train_keeps_user_files_in_an_unmarked_run_dir(tmp_path, capsys, flags):
    kept = _user_folder(tmp_path / "o.run")
    before = listing(tmp_path)
    fails(capsys, *_train(tmp_path / "o", *flags), match="was not made by remodel (no .remodel-run in it)")
    assert _snapshot(tmp_path / "o.run") == kept and listing(tmp_path) == before


def test_train_overwrite_never_follows_a_symlinked_run_dir(tmp_path, capsys):
    kept = _user_folder(tmp_path / "mine")
    state.mark_run_dir(tmp_path / "mine")  # even a marked run dir is not entered through a link
    kept = _snapshot(tmp_path / "mine")
    (tmp_path / "o.run").symlink_to(tmp_path / "mine")
    before = listing(tmp_path)
    fails(capsys, *_train(tmp_path / "o", "--overwrite"), match="is a symbolic link")
    assert _snapshot(tmp_path / "mine") == kept and listing(tmp_path) == before


@pytest.mark.parametrize("inside", ["model", "data"])
def test_train_overwrite_refuses_an_input_inside_the_run_dir(tmp_path, capsys, inside):
    rd = tmp_path / "o.run"
    rd.mkdir()
    state.mark_run_dir(rd)  # remodel's own run dir: only the input rule stands in the way
    shutil.copytree(EMBEDDED, rd / "model")
    shutil.copy(VALID, rd / "valid.txt.gz")
    kept, before = _snapshot(rd), listing(tmp_path)
    model, data = (rd / "model", VALID) if inside == "model" else (EMBEDDED, rd / "valid.txt.gz")
    argv = list(_train(tmp_path / "o", "--overwrite", model=model))
    argv[4] = data
    fails(capsys, *argv, match="lies inside the run directory")
    assert _snapshot(rd) == kept and listing(tmp_path) == before


def test_train_marks_its_run_dir_and_overwrites_only_that(tmp_path, capsys):
    """A run writes RUN_MARKER into OUT.run (kept through --overwrite); a run dir of an older remodel
    (checkpoints, no marker) is still accepted, so its --resume works."""
    out = tmp_path / "o"
    assert cli.main([str(a) for a in _train(out, "--checkpoint-every", "1")]) == 0
    rd = tmp_path / "o.run"
    assert (rd / state.RUN_MARKER).is_file() and state.list_checkpoints(rd)
    assert cli.main([str(a) for a in _train(out, "--checkpoint-every", "1", "--overwrite")]) == 0
    assert (rd / state.RUN_MARKER).is_file()
    (rd / state.RUN_MARKER).unlink()  # as an older remodel left it
    state.check_run_dir(rd, out, [])
    with pytest.raises(RemodelError, match="was not made by remodel"):
        shutil.rmtree(rd / "step-000001")
        state.check_run_dir(rd, out, [])


def test_a_refused_train_leaves_no_marker(tmp_path, capsys):
    """A run refused after its lock (the data gives no tokens) removes the marker and the run dir it made."""
    (tmp_path / "empty.txt").write_text("\n\n")
    argv = list(_train(tmp_path / "o"))
    argv[4] = tmp_path / "empty.txt"
    fails(capsys, *argv)
    assert listing(tmp_path) == {"empty.txt"}


def test_overwrite_of_a_symlinked_out_replaces_the_link_only(tmp_path, capsys):
    """--overwrite on an OUT that is a symlink: the link is replaced, its target's files stay, and no
    `.OUT.old-*` sibling is left behind."""
    kept = _user_folder(tmp_path / "mine")
    (tmp_path / "out").symlink_to(tmp_path / "mine")
    assert cli.main([str(a) for a in ("tokenize", VALID, tmp_path / "out", "--tokenizer", EMBEDDED,
                                      "--overwrite")]) == 0
    assert _snapshot(tmp_path / "mine") == kept
    assert not (tmp_path / "out").is_symlink() and (tmp_path / "out" / "tokens.bin").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"]
