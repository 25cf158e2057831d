"""`remodel inspect`: what a checkpoint or config is, and exactly how big, without loading weights.

Accepts a checkpoint directory, a directory with only config.json, a config.json path, a shipped
config name (models/configs/*.json, e.g. 'nemotron-h-56b'), an HF config dict or a ModelConfig.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from remodel.models.checkpoint import CheckpointReader
from remodel.models.files import read_json
from remodel.models.config import ModelConfig
from remodel.models.errors import RemodelError
from remodel.models.kinds import count, used
from remodel.models.hf import config_from_hf, default_family
from remodel.models.load import shape_mismatches
from remodel.models.params import count_params, memory_bytes

CONFIGS = Path(__file__).resolve().parents[2] / "models" / "configs"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


def resolve_source(src) -> tuple[ModelConfig, dict | None, Path | None, str]:
    """-> (cfg, HF config dict or None, checkpoint dir with weights or None, description)."""
    if isinstance(src, ModelConfig):
        return src, None, None, "ModelConfig"
    if isinstance(src, dict):
        return config_from_hf(src), src, None, "config dict"
    p = Path(src)
    if not p.exists():
        name = str(src)[:-5] if str(src).endswith(".json") else str(src)
        if "/" not in name and (CONFIGS / f"{name}.json").is_file():
            p = CONFIGS / f"{name}.json"
        else:
            raise RemodelError(f"{src}: no such checkpoint directory, config.json or shipped config "
                               f"(shipped: {', '.join(shipped_configs())})")
    d = read_json(p / "config.json" if p.is_dir() else p)
    ckpt = p if p.is_dir() and any((p / f).is_file() for f in WEIGHT_FILES) else None
    if ckpt is not None and d.get("num_nextn_predict_layers"):
        with CheckpointReader(ckpt) as r:
            d = r.config  # MTP only when the weights have it
    cfg = config_from_hf(d)
    return cfg, d, ckpt, str(p)


def stored_bytes(ckpt) -> int | None:
    """The bytes checkpoint `ckpt`'s files store for its tensors (an FP8 one: float8 data and float32 block
    scales), None without weights (a config)."""
    if ckpt is None:
        return None
    with CheckpointReader(ckpt) as r:
        return r.total_bytes()


def _widths(cfg: ModelConfig) -> dict:
    """The model-wide widths, then what each kind present shows (its spec's summary)."""
    w = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers,
         "tie_word_embeddings": cfg.tie_word_embeddings}
    for k in used(cfg, mtp=False):
        w.update(k.summary(cfg.view(k)))  # each kind shows its own sections
    if cfg.mtp_layers:
        w.update(mtp_layers=cfg.mtp_layers, mtp_pattern=cfg.mtp_pattern)
    return w


def _weights(path: Path, cfg: ModelConfig) -> dict:
    with CheckpointReader(path) as r:
        bad = shape_mismatches(r, cfg)
        dtypes, numel = Counter(), 0
        for k in r.keys():
            for dt, nbytes in r.stored(k):  # as the files hold it (an FP8 weight: float8 data, float32 scales)
                dtypes[str(dt).replace("torch.", "")] += nbytes
            n = 1
            for s in r.shape(k):
                n *= s
            numel += n
        files = [f for f in path.iterdir() if f.suffix == ".safetensors"]
        return {"tensors": len(r), "tensor_numel": numel, "tensor_bytes": r.total_bytes(),
                "file_bytes": sum(f.stat().st_size for f in files), "files": len(files),
                "dtype_bytes": dict(dtypes.most_common()), "config_mismatches": bad}


def inspect(src, batch: int = 1, seq_len: int = 4096) -> dict:
    """Architecture, widths, exact parameter counts and bf16 memory of a checkpoint or config."""
    cfg, d, ckpt, where = resolve_source(src)
    family = (d or {}).get("model_type") or default_family(cfg)
    counts = count_params(cfg, family=family, by_axis=True)
    out = {
        "source": where,
        "family": family,
        "architecture": _architecture(d),
        "pattern": cfg.pattern,
        "layers": {k.name: count(cfg, k) for k in used(cfg, mtp=False)},
        "widths": _widths(cfg),
        "params": counts,
        "memory_bf16": memory_bytes(cfg, dtype_bytes=2, batch=batch, seq_len=seq_len),
        "checkpoint": _weights(ckpt, cfg) if ckpt is not None else None,
    }
    return out


