"""Where a run executes: device, tokenizer, output checks, and the process group / DeviceMesh.

A single process is the 1-rank case: `init_mesh` returns None and everything that takes a mesh treats
None as one rank. Under torchrun the processes form a ("dp", "tp") DeviceMesh, dp = processes // tp.
Collectives of the training loop time out after REMODEL_DIST_TIMEOUT seconds (default 30); waits for
one rank's solo work (evaluation, export) use a gloo group with REMODEL_DIST_WAIT_TIMEOUT (default 3600),
as does the ranks' meeting (rendezvous, forming each group): a late start is no stall.
"""
from __future__ import annotations

import atexit
import datetime
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from remodel.models.outputs import make_parents, remove_dirs
from remodel.models.errors import RemodelError
from remodel.models.files import read_json
from remodel.models.load import read_config_dict


def pick_device(device="auto") -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_tokenizer(model_dir, flag: str = "MODEL"):
    """The tokenizer of a model or tokenizer folder (AutoTokenizer, local files only, never code from the
    folder: see refuse_remote_code); a one-line error naming `flag` otherwise."""
    d = Path(model_dir).expanduser()
    if not any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise RemodelError(f"{d}: no tokenizer files (tokenizer.json / tokenizer_config.json) in the model directory")
    for f in TOKENIZER_FILES:  # a FIFO or device there would block the load forever
        if (d / f).exists() and not (d / f).is_file():
            raise RemodelError(f"{d / f}: not a regular file")
    refuse_remote_code(d, flag)
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(d), trust_remote_code=False, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is a bad input
        raise RemodelError(f"{d}: cannot load the tokenizer ({type(e).__name__}: {e})".splitlines()[0]) from None


def refuse_remote_code(folder, flag: str = "MODEL"):
    """Refuse, before transformers sees the folder, a tokenizer_config.json with an `auto_map` (code in the
    folder to import) or a config.json whose `auto_map` names a tokenizer class. A model config's other
    auto_map entries (Nemotron-H checkpoints carry them for their modeling code) are left alone: remodel
    runs its own model code, and every transformers load passes trust_remote_code=False."""
    d = Path(folder).expanduser()
    for name in ("tokenizer_config.json", "config.json"):
        if not (d / name).is_file():
            continue
        am = read_json(d / name).get("auto_map")
        if am is None or (name == "config.json" and isinstance(am, dict) and "AutoTokenizer" not in am):
            continue
        raise RemodelError(f"{d / name}: its auto_map names code in the checkpoint to run ({flag}); remodel "
                           "never runs code from a file: remove auto_map or use a tokenizer without custom code")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
LOCK_NAME = ".lock"  # the lock file of a run directory (RunLock)


class RunLock:
    """An exclusive, non-blocking flock on RUN_DIR/.lock: a second run writing the same OUT refuses in
    one line instead of interleaving checkpoints. The kernel drops the lock when the holder dies, so a
    killed run never leaves a stale one. The lock file records the holder's pid; release() removes it,
    and the directories acquire() created while they hold nothing else. A refused acquire creates nothing."""

    def __init__(self, run_dir: Path, out: Path):
        self.run_dir, self.out, self.path = Path(run_dir), Path(out), Path(run_dir) / LOCK_NAME
        self.fd, self.made = None, []

    def acquire(self) -> "RunLock":
        import fcntl
        self._mkdirs()
        try:
            while self.fd is None:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    raise RemodelError(f"{self.out} is in use by another run (pid {holder}); wait for it to end "
                                       f"or write elsewhere") from None
                if _same_file(fd, self.path):
                    self.fd = fd
                else:  # released and removed by its holder between our open and flock: retry
                    os.close(fd)
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            self.release()
            raise
        return self

    def _mkdirs(self):
        self.made = make_parents(self.path)  # run_dir and its missing parents
        if not self.run_dir.is_dir():
            raise RemodelError(f"{self.run_dir}: exists and is not a directory (the run directory of {self.out})")

    def release(self):
        """Drop the lock (idempotent); remove the lock file and the now-empty directories acquire made."""
        if self.fd is not None:
            try:
                self.path.unlink()
            except OSError:
                pass
            os.close(self.fd)  # unlinked first: a waiter that opened the old file sees it is gone and retries
            self.fd = None
        remove_dirs(self.made)  # only while empty: a run that wrote checkpoints keeps its run directory
        self.made = []


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_out(out: Path, overwrite: bool, inputs):
    """OUT may not overlap an input, be a file, or be a non-empty directory without --overwrite."""
    real = out.resolve()
    for inp in inputs:
        inp = Path(inp).resolve()
        if real == inp or inp in real.parents or real in inp.parents:
            raise RemodelError(f"{out}: output overlaps input directory {inp}; write the output elsewhere")
    if out.exists() and not out.is_dir():
        raise RemodelError(f"{out}: output exists and is not a directory")
    if out.is_dir() and not overwrite and any(out.iterdir()):
        raise RemodelError(f"{out}: output directory exists and is not empty (pass --overwrite to replace it)")


