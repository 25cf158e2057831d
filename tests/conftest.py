"""Test-wide settings: keep idle OpenMP threads from spinning (on a 2-core
machine busy-waiting threads in one process slow every other process ~5x),
and keep tokenizers single-threaded."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# token sets cached by training runs go to a fresh folder per test session, not ~/.cache
if "REMODEL_CACHE" not in os.environ:
    import tempfile
    os.environ["REMODEL_CACHE"] = tempfile.mkdtemp(prefix="remodel-test-cache-")
