# 27B nvfp4: head (pinned per-step copies + capped nvfp4 candidates) against ef393bc (capped only) and 3f83df5 (neither; plans seeded)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.memory --format=csv > $OUT/gpu.txt
export TREE_SECONDS=${TS:-330} TEST_SECONDS=100
export TESTS="tests/test_host_copy.py tests/engine/test_engine_overlap.py tests/kernels/test_linear.py"
export TESTS_K="values_reach or queued or without_waiting or capped or every_tuned"
OUT=$OUT/a timeout 590 bash scripts/tree_ab.sh run ${ARMS:-head ef393bc 3f83df5 head ef393bc 3f83df5}
cat $OUT/gpu.txt; grep -v prefill $OUT/a/stages.txt; tail -3 $OUT/a/tests.txt 2>/dev/null