def source_dtype(model_dir: Path):
    """The dtype a checkpoint was stored in (so an output can match it); None if unknown."""
    d = read_config_dict(model_dir)
    name = d.get("dtype") or d.get("torch_dtype")
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    return dt if isinstance(dt, torch.dtype) and dt.is_floating_point else None


def return_freed_memory(sharded: bool):
    """Fix glibc's mmap threshold so that every larger block (FSDP's all-gathered layers, gradients,
    optimizer temporaries) is mapped on its own and given back to the OS when freed. By default glibc
    raises the threshold to the largest block it has freed (up to 32 MiB) and serves later blocks from
    its heap, which keeps freed memory resident. Sharded runs (memory per rank is their point) use
    1 MiB, so peak RSS follows live memory at some cost in step time; one process uses 16 MiB.
    REMODEL_MMAP_THRESHOLD (bytes; 0 leaves glibc alone) overrides both. No-op where glibc's mallopt
    is missing (macOS, musl). Measurements: bench/RESULTS.md."""
    default = 1 << 20 if sharded else 16 << 20
    threshold = int(os.environ.get("REMODEL_MMAP_THRESHOLD", default))
    if threshold <= 0:
        return
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


# ---- process group and mesh -------------------------------------------------------------------

def timeout(var: str, default: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get(var, default)))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def init_dist(dev: torch.device) -> torch.device:
    """This rank's device; initialises the default process group from torchrun's environment unless one
    exists. It is kept for later calls in the process (a second init under torchrun would hang) and
    destroyed at exit (gloo threads alive at interpreter exit can abort a finished rank)."""
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        return dev
    if not {"WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"} <= set(os.environ):
        raise RemodelError("tensor/expert/data parallelism needs one process per rank: launch with "
                           "`torchrun --nproc-per-node N cli.py train|distill ... --tp T --ep E`")
    dist.init_process_group(dist.get_default_backend_for_device(dev), timeout=_wait_timeout())
    _short(None)
    atexit.register(_destroy)
    return dev


def _wait_timeout() -> datetime.timedelta:
    """The long wait: for one rank's solo work (`wait_group`), and for the ranks' meeting (the store, gloo's
    full mesh): on a loaded machine one rank can start many seconds after another, which is no stall (the
    short collective timeout failed the rendezvous)."""
    return timeout("REMODEL_DIST_WAIT_TIMEOUT", 3600)


def _short(group):
    """`group` (None: the default one) connected: its collectives now time out after REMODEL_DIST_TIMEOUT
    (torchtitan's pattern; torch's public set_timeout where it has one, its private twin before)."""
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    set_timeout(timeout("REMODEL_DIST_TIMEOUT", 30), group)
    return group


def _destroy():
    if dist.is_initialized():
        dist.destroy_process_group()


def layout(world: int, tp: int, ep: int, batch: int) -> tuple[int, str | None]:
    """-> (dp, the mesh dimension experts are sharded over or None); one-line errors for layouts that
    cannot work."""
    if tp < 1 or ep < 1:
        raise RemodelError(f"--tp and --ep must be >= 1, got tp={tp} ep={ep}")
    if world % tp:
        raise RemodelError(f"--tp {tp} does not divide the {world} processes")
    dp = world // tp
    ep_dim = None
    if ep > 1:
        if ep == tp:
            ep_dim = "tp"
        elif ep == dp:
            ep_dim = "dp"
        else:
            raise RemodelError(f"--ep {ep} must equal --tp {tp} or dp={dp} (= processes / tp): expert parallelism "
                               "is folded over the tensor- or the data-parallel ranks")
    if batch % dp:
        raise RemodelError(f"--batch {batch} is not divisible by the {dp} data-parallel ranks (processes / tp)")
    return dp, ep_dim


