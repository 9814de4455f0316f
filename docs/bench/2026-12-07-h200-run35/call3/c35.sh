nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.memory --format=csv > $OUT/gpu.txt
export PROFILE=qwen3_6_35b_a3b TEST_SECONDS=100
export TESTS="tests/kernels/test_skinny_linear.py tests/kernels/test_moe.py tests/engine/test_engine_kernels.py tests/kernels/test_linear.py"
export TESTS_K="skinny or norm or route or activation_pass or half_steps or dependent"
if grep -q H100 $OUT/gpu.txt; then export TREE_SECONDS=${TS_H100:-240}; else export TREE_SECONDS=${TS_H200:-330}; fi
OUT=$OUT/a timeout 585 bash scripts/tree_ab.sh run ${ARMS:-0c1ad65 head 06b5580 0c1ad65 head}
cat $OUT/gpu.txt; grep -v prefill $OUT/a/stages.txt; tail -5 $OUT/a/tests.txt 2>/dev/null
