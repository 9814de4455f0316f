# 27B groupwise-int: head (pinned copies; the capped one-group candidate) against ef393bc (same candidates, pageable copies) and 3f83df5 (neither; its H200 int plans seeded by run 35, its H100 ones not: on an H100 the last arm may not fit)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.memory --format=csv > $OUT/gpu.txt
export WEIGHTS=groupwise-int TAG=int TREE_SECONDS=${TS:-420}
OUT=$OUT/a timeout 590 bash scripts/tree_ab.sh run ${ARMS:-head ef393bc 3f83df5 head}
cat $OUT/gpu.txt; grep -v prefill $OUT/a/stages.txt
