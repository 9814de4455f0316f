# 27B groupwise-int: head (the capped one-group candidate too) against 3f83df5
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.memory --format=csv > $OUT/gpu.txt
export WEIGHTS=groupwise-int TAG=int TREE_SECONDS=${TS:-420}
OUT=$OUT/a timeout 590 bash scripts/tree_ab.sh run ${ARMS:-head 3f83df5 head}
cat $OUT/gpu.txt; grep -v prefill $OUT/a/stages.txt
