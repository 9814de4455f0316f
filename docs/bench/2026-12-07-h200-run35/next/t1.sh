# 35B-A3B nvfp4 with the device timeline (where the GPU idles between graphed decode steps): head, then 65491f4 (before the all-greedy constants)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.memory --format=csv > $OUT/gpu.txt
export PROFILE=qwen3_6_35b_a3b TREE_SECONDS=${TS:-330}
EXTRA=--timeline OUT=$OUT/a timeout ${T:-560} bash scripts/tree_ab.sh run ${ARMS:-head 65491f4}
cat $OUT/gpu.txt; grep -v prefill $OUT/a/stages.txt
tar xzf $OUT/a/tree_ab-*.tgz -O --wildcards './*/*.md' 2>/dev/null | grep -A14 "timeline over"
