# 27B nvfp4: 3f83df5 (plans seeded, runs 34/35) against head (the capped 8-dot candidates: head tunes nvfp4 afresh)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.memory --format=csv > $OUT/gpu.txt
export TREE_SECONDS=${TS:-330} TEST_SECONDS=100
export TESTS="tests/kernels/test_linear.py"
export TESTS_K="capped or every_tuned"
OUT=$OUT/a timeout 590 bash scripts/tree_ab.sh run ${ARMS:-head 3f83df5 head 3f83df5}
cat $OUT/gpu.txt; grep -v prefill $OUT/a/stages.txt