def init_mesh(device_type: str, dp: int, tp: int):
    """("dp", "tp") DeviceMesh whose groups carry the short timeout (init_device_mesh's subgroups would
    get torch's 30-minute default); None for one process."""
    if dp * tp == 1 and not dist.is_initialized():
        return None
    from torch.distributed.device_mesh import DeviceMesh
    grid = torch.arange(dp * tp).view(dp, tp)
    me, mine = dist.get_rank(), {}
    for name, rows in (("dp", grid.t().tolist()), ("tp", grid.tolist())):
        for ranks in rows:  # every rank creates every group, in the same order
            g = dist.new_group(ranks, timeout=_wait_timeout())
            if me in ranks:
                mine[name] = _short(g)
    return DeviceMesh.from_group([mine["dp"], mine["tp"]], device_type, mesh=grid, mesh_dim_names=("dp", "tp"))


def wait_group():
    """A gloo group with the long timeout, for waits on one rank's solo work; None for one process."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=_wait_timeout())


def wait(group):
    """Barrier on the long-timeout group (others wait while rank 0 works alone); no-op in one process."""
    if group is not None:
        dist.barrier(group=group)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ---- errors under torchrun: the rank that has one tells the user (issue 39) -------------------

_ERROR_KEY = "remodel/error/rank0"


def rank_local_error(msg: str, wait_s: float = 3.0) -> bool:
    """Whether this rank's error `msg` is its own, so that it must print it (rank 0 will not): true on
    a rank other than 0 when, within wait_s, rank 0 posts no error or another one. Rank 0 posts its
    error in the process group's store and returns False (it prints anyway). False without a process
    group: errors raised before the group forms are the same on every rank, and rank 0 prints them."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return False
    try:
        store = dist.distributed_c10d._get_default_store()
        if dist.get_rank() == 0:
            store.set(_ERROR_KEY, msg)
            return False
        end = time.monotonic() + wait_s
        while not store.check([_ERROR_KEY]) and time.monotonic() < end:
            time.sleep(0.05)
        return not store.check([_ERROR_KEY]) or store.get(_ERROR_KEY).decode(errors="replace") != msg
    except Exception:  # noqa: BLE001 - no store to compare with: better one line twice than none
        return dist.get_rank() != 0


def peer_lost(e: BaseException) -> str | None:
    """`e` as a broken collective under torchrun: "" when another rank ended (gloo's "Connection closed
    by peer"): that rank printed its own error and torchrun names it, so this one ends quietly instead
    of with a traceback of the collective; a one-line message for another collective failure (a
    timeout: a rank stalled); None when `e` is no collective failure (or there is no process group)."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    text = str(e)
    if not isinstance(e, dist.DistError) and not (isinstance(e, RuntimeError) and any(
            s in text for s in ("gloo", "Gloo", "NCCL", "Timed out", "timed out", "Connection"))):
        return None
    if "Connection closed by peer" in text or "Connection reset by peer" in text:
        return ""
    first = " ".join(text.split())[:200]
    return (f"a collective failed ({first}): another rank stalled or ended "
            f"(REMODEL_DIST_TIMEOUT={os.environ.get('REMODEL_DIST_TIMEOUT', 30)} s)")


# ---- worker processes that die with their parent (tokenize) ----------------------------------

_WORKER_PID = None  # the process die_with_parent last armed (a forked worker has another pid)


def die_with_parent(owner: int):
    """In a process other than `owner` (the one that called tokenize), once per process: have the kernel
    SIGKILL it when its parent dies (Linux prctl PR_SET_PDEATHSIG), so a killed `remodel tokenize` leaves
    no orphaned map workers or Manager; elsewhere a thread that ends the process once the parent is gone."""
    global _WORKER_PID
    pid = os.getpid()
    if pid == owner or _WORKER_PID == pid:
        return
    _WORKER_PID = pid
    parent = os.getppid()
    try:
        import ctypes
        armed = ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0) == 0  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        armed = False
    if parent == 1 or os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)
    if not armed:
        def watch():
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)
        threading.Thread(target=watch, daemon=True, name="remodel-parent-watch").start()


class ChildrenDieWithUs:
    """While this object lives, every process the `multiprocess` package starts from this one (datasets.map's
    pool workers and the Manager that feeds its progress queue) calls die_with_parent first thing."""

    def __init__(self):
        self.owner = os.getpid()
        try:
            import multiprocess.util
            multiprocess.util.register_after_fork(self, ChildrenDieWithUs._arm)  # a weak reference to self
        except ImportError:
            pass

    @staticmethod
    def _arm(self):
        die_with_parent(self.owner)
