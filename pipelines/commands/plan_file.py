"""The PLAN file: `remodel plan --out PLAN` writes its candidates, `remodel prune MODEL OUT --plan PLAN
--candidate K` applies one exactly (the written model's parameter count is the row's).

A plan file is input from anywhere: it is read with a size bound, parsed as strict JSON (no NaN / Infinity),
and every field used is checked (types, ranges, the model shape it was made for, the row's count against the
shape it describes) before anything is read from the checkpoint or written; each refusal is one line naming
--plan (or --candidate).
"""
from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from pathlib import Path

from remodel.compress.search_space import WIDTHS
from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.families import depth_units
from remodel.models.families.depth_forms import choose
from remodel.models.hf import our_shapes
from remodel.models.kinds import KINDS
from remodel.models.params import count_params, memory_bytes

FORMAT, VERSION = "remodel-plan", 1
MAX_BYTES = 64 * 1024**2  # a plan of 10^4 candidates is a few MB
MAX_CANDIDATES = 10**4
MAX_WIDTH = 2**24


def candidate_config(cfg: ModelConfig, cand: dict, family: str | None = None) -> ModelConfig:
    """The ModelConfig of a candidate (its widths, its pattern after dropping `drop_layers`)."""
    drop = set(cand.get("drop_layers") or ())
    kept = [i for j, u in enumerate(depth_units(cfg, family)) if j not in drop for i in u]
    return cfg.replace(pattern="".join(cfg.pattern[i] for i in kept),
                       **{WIDTHS[a].path: v for a, v in cand["widths"].items()})


def check_plan_out(path, overwrite: bool) -> Path:
    """Refuses (before any work) a PLAN path that exists without --overwrite, is a folder, or has no parent."""
    p = Path(path)
    if p.is_dir():
        raise RemodelError(f"--out {p}: is a directory (PLAN is a JSON file)")
    if p.exists() and not overwrite:
        raise RemodelError(f"--out {p}: exists (pass --overwrite to replace it)")
    if not p.parent.is_dir():
        raise RemodelError(f"--out {p}: folder {p.parent} does not exist")
    return p


def write_plan(path, report: dict, cfg: ModelConfig) -> None:
    """The plan report plus what a reader checks (format, version, the source model's config), written
    atomically (a temporary file beside PLAN, then renamed over it)."""
    p = Path(path)
    doc = {"format": FORMAT, "version": VERSION, "config": cfg.to_dict(), **report}
    text = json.dumps(doc, indent=1, allow_nan=False)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would create it, not mkstemp's 0600
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _bad(path, why: str) -> RemodelError:
    return RemodelError(f"--plan {path}: {why}")


def _no_constant(name):
    raise ValueError(f"{name} is not a number JSON allows")


