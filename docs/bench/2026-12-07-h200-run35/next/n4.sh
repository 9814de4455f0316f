# 35B-A3B groupwise-int at head (never timed: the MoE int expert stages with two-group tiles)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.memory --format=csv > $OUT/gpu.txt
export PROFILE=qwen3_6_35b_a3b WEIGHTS=groupwise-int TAG=int TREE_SECONDS=${TS:-330}
OUT=$OUT/a timeout 590 bash scripts/tree_ab.sh run ${ARMS:-head head}
cat $OUT/gpu.txt; grep -v prefill $OUT/a/stages.txt
