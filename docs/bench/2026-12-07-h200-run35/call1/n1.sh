# 27B groupwise-int: head (four-group tiles, tunes afresh) against 0d1a71c (plans seeded from run 34)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.memory --format=csv > $OUT/gpu.txt
export WEIGHTS=groupwise-int TAG=int TEST_SECONDS=100 TREE_SECONDS=${TS:-420}
export TESTS="tests/kernels/test_linear.py"
export TESTS_K="every_tuned or candidate_splits or capped or row_major or mlp_block or gate_up"
OUT=$OUT/a timeout 590 bash scripts/tree_ab.sh run ${ARMS:-head 0d1a71c head}
cat $OUT/gpu.txt; grep -v prefill $OUT/a/stages.txt
