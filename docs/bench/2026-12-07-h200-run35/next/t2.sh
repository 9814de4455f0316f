# the between-replays probe, then t1.sh: the 35B's device timeline at head, A/B against 3da092a
# (before the twenty-eighth session's 9 fewer launches a step) and 65491f4 (before the
# twenty-seventh session's sampling changes too), the twenty-seventh session's GPU tests beside
# the artifact's build
source scripts/device_env.sh > /dev/null
timeout 45 python3 scripts/gap_probe.py
export TESTS="tests/kernels/test_sampling.py tests/kernels/test_counters.py tests/engine/test_engine_warmup.py tests/kernels/test_gdn_kernels.py tests/kernels/test_skinny_linear.py tests/kernels/test_moe.py tests/kernels/test_rope.py tests/engine/test_engine_graphs.py"
export TESTS_K="sampl or draw or filter or greedy or one_copy or kernel or ties or counter or pool or decode or rope"
export TEST_SECONDS=${TEST_SECONDS:-150}
T=${T:-530} ARMS=${ARMS:-head 3da092a 65491f4} bash ab/t1.sh
tar xzf $OUT/a/tree_ab-*.tgz -O ./tests.txt 2>/dev/null | tail -15
