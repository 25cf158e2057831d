"""A task folder read as hostile input (issue 53), before lm-eval opens a file: every YAML of the shipped tasks and
of --task-dir (scan_folders: regular files, bounded sizes, alias expansion and nesting, safe tags that only record
`!function`), what runs code refused unless --trust-task-code (`!function`, `class`, custom datasets and prompts,
dataset scripts or remote code, `include:` outside the folder), fields bounded and named as lm-eval knows them,
data files resolved beside their YAML and checked, and the checked configs handed to lm-eval's factory
(checked_yaml). Errors are one line naming file:line and field. pipelines.training.tasks runs what this checked.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import stat
from pathlib import Path

from remodel.models.errors import RemodelError

MAX_YAML_BYTES = 1 << 20  # one task YAML
MAX_YAML_FILES = 10_000  # YAMLs in one folder
MAX_NODES = 100_000  # values of one YAML after alias expansion (billion laughs)
MAX_DEPTH = 64  # nesting of one YAML's values, and of include: chains
MAX_DATA_BYTES = 1 << 30  # one data file
MAX_REPEATS = 1000
MAX_FEWSHOT = 1000
MAX_GEN_TOKENS = 1 << 15  # max_gen_toks / max_new_tokens / max_length of generation_kwargs
DATA_BUILDERS = ("json", "csv", "parquet", "text", "arrow")  # datasets' file readers that run no task code
TRUST = "pass --trust-task-code to allow it"
_GEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_length")


class _Code(str):
    """A `!function mod.f` of a task YAML, unresolved: its spec, file and line (resolved by lm-eval's own
    importer only under --trust-task-code)."""
    where: str = ""


class _Map(dict):
    """A YAML mapping that keeps each key's line (for one-line errors naming file, line and field)."""
    lines: dict = {}


