"""Nothing run, nothing lost (issue 39): code named by a tokenizer's `auto_map` never runs (not even with
`y` on stdin), and remodel never deletes what it did not create: a user's folder at a work or run
directory's name, a symlinked run directory, an input inside the run directory. Each case is a one-line
error (exit 2) with the user's files byte-for-byte intact and nothing new written."""
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


# ---- issue 53, Deliver 2: stale siblings known by their marker, never by their name ------------------------

DEAD_PID = 2**22 + 12345  # above the default pid_max: never a live process


def _files(d: Path) -> dict:
    """Every file and link under d with its bytes (or link target) and mtime: what a refused run must leave."""
    out = {}
    for p in sorted(Path(d).rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(d))] = ("link", os.readlink(p), p.lstat().st_mtime_ns)
        elif p.is_file():
            out[str(p.relative_to(d))] = (p.read_bytes(), p.stat().st_mtime_ns)
        else:
            out[str(p.relative_to(d))] = ("dir",)
    return out


def _convert(out):
    return cli.main(["convert", str(EMBEDDED), str(out), "--dtype", "float32"])


@pytest.mark.parametrize("kind", ["tmp", "old"])
def test_a_user_folder_with_a_sibling_name_is_never_touched(tmp_path, kind):
    """`.OUT.tmp-<dead pid>-<hex>` was deleted as a killed run's temporary, `.OUT.old-...` renamed to OUT (and the
    run then refused: OUT not empty). Without remodel's marker inside, either is a user's: kept as it is, and
    the run writes OUT beside it. A marker naming another OUT or pid, or a link by that name, is not remodel's."""
    from remodel.models.outputs import SIBLING_MARKER
    user = _user_folder(tmp_path / f".o.{kind}-{DEAD_PID}-0123abcd")
    forged = tmp_path / f".o.{kind}-{DEAD_PID}-4567abcd"  # a marker whose pid is not the one its name says
    _user_folder(forged)
    (forged / SIBLING_MARKER).write_text(json.dumps({"made_by": "remodel", "kind": kind, "pid": 1, "out": "o"}))
    mine = _user_folder(tmp_path / "mine")
    (tmp_path / f".o.{kind}-{DEAD_PID}-89abcdef").symlink_to(tmp_path / "mine")
    before = _files(tmp_path)
    assert _convert(tmp_path / "o") == 0
    after = _files(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("o/") and k != "o"} == before  # bytes and mtimes
    assert _snapshot(tmp_path / f".o.{kind}-{DEAD_PID}-0123abcd") == user and "notes.txt" in user
    assert _snapshot(tmp_path / "mine") == mine and (tmp_path / "o" / "config.json").is_file()
    assert not (tmp_path / "o" / "notes.txt").exists()  # OUT is the converted model, never the user's folder


