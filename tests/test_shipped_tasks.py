"""The shipped lm-eval tasks (data/tasks, built by data/make_tasks.py): rebuilt byte for byte from the held-out
corpus, and remodel_nextphrase tells the embedded checkpoint from its demo-pruned copy beyond a standard error
(its predecessor remodel_nextline scored both at chance, issue 55)."""
import gzip
import importlib.util

import pytest

from remodel import cli
from remodel.pipelines.data.data import DATA_DIR, embedded_corpus
from remodel.pipelines.training.tasks import TASK_DIR

EMBEDDED = DATA_DIR / "embedded"


def make_tasks():
    spec = importlib.util.spec_from_file_location("make_tasks", DATA_DIR / "make_tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_tasks_reproduces_the_shipped_files(tmp_path):
    """Rerunning the seeded builder gives the shipped JSONLs byte for byte (and nothing else is shipped)."""
    make_tasks().main(tmp_path)
    built = sorted(p.name for p in tmp_path.iterdir())
    assert built == sorted(p.name for p in TASK_DIR.glob("*.jsonl")) == ["cloze.jsonl", "nextphrase.jsonl"]
    for name in built:
        assert (tmp_path / name).read_bytes() == (TASK_DIR / name).read_bytes(), name


def test_nextphrase_separates_unpruned_from_pruned(tmp_path):
    """The demo's cut (FFN and Mamba heads halved, hidden 3/4, activation scores) costs remodel_nextphrase more
    than one standard error of either model's accuracy, and the unpruned model is above chance by more than two."""
    from remodel.pipelines.training.tasks import run_tasks
    pytest.importorskip("lm_eval")
    train_txt, _ = embedded_corpus()
    calib = tmp_path / "calib.txt"
    with gzip.open(train_txt, "rt", encoding="utf-8") as f:
        calib.write_text(f.read(400_000), encoding="utf-8")
    assert cli.main(["prune", str(EMBEDDED), str(tmp_path / "pruned"), "--data", str(calib),
                     "--ffn-size", "384", "--mamba-heads", "4", "--hidden-size", "192"]) == 0
    full, pruned = (run_tasks(d, ["remodel_nextphrase"])["remodel_nextphrase"] for d in (EMBEDDED, tmp_path / "pruned"))
    for metric in ("acc", "acc_norm"):
        se = max(full[f"{metric}_stderr"], pruned[f"{metric}_stderr"])
        assert full[metric] - pruned[metric] > se, (metric, full, pruned)
        assert full[metric] - 0.25 > 2 * full[f"{metric}_stderr"], (metric, full)