def read_plan(path) -> dict:
    """PLAN's JSON object, size-bounded and strict; one-line errors naming --plan."""
    p = Path(path)
    if not p.is_file():
        raise _bad(path, "no such file (write one with `remodel plan MODEL --params P --out PLAN`)")
    if p.stat().st_size > MAX_BYTES:
        raise _bad(path, f"larger than {MAX_BYTES // 1024**2} MiB: not a plan file")
    try:
        doc = json.loads(p.read_bytes().decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _bad(path, f"not valid JSON ({str(e).splitlines()[0][:200]})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _bad(path, f"not a plan file (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise _bad(path, f"plan format version {doc.get('version')!r}, this remodel reads {VERSION}")
    return doc


def _int(v, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _check_source(path, doc: dict, cfg: ModelConfig, family: str) -> None:
    if doc.get("family") != family:
        raise _bad(path, f"made for a {doc.get('family')!r} model, MODEL is {family!r}")
    try:
        theirs = ModelConfig.from_dict(doc.get("config"))
    except Exception as e:  # noqa: BLE001 - any malformed config is one line
        raise _bad(path, f"no usable model config ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
    if our_shapes(theirs) != our_shapes(cfg):
        a, b = theirs.flat(), cfg.flat()
        diff = [k for k in b if k != "extra" and a.get(k) != b[k]]
        raise _bad(path, f"made for another model (differs in {', '.join(diff[:4]) or 'tensor shapes'}); "
                         "re-run `remodel plan` on MODEL")


def _check_row(path, row, k: int, cfg: ModelConfig, family: str) -> dict:
    """The candidate's prune targets {width: value, 'drop_layers': [...]}, its fields checked."""
    if not isinstance(row, dict):
        raise _bad(path, f"candidate {k} is not an object")
    widths, drop, params = row.get("widths"), row.get("drop_layers"), row.get("params")
    n_units = len(depth_units(cfg, family))
    if not isinstance(widths, dict) or any(a not in WIDTHS for a in widths) \
            or not all(v is None or _int(v, 0, MAX_WIDTH) for v in widths.values()):
        raise _bad(path, f"candidate {k}: \"widths\" must map width names ({', '.join(WIDTHS)}) to integers")
    if not isinstance(drop, list) or not all(_int(j, 0, n_units - 1) for j in drop) or len(set(drop)) != len(drop) \
            or len(drop) >= n_units:
        raise _bad(path, f"candidate {k}: \"drop_layers\" must be distinct layer-unit indices below {n_units}")
    if not _int(params, 1, 2**62):
        raise _bad(path, f"candidate {k}: \"params\" must be a positive integer")
    try:
        new = candidate_config(cfg, {"widths": widths, "drop_layers": drop}, family)
        got = count_params(new, family)["total"]
    except Exception as e:  # noqa: BLE001 - a shape the model cannot take: one line
        raise _bad(path, f"candidate {k}: not a shape of MODEL ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None
    if got != params:
        raise _bad(path, f"candidate {k}: its shape has {got:,} parameters, the row says {params:,} (edited?)")
    targets = {a: v for a, v in widths.items() if v != WIDTHS[a].of(cfg)}
    return {**targets, **({"drop_layers": sorted(drop)} if drop else {}), "params": params}


def plan_targets(path, candidate: int, cfg: ModelConfig, family: str) -> dict:
    """The prune targets of candidate `candidate` (1-based, the table's #) of PLAN, checked against MODEL's
    config; with "params": the row's parameter count, which the pruned model must have."""
    rows = _rows(path, cfg, family, candidate)
    return _check_row(path, rows[candidate - 1], candidate, cfg, family)


def _rows(path, cfg: ModelConfig, family: str, candidate: int | None) -> list:
    """PLAN's candidate rows (unchecked), once the file, its model and the --candidate number pass."""
    doc = read_plan(path)
    _check_source(path, doc, cfg, family)
    rows = doc.get("candidates")
    if not isinstance(rows, list) or not rows or len(rows) > MAX_CANDIDATES:
        raise _bad(path, f"\"candidates\" must be a list of 1 to {MAX_CANDIDATES} rows")
    if candidate is not None and not 1 <= candidate <= len(rows):
        raise RemodelError(f"--candidate {candidate}: --plan {path} has {len(rows)} candidate(s) (1..{len(rows)})")
    return rows


def plan_rows(path, cfg: ModelConfig, family: str, candidate: int | None = None, unit_scores=None) -> list[dict]:
    """PLAN's candidates (all, or the one numbered `candidate`) as checked rows of what `search` ranks: rebuilt
    from each row's widths and layers (nothing else of the file is trusted), the layers re-placed by
    `unit_scores` when given (place_by_scores); "rank" is the plan's #, "params" the row's (checked)."""
    rows = _rows(path, cfg, family, candidate)
    out = []
    for k in [candidate] if candidate is not None else range(1, len(rows) + 1):
        t = _check_row(path, rows[k - 1], k, cfg, family)
        params, drop = t.pop("params"), t.pop("drop_layers", [])
        if drop and unit_scores is not None:
            drop = place_by_scores(cfg, family, drop, unit_scores)
        new = candidate_config(cfg, {"widths": t, "drop_layers": drop}, family)
        c = count_params(new, family)
        gone = Counter(cfg.pattern) - Counter(new.pattern)
        out.append({"rank": k, "params": params, "active_params": c["active"],
                    "memory_bytes": memory_bytes(new)["total"], "widths": {a: WIDTHS[a].of(new) for a in rows[k - 1]["widths"]},
                    "changed": {a: [WIDTHS[a].of(cfg), v] for a, v in t.items()},
                    "layers_removed": {KINDS[ch].name: n for ch, n in gone.items()}, "num_layers": new.num_layers,
                    "pattern": new.pattern, "drop_layers": drop,
                    "prune_targets": {**t, **({"drop_layers": drop} if drop else {})}})
    return out


def place_by_scores(cfg: ModelConfig, family: str, drop: list, unit_scores: list) -> list:
    """The same number of layer units of each type as `drop` removes, chosen as the least important of their
    type by `unit_scores` (one per depth unit; ties: lower index), as plan places them with scores; where the family
    cannot write what those leave (Jamba's period and offset), its writable set of least scores."""
    units = depth_units(cfg, family)
    types = ["".join(cfg.pattern[i] for i in u) for u in units]
    out = []
    for t, r in Counter(types[j] for j in drop).items():
        js = [j for j, x in enumerate(types) if x == t]
        out += sorted(js, key=lambda j: (unit_scores[j], j))[:r]
    return choose(cfg, family, Counter(types[j] for j in drop), unit_scores, out)  # a set the family can write
