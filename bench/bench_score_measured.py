"""What the default criterion's measured key-head groups cost (issue 55): `remodel score` on a Qwen3.5-shaped
model with `--method activation_measured` (the default) vs `--method activation`, whole and layer-streamed.

Each run is `pipelines.commands.score.score` in a fresh subprocess (so each peak RSS, VmHWM, is its own); the
same calibration tokens, 4 loss batches; the ratio measured / activation is taken between runs of this process,
alternated rep by rep (the CPU is shared). The model: 8 layers (6 Gated DeltaNet + 2 attention), 16 key x 32 value
heads (the released models' key-head count), random weights.

    python bench/bench_score_measured.py [--samples 64 --seq-len 256 --batch 4 --reps 2 --hidden 256] [--write]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

from remodel.models.hf import config_from_hf  # noqa: E402
from remodel.models.load import save_model  # noqa: E402
from remodel.models.model import HybridLM, init_weights  # noqa: E402
from remodel.pipelines.data.data import embedded_corpus, embedded_tokenizer_path  # noqa: E402
from tests.rss import PEAK_RSS  # noqa: E402

JSON = ROOT / "bench" / "score_measured.json"
RUN = PEAK_RSS + '''
import json, sys, time, torch
torch.set_num_threads(1)
from remodel.pipelines.commands.score import score
model, data, out, method, mode, samples, seq_len, batch = sys.argv[1:9]
base = reset_peak()
t = time.time()
rep = score(model, data, out, method=method, mode=mode, samples=int(samples), seq_len=int(seq_len), batch=int(batch),
            progress=False, loss_increase=False)
print(json.dumps({"seconds": time.time() - t, "peak_rss": status("VmHWM"), "base_rss": base,
                  "spilled_bytes": rep["spilled_bytes"], "tokens": rep["tokens"]}))
'''


def model_dir(root: Path, hidden: int) -> Path:
    hf = dict(model_type="qwen3_5_text", vocab_size=2048, hidden_size=hidden, intermediate_size=4 * hidden,
              num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)
    d = root / "model"
    save_model(init_weights(HybridLM(config_from_hf(hf)), std=0.02, seed=0), d, family="qwen3_5_text",
               aux_from=embedded_tokenizer_path())
    return d


def run(model, data, out, method, mode, a) -> dict:
    cmd = [sys.executable, "-c", RUN, str(model), str(data), str(out), method, mode, str(a.samples), str(a.seq_len),
           str(a.batch)]
    env = {"PYTHONPATH": str(ROOT.parent), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--samples", type=int, default=64, help="calibration sequences")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2, help="runs of each method and mode (the best is kept)")
    ap.add_argument("--write", action="store_true", help=f"write {JSON.relative_to(ROOT)}")
    a = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, data = model_dir(tmp, a.hidden), embedded_corpus()[0]
        for mode in ("whole", "streaming"):
            for r in range(a.reps):
                for method in ("activation", "activation_measured"):
                    got = run(model, data, tmp / f"{mode}-{method}-{r}", method, mode, a)
                    best = rows.setdefault(mode, {}).get(method)
                    if best is None or got["seconds"] < best["seconds"]:
                        rows[mode][method] = got
                    print(mode, method, r, json.dumps(got), flush=True)
    for mode, m in rows.items():
        a_, b_ = m["activation"], m["activation_measured"]
        m["ratio_seconds"] = b_["seconds"] / a_["seconds"]
        m["extra_peak_rss_mib"] = (b_["peak_rss"] - a_["peak_rss"]) / 2**20
        print(f"{mode}: activation {a_['seconds']:.1f} s, {a_['peak_rss'] / 2**20:.0f} MiB; measured "
              f"{b_['seconds']:.1f} s ({m['ratio_seconds']:.2f}x), {b_['peak_rss'] / 2**20:.0f} MiB "
              f"({m['extra_peak_rss_mib']:+.0f}); spilled {b_['spilled_bytes'] / 2**20:.0f} MiB")
    res = {"rows": rows, "settings": vars(a), "date": str(datetime.date.today()),
           "machine": f"{platform.machine()}, torch {torch.__version__}, 1 thread per run"}
    if a.write:
        JSON.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
