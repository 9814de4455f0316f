# the 27B in groupwise-int: 0c1ad65 (row-major scales) against head (group-major), the plans tuned once
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.memory --format=csv > $OUT/gpu.txt
export WEIGHTS=groupwise-int TAG=int TEST_SECONDS=110 TREE_SECONDS=${TS:-280}
export TESTS="tests/kernels/test_linear.py tests/kernels/test_skinny_linear.py"
export TESTS_K="row_major or group_major or every_tuned or mlp_block or gate_up or bad_layout or decode_every_m"
OUT=$OUT/a timeout 590 bash scripts/tree_ab.sh run ${ARMS:-0c1ad65 head 0c1ad65 head}
cat $OUT/gpu.txt; grep -v prefill $OUT/a/stages.txt
