# 35B-A3B nvfp4: head (pinned per-step copies) against ef393bc (capped candidates, pageable copies); same candidates, plans tuned once
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.memory --format=csv > $OUT/gpu.txt
export PROFILE=qwen3_6_35b_a3b TREE_SECONDS=${TS:-360}
OUT=$OUT/a timeout 590 bash scripts/tree_ab.sh run ${ARMS:-ef393bc head ef393bc head}
cat $OUT/gpu.txt; grep -v prefill $OUT/a/stages.txt
