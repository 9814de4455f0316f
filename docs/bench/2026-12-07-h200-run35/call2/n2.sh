# 27B nvfp4: 06b5580 (before the deferred norms) against head, plans seeded (run 33/34)
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.memory --format=csv > $OUT/gpu.txt
export TREE_SECONDS=${TS:-240}
OUT=$OUT/a timeout 590 bash scripts/tree_ab.sh run ${ARMS:-06b5580 head 06b5580 head}
cat $OUT/gpu.txt; grep -v prefill $OUT/a/stages.txt
