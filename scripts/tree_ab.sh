#!/usr/bin/env bash
# The engine's decode at several source trees on one GPU machine, the decode plans tuned once:
# an A/B in the engine itself, where a kernel probe can mislead (docs/perf.md, eleventh run:
# a change that won 0.7-1.5 us a call in scripts/decode_probe.py cost the 27B step 1.5 ms).
#
#   here:   bash scripts/tree_ab.sh export REV...   # git archive REV's packages into ab/REV
#           (or put any tree's packages/ into ab/NAME/ by hand)
#   device: bash scripts/tree_ab.sh run NAME...     # carry [".whl", "ab"]; NAME head = this tree
#
# `run` builds the random-init artifact once (PROFILE, WEIGHTS: default the 27B in nvfp4) and
# runs `ninfer-bench engine` at C = 1, CTX context, without the breakdown, for each tree in
# turn. Every tree shares one NINFER_HOME, so the first tree's tuner picks the decode plans
# and the others reuse them (where their candidate lists are the same): what differs is the
# code. Each tree's prefill and decode rows go to $OUT/stages.txt, its log, its report (NAME/)
# and the tuned plans (tuning/) into the run's archive in $OUT. EXTRA adds options to every
# tree's bench (e.g. EXTRA="--prefill-chunk 8192 --max-batched-tokens 8192"), TAG a suffix to
# its output names (so a second pass over a tree in one call keeps the first's files).
# Plans tuned by an earlier run seed the tuner where ab/tuning/ holds them (a run's archive
# has its tuning/: `tar xzf tree_ab-*.tgz -C ab ./tuning`); a file serves only the GPU model
# and Triton version in its name, and only the plans whose candidates have not changed, so
# the first tree skips the ~2.5 minutes of tuning where they match. TESTS (test files, TESTS_K
# their -k expression, TEST_SECONDS their limit) run on the GPU while the artifact builds
# (~100 s that leave the GPU idle), into tests.txt.
set -uo pipefail
cmd=${1:-}; shift || true
case $cmd in
  export)
    for rev in "$@"; do
      rm -rf "ab/$rev" && mkdir -p "ab/$rev" && git archive "$rev" packages | tar x -C "ab/$rev"
    done
    exit ;;
  run) ;;
  *) echo "usage: $0 export REV... | run NAME..." >&2; exit 2 ;;
esac
source scripts/device_env.sh
# the device returns only a few files a call: the logs and reports go into one archive a run
# (tree_ab[-TAG]-PID.tgz), the rows are appended to $OUT/stages.txt
returned=$out
out=$(mktemp -d)
trap 'tar czf "$returned/tree_ab${TAG:+-$TAG}-$$.tgz" -C "$out" . && cat "$out/stages.txt" >> "$returned/stages.txt"' EXIT
artifact=/tmp/artifacts/${PROFILE:=qwen3_6_27b}_${WEIGHTS:=nvfp4}.ninfer
export NINFER_HOME=/tmp/ninfer-ab
mkdir -p /tmp/artifacts "$NINFER_HOME/tuning"
cp -n ab/tuning/*.json "$NINFER_HOME/tuning/" 2>/dev/null
if [ -n "${TESTS:-}" ]; then  # GPU tests beside the build, which leaves the GPU idle
  # SIGINT at the limit: pytest stops and still prints its summary (what passed, what failed)
  # shellcheck disable=SC2086  # TESTS is a list of test files
  timeout -s INT -k 15 "${TEST_SECONDS:-120}" python3 -m pytest -q -p no:cacheprovider $TESTS \
    ${TESTS_K:+-k "$TESTS_K"} > "$out/tests.txt" 2>&1 &
fi
[ -f "$artifact" ] || timeout 420 python3 -m ninfer_convert.cli build "$PROFILE" --random-init \
  --weights "$WEIGHTS" --no-vision --device cuda -o "$artifact" > "$out/build.log" 2>&1
echo "build rc=$? ${SECONDS}s" | tee -a "$out/stages.txt"
if [ -n "${TESTS:-}" ]; then
  wait
  echo "tests: $(tail -1 "$out/tests.txt") ${SECONDS}s" | tee -a "$out/stages.txt"
fi
for name in "$@"; do
  root=$PWD; [ "$name" = head ] || root=$PWD/ab/$name
  s=$SECONDS; tagged=$name${TAG:+-$TAG}
  # shellcheck disable=SC2086  # EXTRA is a list of options
  PYTHONPATH=/tmp/site:$(ls -d "$root"/packages/*/src | paste -sd:) timeout "${TREE_SECONDS:-240}" \
    python3 -m ninfer_bench.cli engine "$artifact" --context-lengths "${CTX:-8192}" \
    --decode-tokens 64 --concurrency 1 --no-breakdown ${EXTRA:-} --output "$out/$tagged" \
    > "$out/$tagged.log" 2>&1
  echo "$tagged rc=$? $((SECONDS - s))s (${SECONDS}s in all)" | tee -a "$out/stages.txt"
  grep -h "^| prefill\|^| decode" "$out/$tagged"/*.md 2>/dev/null | tee -a "$out/stages.txt"
done
# the plans each candidate list's tuner chose (key -> index into decode_candidates; read back
# as configs and K splits by scripts/tuned_plans.py)
cp -r "$NINFER_HOME/tuning" "$out/" 2>/dev/null
