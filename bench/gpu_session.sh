#!/bin/bash
# One device call for issue 42's GPU figures (run from the repo root on the device machine, $OUT set).
# Carry: .whl (fla-core 0.6.0, liger-kernel 0.8.5, torchao 0.17.0, transformers 5.24.0: the version the CPU
# parity tests use; datasets 5.2.0 with dill 0.4.1 and multiprocess 0.70.19: remodel's data module imports it) and .gpusrc (mamba-ssm 2.3.2.post1's Python + Triton sources, its __init__ reduced to
# the version: no compiled selective_scan_cuda / causal-conv1d there, so the conv is fla-core's Triton one).
# Stages: the arguments (default: unrun gdn cuda grouped windows loss profile; the others: gdnmix cudagdn cudarest grouped blocks profile13 profile8b mfu moe gap). Each part has its own time limit and writes into
# /tmp/o as it goes; after each part /tmp/o is packed into $OUT/run.tgz, so a cut-off call still returns data.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
mkdir -p /tmp/pkg /tmp/o && ln -sfn "$PWD" /tmp/pkg/remodel
# Triton's cache stays on the machine: packed into $OUT after each part it was too big to come back (twice,
# 2026-11-27), so packing it only cost device time.
export PYTHONPATH=/tmp/pkg:$PWD/.gpusrc:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TRITON_CACHE_AUTOTUNING=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee /tmp/o/device.txt
python3 -c "import torch, transformers, triton, torchao, fla, liger_kernel; import remodel.models.mamba as m; \
print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, \
'torchao', torchao.__version__, 'kernels', {k: v is not None for k, v in m.gpu_kernels()._asdict().items()})" \
  2>&1 | grep -v Warning | tee -a /tmp/o/device.txt
part() { local t=$1 name=$2; shift 2; echo "=== $name (limit ${t}s)"; local s=$SECONDS
  timeout -k 5 "$t" "$@" > >(tee /tmp/o/$name.log) 2>&1; echo "=== $name rc=$? $((SECONDS - s))s" | tee -a /tmp/o/parts.txt
  tar czf $OUT/run.tgz -C /tmp/o . ; }
# test stages: without .gpusrc (mamba-ssm) on the path; each failure printed as it happens (bench/pytest_instafail.py)
T() { PYTHONPATH=/tmp/pkg:/tmp/site:$PWD/bench "$@"; }
PT="-p no:cacheprovider -p pytest_instafail --continue-on-collection-errors --timeout 100"
stages=${*:-unrun gdn cuda grouped windows loss profile}
for st in $stages; do case $st in
  unrun) T part 300 unrun python3 -m pytest -v -s $PT --timeout 240 tests/test_sdpa_paths.py tests/test_kda.py -k "cuda or gpu"  # written on CPU, never run on a GPU (2026-12-06)
          T part 200 unrun_cuda python3 -m pytest -v $PT tests/test_cuda.py -k "deepseek or glm4_moe_lite or gpt_oss or kimi"
          part 200 unrun_mamba1 python3 -m pytest -v $PT tests/test_mamba1_kernel.py -k gpu ;;  # needs mamba-ssm's selective scan (.gpusrc)
  gdn) T part 300 gdn python3 -m pytest -v -s $PT --timeout 240 tests/test_gdn_kernels.py -k on_gpu ;;  # fla compiles and autotunes on first use: >100 s (2026-11-28)
  gdnmix) T part 240 gdnmix python3 -m pytest -v -s $PT --timeout 220 tests/test_gated_deltanet.py::test_mixer_with_gpu_kernels_equals_pure_path_on_gpu ;;
  cudagdn) T part 180 cudagdn python3 -m pytest -v $PT tests/test_cuda.py -k "qwen3_next or qwen3_5 or olmo or gdn" ;;  # the families no GPU has passed yet
  cudarest) T part 200 cudarest python3 -m pytest -v $PT tests/test_cuda.py -k "not (qwen3_next or qwen3_5 or olmo or gdn)" ;;  # the rest of cuda, after cudagdn
  cuda) T part 240 cuda python3 -m pytest -v $PT tests/test_cuda.py ;;  # no mamba-ssm: transformers would compile its Triton kernels per tiny width (>100 s)
  grouped) T part 60 grouped python3 -m pytest -v $PT tests/test_moe_grouped.py ;;
  profile) part 240 profile python3 bench/gpu_profile.py --windows 8b nano --out-dir /tmp/o --json /tmp/o/gpu_profile.json ;;
  blocks) part 240 blocks python3 bench/gpu_profile.py --windows 8b --sides ours --variants compiled_blocks --shapes --json /tmp/o/gpu_blocks.json ;;
  profile13) part 120 profile13 python3 bench/gpu_profile.py --windows 1p3b --sides ours --variants --shapes --out-dir /tmp/o --json /tmp/o/gpu_profile13.json ;;  # where the 1.3B's MFU goes
  profile8b) part 60 profile python3 bench/gpu_profile.py --windows 8b --sides ours --variants --shapes --out-dir /tmp/o --json /tmp/o/gpu_profile.json ;;
  windows) part 240 windows python3 bench/bench_gpu.py --parts windows --windows nemotron_h_8b_window --reps 3 --json /tmp/o/gpu_windows.json ;;
  mfu) part 90 mfu python3 bench/bench_gpu.py --parts mfu --reps 3 --json /tmp/o/gpu_mfu.json ;;
  moe) part 30 moe python3 bench/bench_moe.py --tokens 8192 --rounds 5 ;;
  loss) part 90 loss python3 bench/bench_fused_loss.py --device cuda --tokens 8192 --vocab 131072 --hidden 4096 --teacher-hidden 4096 --reps 2 --liger --json /tmp/o/gpu_loss.json ;;
  gap) part 150 gap python3 bench/bench_gpu.py --parts gap --gap-steps 200 --gap-seq-len 512 --gap-batch 4 --json /tmp/o/gpu_gap.json ;;
esac; done
python3 bench/gpu_summary.py /tmp/o --out /tmp/o/gpu_summary.json; tar czf $OUT/run.tgz -C /tmp/o .
