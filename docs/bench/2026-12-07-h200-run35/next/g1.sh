# GPU tests of the twenty-seventh session's changes: the sampling settings in one copy (16-byte
# rows), the all-greedy constants, the warm-up's unfiltered draws, the counter pools (GEMV, MoE,
# GDN decode, sampler)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.memory --format=csv
source scripts/device_env.sh
timeout -s INT -k 15 ${T:-300} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sampling.py \
  tests/kernels/test_counters.py tests/engine/test_engine_warmup.py tests/kernels/test_gdn_kernels.py \
  tests/kernels/test_skinny_linear.py tests/kernels/test_moe.py \
  -k "sampl or draw or filter or greedy or one_copy or kernel or ties or counter or pool or decode" 2>&1 | tail -25
