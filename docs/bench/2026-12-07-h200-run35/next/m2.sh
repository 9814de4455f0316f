# 27B nvfp4: head (one-copy graph load, one-kernel sampling, pinned copies) against 4917e90 (pinned copies only) and ef393bc (neither); same candidates, plans tuned once
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.memory --format=csv > $OUT/gpu.txt
export TREE_SECONDS=${TS:-330} TEST_SECONDS=110
export TESTS="tests/test_host_copy.py tests/engine/test_engine_overlap.py tests/kernels/test_sampling.py tests/engine/test_engine_graphs.py tests/kernels/test_linear.py"
export TESTS_K="values_reach or queued or without_waiting or draws or filters or one_kernel or ties or one_copy or static_buffers or capped"
OUT=$OUT/a timeout 590 bash scripts/tree_ab.sh run ${ARMS:-head 4917e90 ef393bc head}
cat $OUT/gpu.txt; grep -v prefill $OUT/a/stages.txt; tail -3 $OUT/a/tests.txt 2>/dev/null
