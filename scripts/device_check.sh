#!/usr/bin/env bash
# One GPU-machine session in one command (see ../shared/device/README.md): install the carried
# wheels, run the tests on CUDA, run the kernel benchmarks; results land in $OUT.
# Usage (device tool, carry [".whl"]): bash scripts/device_check.sh [pytest paths...]
set -uo pipefail
source scripts/device_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$out/gpu.txt"
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/kernels tests/engine/test_engine_kernels.py tests/test_quant.py)
timeout ${TEST_SECONDS:-200} python3 -m pytest -q -p no:cacheprovider "${tests[@]}" 2>&1 | tail -40 \
  | tee "$out/gpu_tests.txt"
timeout ${BENCH_SECONDS:-360} python3 -m ninfer_bench.cli kernels --output "$out" 2>&1 | tail -60 \
  | tee "$out/bench_log.txt"
