#!/bin/bash
# One device call for issue 28's GPU figures (run from the repo root on the device machine, $OUT set).
# Carry: .whl (torchao 0.17, datasets + dill + multiprocess wheels) and .gpusrc (mamba-ssm 2.3.2.post1's
# Python + Triton sources, its __init__ reduced to the version: no compiled selective_scan_cuda there).
# Stages: the arguments (default: all, in this order). Each part has its own time limit and writes under $OUT as it goes, so a cut-off call still returns data.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/remodel
export PYTHONPATH=/tmp/pkg:$PWD/.gpusrc:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee $OUT/device.txt
python3 -c "import torch, transformers, triton, torchao; import torch.nn.functional as F; \
print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, \
'torchao', torchao.__version__, 'F.grouped_mm', hasattr(F, 'grouped_mm'), 'torch._grouped_mm', hasattr(torch, '_grouped_mm'))" \
  2>&1 | grep -v Warning | tee -a $OUT/device.txt
part() { local t=$1 name=$2; shift 2; echo "=== $name (limit ${t}s)"; local s=$SECONDS
  timeout -k 5 "$t" "$@" > >(tee $OUT/$name.log) 2>&1; echo "=== $name rc=$? $((SECONDS - s))s"; }
stages=${*:-tests moe loss legacy nano gap windows}
for st in $stages; do case $st in
  tests) part 90 tests python3 -m pytest -q -p no:cacheprovider tests/test_moe_grouped.py ;;
  moe) part 60 moe python3 bench/bench_moe.py --tokens 8192 --rounds 5 ;;
  loss) part 60 loss python3 bench/bench_fused_loss.py --device cuda --tokens 8192 --vocab 131072 --hidden 4096 --teacher-hidden 4096 --reps 2 ;;
  legacy) part 130 legacy python3 bench/bench_gpu.py --parts parity legacy --reps 3 --cmp-lengths 1024 4096 --json $OUT/gpu_h200_legacy.json ;;
  nano) part 80 nano python3 bench/bench_gpu.py --parts windows --windows nano_moe_window --reps 3 --json $OUT/gpu_h200_nano.json ;;
  gap) part 150 gap python3 bench/bench_gpu.py --parts gap --gap-steps 200 --json $OUT/gpu_h200_gap.json ;;
  windows) part 190 windows python3 bench/bench_gpu.py --parts windows --windows nemotron_h_8b_window --reps 3 --json $OUT/gpu_h200_windows.json ;;
esac; done