def fmt_count(x: int) -> str:
    """1234567 -> '1.235M' (B, M, K with 3 decimals; plain below 1000)."""
    for unit, s in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= unit:
            return f"{x / unit:.3f}{s}"
    return str(x)


def fmt_bytes(x: int) -> str:
    """Bytes in binary units (GiB, MiB, KiB): the one unit convention of inspect, plan and the reports."""
    for unit, s in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if x >= unit:
            return f"{x / unit:.2f} {s}"
    return f"{x} B"


def _format_mtp(mtp: dict, row) -> None:
    """The MTP head, apart from the trunk's total (transformers does not build it)."""
    if not mtp.get("total"):
        return
    row(f"MTP head ({mtp['layers']} x {mtp['pattern']!r}, not in total)", f"{mtp['total']:,} ({fmt_count(mtp['total'])})")
    if mtp["routed"]:
        row("  MTP active per token", f"{mtp['active']:,}")
    for t, n in mtp["by_type"].items():
        row(f"  MTP {t}", f"{n:>16,}")
    row("trunk + MTP (the checkpoint)", f"{mtp['with_trunk']:,} ({fmt_count(mtp['with_trunk'])})")


def format_inspect(d: dict) -> str:
    """A readable report of `inspect`'s dict."""
    p, m, lines = d["params"], d["memory_bf16"], []

    def row(k, v, w=36):
        lines.append(f"  {k:<{w}} {v}")

    lines.append(f"{d['source']}: {d['family']}" + (f" ({d['architecture']})" if d["architecture"] else ""))
    pat = d["pattern"] if len(d["pattern"]) <= 96 else d["pattern"][:93] + "..."
    row("pattern", pat)
    row("layers", f"{len(d['pattern'])} = " + ", ".join(f"{n} {t}" for t, n in d["layers"].items()))
    lines.append("widths")
    for k, v in d["widths"].items():
        row(k, v)
    lines.append("parameters")
    row("total", f"{p['total']:,} ({fmt_count(p['total'])})")
    if p["routed"]:
        row("active per token", f"{p['active']:,} ({fmt_count(p['active'])})")
    if p.get("passthrough"):
        row("tower (passed through)", f"{p['passthrough']:,} ({fmt_count(p['passthrough'])})")
    if p["hf_total"] != p["total"]:
        row(f"as exported to {p['family']}" + (" (with the tower)" if p.get("passthrough") else ""),
            f"{p['hf_total']:,}")
    if p["buffers"]:
        row("buffers (router bias, fp32)", f"{p['buffers']:,}")
    for t, n in p["by_type"].items():
        if n:
            row(f"  {t}", f"{n:>16,}  {100 * n / p['total']:5.1f}%")
    for t, n in p["per_layer"].items():
        row(f"  one {t} layer", f"{n:>16,}")
    _format_mtp(p.get("mtp") or {}, row)
    lines.append(f"  {'axis':<18} {'size':>8} {'params using it':>18} {'freed per unit':>16}")
    for a, v in p["by_axis"].items():
        lines.append(f"  {a:<18} {v['size']:>8} {v['params']:>18,} {v['per_unit']:>16,}")
    lines.append(f"memory at bf16 (batch {m['batch']}, {m['seq_len']} tokens)")
    row("weights", fmt_bytes(m["weights"]))
    if m.get("mtp_weights"):
        row("MTP head weights (not in total)", fmt_bytes(m["mtp_weights"]))
    for name, b in m["state_rows"].items():  # each kind's own row; with weights they add up to total
        row(name, fmt_bytes(b))
    row("total", fmt_bytes(m["total"]))
    c = d["checkpoint"]
    if c:
        lines.append("checkpoint")
        row("files", f"{c['files']} safetensors, {fmt_bytes(c['file_bytes'])} on disk")
        row("tensors", f"{c['tensors']:,} ({c['tensor_numel']:,} elements)")
        row("dtypes", ", ".join(f"{k} {fmt_bytes(v)}" for k, v in c["dtype_bytes"].items()))
        for m in c.get("config_mismatches", [])[:20]:
            row("DISAGREES WITH CONFIG", m)
    return "\n".join(lines)


def _architecture(d) -> str | None:
    """config.json's first architecture name, when it holds a list of names (anything else: None)."""
    a = (d or {}).get("architectures")
    return a[0] if isinstance(a, list) and a and isinstance(a[0], str) else None