def test_remodel_siblings_carry_the_marker(tmp_path):
    """The temporary sibling (and the one holding a replaced OUT) carry SIBLING_MARKER naming kind, pid and
    OUT, which is what lets a later run clean up after a killed one (tests/test_bad_input.py's stale and
    kill -9 cases); after the run only OUT is left."""
    from remodel.models.outputs import SIBLING_MARKER, atomic_output_dir
    out = tmp_path / "o"
    with atomic_output_dir(out) as tmp:
        info = json.loads((tmp.parent / SIBLING_MARKER).read_text())
        assert info == {"made_by": "remodel", "kind": "tmp", "pid": os.getpid(), "out": "o"}
        assert tmp.parent.name.startswith(f".o.tmp-{os.getpid()}-")
        (tmp / "a").write_text("1")
    seen = []
    real_rename = Path.rename

    def spy(self, target):  # the previous OUT moves into a marked `.o.old-*` sibling
        if Path(target).parent.name.startswith(".o.old-"):
            seen.append(json.loads((Path(target).parent / SIBLING_MARKER).read_text()))
        return real_rename(self, target)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "rename", spy)
        with atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / "b").write_text("2")
    assert seen == [{"made_by": "remodel", "kind": "old", "pid": os.getpid(), "out": "o"}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"] and (out / "b").read_text() == "2"


# ---- issue 53, Deliver 2: a refused --resume writes nothing -------------------------------------------------

TRAIN2 = ["--data", VALID, "--steps", "2", "--seq-len", "16", "--batch", "2", "--log-every", "0"]


@pytest.fixture(scope="module")
def legacy_run(tmp_path_factory):
    """A 2-step train with checkpoints at steps 1 and 2, its run dir as an older remodel left it (no marker)."""
    work = tmp_path_factory.mktemp("legacy")
    assert cli.main([str(a) for a in ("train", EMBEDDED, work / "o", *TRAIN2, "--checkpoint-every", "1",
                                      "--keep-last", "0")]) == 0
    (work / "o.run" / state.RUN_MARKER).unlink()
    return work / "o.run"


def _tamper_chunk(rd: Path, key: str, fill: bytes):
    md = json.loads((rd / "step-000002" / "dcp_metadata.json").read_text())["tensors"][key]
    (c,) = md["chunks"]
    with open(rd / "step-000002" / c["file"], "r+b") as f:
        f.seek(c["offset"])
        f.write(fill * (c["length"] // len(fill)))


def _edit_meta2(rd: Path, fn):
    path = rd / "step-000002" / "meta.json"
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m))


RESUME_REFUSALS = {  # how the run dir is damaged, the command's extra flags, what the one line says
    "other_args": (None, ["--lr", "0.5"], "lr differ from that run"),
    "distill_on_a_train_run": (None, ["--teacher"], "differ from that run"),
    "other_data": (None, ["--data", None], "the training data changed"),
    "bad_meta": (lambda rd: _edit_meta2(rd, lambda m: m["history"][0].update(loss="low")), [], "bad 'loss'"),
    "no_dcp_index": (lambda rd: (rd / "step-000002" / "dcp_metadata.json").unlink(), [], "no dcp_metadata.json"),
    "negative_moment": (lambda rd: _tamper_chunk(rd, "optim.layers.1.mixer.up_proj.weight.exp_avg_sq",
                                                 struct.pack("<f", -1.0)), [], "AdamW state exp_avg_sq"),
    "garbage_rng": (lambda rd: _tamper_chunk(rd, "rng.torch", b"\xff"), [], "RNG state does not load"),
}


@pytest.mark.parametrize("case", list(RESUME_REFUSALS))
def test_a_refused_resume_writes_nothing(legacy_run, tmp_path, capsys, case):
    """Each refusal of `train/distill --resume` on a run dir of an older remodel (no marker) wrote the
    marker into it before refusing, and removed what a killed save had left; now the run dir's files, their
    bytes and mtimes are as they were (nothing written, nothing removed)."""
    rd = tmp_path / "o.run"
    shutil.copytree(legacy_run, rd)
    (rd / ".step-000003.partial").mkdir()  # a killed save's leftover: removed only by a resume that goes ahead
    (rd / ".step-000003.partial" / "x").write_bytes(b"half")
    damage, flags, match = RESUME_REFUSALS[case]
    if damage is not None:
        damage(rd)
    argv = ["train", EMBEDDED, tmp_path / "o", *TRAIN2, "--checkpoint-every", "1", "--keep-last", "0", "--resume"]
    if flags == ["--teacher"]:
        argv = ["distill", "--teacher", EMBEDDED, "--student", EMBEDDED, *argv[2:]]
    elif flags and flags[0] == "--data":  # the run's recorded path, now holding other text
        other = tmp_path / "other.txt"
        other.write_text("a different corpus of words\n" * 200)
        _edit_meta2(rd, lambda m: m["args"].update(data=str(other)))
        argv[argv.index("--data") + 1] = other
    else:
        argv += flags
    before, names = _files(rd), listing(tmp_path)
    fails(capsys, *argv, match=match)
    assert _files(rd) == before and not (rd / state.RUN_MARKER).exists()
    assert listing(tmp_path) == names


# ---- issue 53, Deliver 2: a run that fails at its first step removes what it wrote --------------------------

def _overflowing_model(d: Path) -> Path:
    """The embedded model with its final norm at 65515: in float16's range, but one step at --lr 10 leaves it
    past 65504, so the float16 export of step 1 overflows."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(EMBEDDED, d)
    t = load_file(d / "model.safetensors")
    t["backbone.norm_f.weight"] = t["backbone.norm_f.weight"].clone().fill_(65515.0)
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    return d


OVERFLOW = ["--lr", "10", "--weight-decay", "0", "--dtype", "float16", "--checkpoint-every", "1"]


def test_a_run_failing_at_its_first_step_leaves_nothing(tmp_path, capsys):
    """A float16 run that overflows at step 1 left OUT.run/step-000001 (and the marker); now the error is one
    line and nothing of the run is left: no OUT, no OUT.run, no temporary sibling."""
    model = _overflowing_model(tmp_path / "m")
    before = listing(tmp_path)
    fails(capsys, "train", model, tmp_path / "o", *TRAIN2[:2], "--steps", "1", *TRAIN2[4:], *OVERFLOW,
          match="beyond float16's range")
    assert listing(tmp_path) == before
    (tmp_path / "o.run").mkdir()  # an existing (empty) run dir: it stays, as it was
    fails(capsys, "train", model, tmp_path / "o", *TRAIN2[:2], "--steps", "1", *TRAIN2[4:], *OVERFLOW,
          match="beyond float16's range")
    assert listing(tmp_path) == before | {"o.run"}


def test_a_resumed_run_failing_at_its_first_step_keeps_the_older_run(tmp_path, capsys):
    """--resume (--keep-last 1) from an older run's step 1: this run's step 2 overflows at the float16 export.
    Its step-000002 goes; the older run's step-000001 (which pruning to --keep-last 1 would have removed at
    the save of step 2) and every other file of the run dir stay, bytes and mtimes."""
    model = _overflowing_model(tmp_path / "m")
    argv = ["train", model, tmp_path / "o", *TRAIN2, *OVERFLOW[:4], "--checkpoint-every", "1", "--keep-last", "0"]
    assert cli.main([str(a) for a in argv]) == 0  # written in float32: no overflow
    shutil.rmtree(tmp_path / "o")  # as a run killed after its step 1 left it
    shutil.rmtree(tmp_path / "o.run" / "step-000002")
    before, names = _files(tmp_path / "o.run"), listing(tmp_path)
    assert "step-000001/meta.json" in before and state.RUN_MARKER in before
    fails(capsys, *argv[:-1], "1", "--dtype", "float16", "--resume", match="beyond float16's range")
    assert _files(tmp_path / "o.run") == before and listing(tmp_path) == names


def test_non_finite_weights_are_never_checkpointed(tmp_path, capsys, monkeypatch):
    """An update that leaves a weight inf with the step's loss still finite (it was computed before the update)
    saved a checkpoint of it; now the save refuses in one line and the run leaves nothing."""
    from remodel.pipelines.training import trainer
    real = trainer.build_optimizer

    def poisoned(params, *a, **k):
        opt = real(params, *a, **k)
        step = opt.step

        def bad_step(*sa, **sk):
            out = step(*sa, **sk)
            with torch.no_grad():
                next(iter(params.values())).view(-1)[0] = float("inf")
            return out
        opt.step = bad_step
        return opt
    monkeypatch.setattr(trainer, "build_optimizer", poisoned)
    before = listing(tmp_path)
    fails(capsys, *_train(tmp_path / "o", "--checkpoint-every", "1", "--steps", "2"),
          match="weights became NaN or inf by step 1")
    assert listing(tmp_path) == before
