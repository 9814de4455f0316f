# 35B-A3B nvfp4 at head with the device's timeline (where the GPU idles between graphed decode steps), then a plain arm
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.memory --format=csv > $OUT/gpu.txt
export PROFILE=qwen3_6_35b_a3b TREE_SECONDS=${TS:-330}
EXTRA=--timeline OUT=$OUT/a timeout 560 bash scripts/tree_ab.sh run head
cat $OUT/gpu.txt; grep -v prefill $OUT/a/stages.txt
tar xzf $OUT/a/tree_ab-*.tgz -O --wildcards './head/*.md' 2>/dev/null | grep -A14 "timeline over"