def _loader(path: Path):
    """A safe YAML loader (no Python tags) for `path` whose `!function` becomes a _Code and whose mappings
    remember their keys' lines."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def function(loader, node):
        code = _Code(loader.construct_scalar(node))
        code.where = f"{path}:{node.start_mark.line + 1}"
        return code

    def mapping(loader, node):
        data = _Map()
        yield data
        data.update(loader.construct_mapping(node))
        data.lines = {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}

    Loader.add_constructor("!function", function)
    Loader.add_constructor("tag:yaml.org,2002:map", mapping)
    return Loader


def _where(path, cfg, key) -> str:
    line = getattr(cfg, "lines", {}).get(key)
    return f"{path}:{line}" if line else str(path)


def _regular(path: Path, what: str, limit: int, flag: str = "--task-dir") -> Path:
    """`path` when it is a regular file (never a FIFO or device, which would block) of at most `limit` bytes."""
    try:
        st = path.stat()
    except OSError as e:
        raise RemodelError(f"{path}: cannot read this {what} ({e.strerror}) ({flag})") from None
    if not stat.S_ISREG(st.st_mode):
        raise RemodelError(f"{path}: not a regular file ({what}) ({flag})")
    if st.st_size > limit:
        raise RemodelError(f"{path}: {st.st_size} bytes, more than the {limit} a {what} may have ({flag})")
    return path


def _size(obj, memo: dict, busy: set, depth: int = 0) -> int:
    """Values in `obj` once every alias is expanded (a shared node counted at each use, capped past
    MAX_NODES); -1 for a node that contains itself; RecursionError past MAX_DEPTH levels."""
    if not isinstance(obj, (dict, list)):
        return 1
    if depth > MAX_DEPTH:
        raise RecursionError
    if id(obj) in memo:
        return memo[id(obj)]
    if id(obj) in busy:
        return -1
    busy.add(id(obj))
    n = 1
    for x in ([*obj.keys(), *obj.values()] if isinstance(obj, dict) else obj):
        m = _size(x, memo, busy, depth + 1)
        if m < 0:
            return -1
        n = min(n + m, MAX_NODES + 1)
    busy.discard(id(obj))
    memo[id(obj)] = n
    return n


def _read_yaml(path: Path) -> dict:
    """One task YAML, bounded: a regular file, MAX_YAML_BYTES, safe tags only, MAX_NODES after aliases."""
    import yaml
    _regular(path, "task YAML", MAX_YAML_BYTES)
    try:
        with open(path, "rb") as f:
            cfg = yaml.load(f.read(MAX_YAML_BYTES + 1), Loader=_loader(path))  # noqa: S506 - a SafeLoader
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise RemodelError(f"{path}{line}: not a valid task YAML: {e.problem or e.context} (--task-dir)") from None
    except RecursionError:
        raise RemodelError(f"{path}: nested more than {MAX_DEPTH} levels deep (--task-dir)") from None
    except (yaml.YAMLError, UnicodeDecodeError, ValueError) as e:
        raise RemodelError(f"{path}: not a valid task YAML: {type(e).__name__} (--task-dir)") from None
    if not isinstance(cfg, dict):
        raise RemodelError(f"{path}: a task YAML holds a mapping of fields, not {type(cfg).__name__} (--task-dir)")
    try:
        n = _size(cfg, {}, set())
    except RecursionError:
        raise RemodelError(f"{path}: nested more than {MAX_DEPTH} levels deep (--task-dir)") from None
    if n < 0:
        raise RemodelError(f"{path}: a YAML alias refers to itself (--task-dir)")
    if n > MAX_NODES:
        raise RemodelError(f"{path}: more than {MAX_NODES} values once its aliases are expanded (--task-dir)")
    return cfg


def _codes(obj, seen=None):
    """Every _Code (`!function`) in obj."""
    seen = set() if seen is None else seen
    if isinstance(obj, _Code):
        yield obj
    elif isinstance(obj, (dict, list)) and id(obj) not in seen:
        seen.add(id(obj))
        for x in (list(obj.keys()) + list(obj.values())) if isinstance(obj, dict) else obj:
            yield from _codes(x, seen)


class _Folder:
    """The YAMLs of the task folders, read and merged (include:) by remodel's bounded loader, checked before
    lm-eval reads any: {resolved path: (merged config, {field: (file, line)}, base of data_files)}."""

    def __init__(self, dirs: list[Path], trust: bool):
        self.trust, self.raw, self.configs = trust, {}, {}
        for root in dirs:
            files = []
            for d, subdirs, names in os.walk(root):
                subdirs[:] = sorted(s for s in subdirs if s not in ("__pycache__", ".ipynb_checkpoints"))
                files += [Path(d) / n for n in sorted(names) if n.endswith(".yaml")]
                if len(files) > MAX_YAML_FILES:
                    raise RemodelError(f"{root}: more than {MAX_YAML_FILES} task YAMLs (--task-dir)")
            for f in files:
                self.configs[f.resolve()] = self._merged(f, Path(root).resolve(), ())

    def _read(self, path: Path) -> dict:
        key = path.resolve()
        if key not in self.raw:
            self.raw[key] = _read_yaml(path)
        return self.raw[key]

    def _merged(self, path: Path, root: Path, seen: tuple):
        """(config with its includes merged as lm-eval merges them, {field: where}, {field: declaring dir})."""
        cfg = self._read(path)
        here = {k: _where(path, cfg, k) for k in cfg}
        base = {k: path.parent for k in cfg}
        if "include" not in cfg:
            return dict(cfg), here, base
        merged, where, bases = {}, {}, {}
        incs = cfg["include"] if isinstance(cfg["include"], list) else [cfg["include"]]
        for inc in incs:
            if not isinstance(inc, str) or isinstance(inc, _Code):
                raise RemodelError(f"{here['include']}: include names a YAML file, not {inc!r} (--task-dir)")
            target = (path.parent / inc).resolve()
            if not self.trust and not target.is_relative_to(root):
                raise RemodelError(f"{here['include']}: include {inc!r} leaves the task folder {root}; {TRUST}")
            if len(seen) >= MAX_DEPTH:
                raise RemodelError(f"{here['include']}: more than {MAX_DEPTH} nested includes (--task-dir)")
            if target in seen or target == path.resolve():
                raise RemodelError(f"{here['include']}: include {inc!r} includes itself (a cycle) (--task-dir)")
            c, w, b = self._merged(target, root, (*seen, path.resolve()))
            c.pop("task_list", None)
            merged.update(c), where.update(w), bases.update(b)
        del here["include"]
        merged.update({k: v for k, v in cfg.items() if k != "include"})
        where.update(here), bases.update({k: path.parent for k in cfg if k != "include"})
        return merged, where, bases


def _refuse_code(cfg: dict, where: dict):
    """One line for code a task config would run: `!function`, a Python task class, a custom dataset or
    prompt, a dataset script or remote code, an unsafe-code task."""
    for code in _codes(cfg):
        raise RemodelError(f"{code.where}: !function {code} runs Python from the task folder; {TRUST}")
    for key in ("class", "custom_dataset", "use_prompt"):
        if key in cfg:
            raise RemodelError(f"{where[key]}: {key} runs code outside the task YAML; {TRUST}")
    if cfg.get("unsafe_code"):
        raise RemodelError(f"{where['unsafe_code']}: unsafe_code: the task runs generated code; {TRUST}")
    path = cfg.get("dataset_path")
    if "dataset_path" in cfg and path not in DATA_BUILDERS:
        raise RemodelError(f"{where['dataset_path']}: dataset_path {path!r} is not one of datasets' file readers "
                           f"({', '.join(DATA_BUILDERS)}); a dataset folder or script may run code; {TRUST}")
    kw = cfg.get("dataset_kwargs")
    if isinstance(kw, dict) and kw.get("trust_remote_code"):
        raise RemodelError(f"{where['dataset_kwargs']}: dataset_kwargs.trust_remote_code runs dataset code; {TRUST}")
    for m in cfg.get("metric_list") or []:
        if isinstance(m, dict) and m.get("hf_evaluate"):
            raise RemodelError(f"{where['metric_list']}: hf_evaluate loads a metric script; {TRUST}")


def _int_field(cfg, where, key, lo, hi, label=None):
    v = cfg.get(key)
    if key in cfg and v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
        raise RemodelError(f"{where}: {label or key} must be an integer in [{lo}, {hi}], got {v!r} (--task-dir)")


def _check_fields(cfg: dict, where: dict, name: str):
    """Field types and bounds lm-eval would trip on late (or hang on): output_type, repeats, num_fewshot,
    generation lengths, metrics, aggregations, filters and the few-shot sampler by registry name."""
    from lm_eval.api import registry, samplers
    from lm_eval.api.task import ALL_OUTPUT_TYPES
    at = lambda k: where.get(k) or str(where.get("task", name))  # noqa: E731
    if not isinstance(cfg.get("task"), str):
        raise RemodelError(f"{at('task')}: task must be a name (a string), got {cfg.get('task')!r} (--task-dir)")
    ot = cfg.get("output_type", "generate_until")
    if ot not in ALL_OUTPUT_TYPES:
        raise RemodelError(f"{at('output_type')}: output_type {ot!r} is not one of {', '.join(ALL_OUTPUT_TYPES)}")
    _int_field(cfg, at("repeats"), "repeats", 1, MAX_REPEATS)
    _int_field(cfg, at("num_fewshot"), "num_fewshot", 0, MAX_FEWSHOT)
    gen = cfg.get("generation_kwargs")
    if gen is not None and not isinstance(gen, dict):
        raise RemodelError(f"{at('generation_kwargs')}: generation_kwargs must be a mapping (--task-dir)")
    for k in _GEN_KEYS:
        _int_field(gen or {}, at("generation_kwargs"), k, 1, MAX_GEN_TOKENS, f"generation_kwargs.{k}")
    metrics = cfg.get("metric_list")
    if metrics is not None and not isinstance(metrics, list):
        raise RemodelError(f"{at('metric_list')}: metric_list must be a list (--task-dir)")
    for m in metrics or []:
        if not isinstance(m, dict) or "metric" not in m:
            raise RemodelError(f"{at('metric_list')}: each metric_list entry needs a `metric` (--task-dir)")
        if not isinstance(m["metric"], _Code) and m["metric"] not in registry.metric_registry:
            raise RemodelError(f"{at('metric_list')}: unknown metric {m['metric']!r} (lm-eval's: "
                               f"{', '.join(sorted(registry.metric_registry))})")
        agg = m.get("aggregation")
        if agg is not None and not isinstance(agg, _Code) and agg not in registry.aggregation_registry:
            raise RemodelError(f"{at('metric_list')}: unknown aggregation {agg!r} of metric {m['metric']!r}")
    for f in cfg.get("filter_list") or []:
        steps = f.get("filter") if isinstance(f, dict) else None
        if not isinstance(steps, list) or "name" not in f:
            raise RemodelError(f"{at('filter_list')}: each filter_list entry needs a name and a filter list")
        for step in steps:
            fn = step.get("function") if isinstance(step, dict) else None
            if not isinstance(fn, _Code) and fn not in registry.filter_registry:
                raise RemodelError(f"{at('filter_list')}: unknown filter function {fn!r} (--task-dir)")
    shots = cfg.get("fewshot_config")
    sampler = shots.get("sampler") if isinstance(shots, dict) else None
    if sampler is not None and not isinstance(sampler, _Code) and sampler not in samplers.SAMPLER_REGISTRY:
        raise RemodelError(f"{at('fewshot_config')}: unknown few-shot sampler {sampler!r} (--task-dir)")


def _data_files(files, base: Path, where: str):
    """data_files (a str, list or split -> str/list dict) resolved beside the YAML that declares them (never
    the current directory): each one a regular file of at most MAX_DATA_BYTES (a glob: each of its matches)."""
    if isinstance(files, dict):
        return {k: _data_files(v, base, where) for k, v in files.items()}
    if isinstance(files, (list, tuple)):
        return [_data_files(v, base, where) for v in files]
    if not isinstance(files, str) or isinstance(files, _Code):
        raise RemodelError(f"{where}: data_files names files, not {files!r} (--task-dir)")
    path = Path(files).expanduser()
    path = path if path.is_absolute() else base / path
    found = sorted(glob.glob(str(path))) if glob.has_magic(str(path)) else [str(path)] if path.exists() else []
    if not found:
        raise RemodelError(f"{where}: data_files {files!r}: no file matches it beside the YAML (--task-dir)")
    for f in found:
        if _regular(Path(f), f"data file of {where}", MAX_DATA_BYTES).stat().st_size == 0:
            raise RemodelError(f"{where}: data file {f} is empty: no documents (--task-dir)")
        if f.endswith(".jsonl"):
            _check_jsonl(Path(f), where)
    return str(path)


def _check_jsonl(path: Path, where: str):
    """Each non-empty line of a JSONL data file one JSON object (else: one line naming file and line)."""
    with open(path, "rb") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise RemodelError(f"{path}:{i}: not a JSON line ({type(e).__name__}: {e}) "
                                   f"(data file of {where})") from None
            if not isinstance(row, dict):
                raise RemodelError(f"{path}:{i}: a JSON line must be an object, not {type(row).__name__} "
                                   f"(data file of {where})")


def register_groups(tm, configs: dict):
    """One line for a group that contains itself (through its `task:` list, at any depth)."""
    def members(name):
        e = tm.task_index.get(name)
        cfg = configs.get(Path(e.yaml_path).resolve(), {}) if e is not None and e.yaml_path else {}
        return [m if isinstance(m, str) else m.get("group") for m in (cfg.get("task") or [])
                if isinstance(m, (str, dict)) and "group" in cfg and isinstance(cfg.get("task"), list)]

    def visit(name, path):
        if name in path:
            e = tm.task_index.get(path[0])
            raise RemodelError(f"{e.yaml_path if e is not None else path[0]}: group {path[0]!r} contains itself "
                               f"({' -> '.join([*path, name])}) (--task-dir)")
        for m in members(name):
            if m is not None:
                visit(m, (*path, name))

    for name in tm.all_groups:
        visit(name, ())


LINES: dict = {}  # resolved YAML path -> {field: "file:line"} of the checked configs (error lines)


def scan_folders(dirs: list[Path], trust: bool) -> dict:
    """{resolved YAML path: lm-eval-ready config}, every YAML of `dirs` checked (module doc); one-line errors."""
    folder, names, out = _Folder(dirs, trust), {}, {}
    for path, (cfg, where, bases) in folder.configs.items():
        if not trust:
            _refuse_code(cfg, where)
        kind = "group" if "group" in cfg else "task" if "task" in cfg else None
        if kind is None:
            continue  # lm-eval skips it too (an include-only fragment)
        name = cfg[kind]
        if not isinstance(name, str) or not name:
            raise RemodelError(f"{where[kind]}: {kind} must be a name (a string), got {name!r} (--task-dir)")
        if name in names:
            raise RemodelError(f"{where[kind]}: {kind} {name!r} is also declared by {names[name]}: task and group "
                               "names must be unique across the task folders and the shipped tasks (--task-dir)")
        names[name] = where[kind]
        cfg = dict(cfg)
        if kind == "task":
            _check_fields(cfg, where, name)
        elif isinstance(cfg.get("task"), list):
            members = []
            for m in cfg["task"]:
                if isinstance(m, dict) and "task" in m and "group" not in m:
                    _check_fields({**{k: v for k, v in cfg.items() if k not in ("group", "task")}, **m},
                                  where, str(m["task"]))
                    kw = m.get("dataset_kwargs")
                    if isinstance(kw, dict) and "data_files" in kw:
                        m = {**m, "dataset_kwargs": {**kw, "data_files": _data_files(kw["data_files"], path.parent,
                                                                                    where["task"])}}
                members.append(m)
            cfg["task"] = members
        kw = cfg.get("dataset_kwargs")
        if isinstance(kw, dict) and "data_files" in kw:
            cfg["dataset_kwargs"] = {**kw, "data_files": _data_files(kw["data_files"], bases["dataset_kwargs"],
                                                                     where["dataset_kwargs"])}
        out[path] = cfg
        LINES[path] = where
    return out


def _import_function(qual: str, base: Path):
    """`module.function` of a YAML's `!function`, as lm-eval resolves it: module.py beside the YAML first, else an
    importable module (only ever called under --trust-task-code)."""
    import importlib.util
    mod, _, name = qual.rpartition(".")
    if not mod:
        raise RemodelError(f"!function {qual!r} names no module (module.function)")
    path = (base / f"{mod.replace('.', '/')}.py").resolve()
    if path.exists():
        spec = importlib.util.spec_from_file_location(mod, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(mod)
    return getattr(module, name)


def resolve_functions(cfg, trusted: bool):
    """cfg with each `!function` resolved by lm-eval's own importer (only ever called under --trust-task-code)."""
    if isinstance(cfg, _Code):
        return _import_function(str(cfg), Path(cfg.where.rsplit(":", 1)[0]).parent)
    if isinstance(cfg, dict):
        return {k: resolve_functions(v, trusted) for k, v in cfg.items()}
    if isinstance(cfg, list):
        return [resolve_functions(v, trusted) for v in cfg]
    return cfg


@contextlib.contextmanager
def checked_yaml(configs: dict, trust: bool):
    """lm-eval's task factory reads remodel's checked configs instead of re-reading a YAML (so what runs is
    what was checked: data_files beside the YAML, no !function unless trusted)."""
    import copy

    import lm_eval.tasks._factory as factory
    saved = factory.load_yaml

    def load(path, resolve_func=True, **_):
        key = Path(path).expanduser().resolve()
        if key not in configs:
            raise RemodelError(f"{path}: not a checked task YAML (--task-dir)")
        cfg = copy.deepcopy(configs[key])
        return resolve_functions(cfg, trust) if trust else cfg

    factory.load_yaml = load
    try:
        yield
    finally:
        factory.load_yaml = saved
