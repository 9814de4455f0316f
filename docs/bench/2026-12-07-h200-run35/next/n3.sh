# 35B-A3B nvfp4: head (capped 8-dot candidates for the dense GEMVs) against 3f83df5
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.memory --format=csv > $OUT/gpu.txt
export PROFILE=qwen3_6_35b_a3b TREE_SECONDS=${TS:-360}
OUT=$OUT/a timeout 590 bash scripts/tree_ab.sh run ${ARMS:-head 3f83df5 head 3f83df5}
cat $OUT/gpu.txt; grep -v prefill $OUT/a/stages.txt
