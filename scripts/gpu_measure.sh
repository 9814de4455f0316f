#!/usr/bin/env bash
# End-to-end measurements on the GPU machine (device tool, carry [".whl"]), one call:
#   bash scripts/gpu_measure.sh STAGE...   (STAGE+STAGE+...: run side by side; STAGE@MODE;
#   STAGE.N runs a stage again with its own log and engine output, as in eng27q eng27masked eng27q.2)
# Each stage runs under its own time limit and logs to $OUT/<stage>.log; $OUT/stages.txt lists
# every stage with its exit status and seconds, so a cut-off run still returns what finished.
# Random-init artifacts of the real profiles are built on the machine (into $ART), never carried.
# The device returns only a few files per call, so everything is also packed into $OUT/results.tgz.
# Before a call, compile a changed kernel's specializations for sm_90 on the CPU
# (scripts/hopper_compile.py over its tests, e.g. tests/kernels/test_linear.py -k every_m):
# the interpreter accepts code Triton's compiler refuses (a call was lost to one, run 23).
set -uo pipefail
source scripts/device_env.sh
returned=$out
out=$(mktemp -d)
trap 'exit 143' TERM INT
trap 'tar czf "$returned/results.tgz" -C "$out" . && cp "$out/stages.txt" "$returned/" 2>/dev/null' EXIT
ART=${ART:-/tmp/artifacts}
mkdir -p "$ART"
CTX=${CTX:-8192}
TOKENS=${TOKENS:-64}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt"
# the card's clock and power limits: two H100s of the same name decoded 7% apart (runs 23, 24)
nvidia-smi --query-gpu=clocks.max.sm,clocks.max.memory,clocks.applications.graphics,power.limit \
  --format=csv >> "$out/gpu.txt" 2>&1 || true
echo "${NINFER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" >> "$out/gpu.txt"

build() {  # build SECONDS PROFILE WEIGHTS: with MTP, a random DFlash draft and a draft head
  timeout "$1" python3 -m ninfer_convert.cli build "$2" --random-init --weights "$3" \
    --no-vision --dflash random --lm-head-draft --device cuda -o "$ART/$2_$3.ninfer"
}
# the engine's serving defaults (a lone 8K prompt in one step); ninfer-bench keeps 1,024-token chunks
ONE_STEP="--prefill-chunk 8192 --max-batched-tokens 8192"
engine() {  # engine SECONDS ARTIFACT-STEM [ninfer-bench engine flags]; reports to $out or --output
  local limit=$1 a=$2 flag prev= output=$out flags=(); shift 2
  for flag in "$@"; do
    if [[ $prev == --output ]]; then output=$flag; elif [[ $flag != --output ]]; then flags+=("$flag"); fi
    prev=$flag
  done
  # a stage run again (STAGE.N) writes beside its output, not over it
  timeout "$limit" python3 -m ninfer_bench.cli engine "$ART/$a.ninfer" \
    --context-lengths "$CTX" --decode-tokens "$TOKENS" --output "$output${again:+/again$again}" \
    "${flags[@]}"
}
cold() {  # cold OUTPUT: a 27B engine start on empty caches (Triton's, the decode plans)
  TRITON_CACHE_DIR=$(mktemp -d) NINFER_HOME=$(mktemp -d) engine 420 qwen3_6_27b_nvfp4 \
    --concurrency 1 --no-breakdown --output "$1"
}
context() {  # context NAME ARTIFACT-STEM: the NIAH context suite (MODE, default mtp0)
  timeout "${SUITE_SECONDS:-240}" python3 -m ninfer_bench.cli context --serve "python3 -m ninfer_serve.cli" \
    --artifact "$1=$ART/$2.ninfer" --mode "${MODE:-mtp0}" --context-lengths "${CTX_LIST:-8192,65536}" \
    --seeds 1 --max-tokens 128 --max-context "${MAX_CONTEXT:-70000}" \
    --output "$out/context-$1-${MODE:-mtp0}"
}
saturation() {  # saturation NAME ARTIFACT-STEM: decode saturation at C = $SAT_C (default 1 8)
  timeout "${SUITE_SECONDS:-240}" python3 -m ninfer_bench.cli concurrency --suite decode-saturation \
    --serve "python3 -m ninfer_serve.cli" --artifact "$1=$ART/$2.ninfer" --mode "${MODE:-mtp0}" \
    $(printf -- '--concurrency %s ' ${SAT_C:-1 8}) --decode-tokens 512 \
    --output "$out/saturation-$1-${MODE:-mtp0}"
}

run_stage() {  # STAGE@MODE runs a suite stage in that speculative mode (ctx27@mtp3)
  local name=${1%@*} again=
  [[ $1 == *@* ]] && local MODE=${1#*@}
  [[ $name == *.* ]] && again=${name#*.} && name=${name%%.*}
  case $name in
    tests) timeout -s INT -k 20 "${TEST_SECONDS:-300}" python3 -u -m pytest -v -p no:cacheprovider -rf \
             --tb=short -k "${TEST_K:-}" ${TESTS:-tests/kernels/test_linear.py tests/kernels/test_moe.py \
             tests/kernels/test_quant_decode.py tests/kernels/test_attention.py \
             tests/kernels/test_gdn_kernels.py tests/kernels/test_skinny_linear.py \
             tests/engine/test_engine_graphs.py \
             tests/engine/test_engine_kernels.py} ;;
    build27) build 420 qwen3_6_27b nvfp4 ;;
    build27int) build 420 qwen3_6_27b groupwise-int ;;
    build35) build 420 qwen3_6_35b_a3b nvfp4 ;;
    eng27) engine 240 qwen3_6_27b_nvfp4 --concurrency 1,8 ;;
    eng27c1) engine 240 qwen3_6_27b_nvfp4 --concurrency 1 ;;
    eng27q) engine 420 qwen3_6_27b_nvfp4 --concurrency 1 --no-breakdown ;;
    eng27int) engine 150 qwen3_6_27b_groupwise-int --concurrency 1 --no-breakdown ;;
    # without PDL, with the kernel breakdown: a PDL kernel's profiled time can include its wait
    # for the kernel before it, so the breakdowns of the runs with PDL may overstate the waiters
    eng27nopdl) NINFER_PDL=0 engine 240 qwen3_6_27b_nvfp4 --concurrency 1 --output "$out/nopdl" ;;
    eng35nopdl) NINFER_PDL=0 engine 240 qwen3_6_35b_a3b_nvfp4 --concurrency 1 --output "$out/nopdl" ;;
    eng27sync) engine 150 qwen3_6_27b_nvfp4 --concurrency 1,8 --no-breakdown --no-overlap-decode \
                 --output "$out/sync" ;;
    eng35sync) engine 300 qwen3_6_35b_a3b_nvfp4 --concurrency 1,8 --no-breakdown \
                 --no-overlap-decode --output "$out/sync" ;;
    eng27pf) NINFER_L2_PREFETCH=1 engine 150 qwen3_6_27b_nvfp4 --concurrency 1 --no-breakdown \
               --output "$out/pf" ;;
    eng35pf) NINFER_L2_PREFETCH=1 engine 240 qwen3_6_35b_a3b_nvfp4 --concurrency 1,8 \
               --no-breakdown --output "$out/pf" ;;
    mtp27) engine 150 qwen3_6_27b_nvfp4 --concurrency 1 --no-breakdown \
             --spec mtp --draft-tokens 3 --lm-head-draft ;;
    dflash27) engine 150 qwen3_6_27b_nvfp4 --concurrency 1 --no-breakdown \
                --spec dflash --draft-tokens 7 --lm-head-draft ;;
    eng35) engine 300 qwen3_6_35b_a3b_nvfp4 --concurrency 1,8 ;;  # a fresh start-up takes >200 s
    eng35q) engine 420 qwen3_6_35b_a3b_nvfp4 --concurrency 1 --no-breakdown ;;
    eng35eager) engine 300 qwen3_6_35b_a3b_nvfp4 --concurrency 1 --no-prompt-graphs \
                  --output "$out/eager-prompts" ;;
    eng27eager) engine 240 qwen3_6_27b_nvfp4 --concurrency 1 --no-breakdown --no-prompt-graphs \
                  --output "$out/eager-prompts" ;;
    eng27one) engine 300 qwen3_6_27b_nvfp4 --concurrency 1 $ONE_STEP --output "$out/one-step" ;;
    # the one-step prefill without the fresh-prompt attention path (ops.attention), the A/B
    eng27nofresh) NINFER_FRESH_PROMPT=0 engine 240 qwen3_6_27b_nvfp4 --concurrency 1 $ONE_STEP \
                    --no-breakdown --output "$out/no-fresh" ;;
    eng35nofresh) NINFER_FRESH_PROMPT=0 engine 300 qwen3_6_35b_a3b_nvfp4 --concurrency 1 \
                    $ONE_STEP --no-breakdown --output "$out/no-fresh" ;;
    eng35one) engine 420 qwen3_6_35b_a3b_nvfp4 --concurrency 1,8 $ONE_STEP --output "$out/one-step" ;;
    # the one-step prefill with our GDN prompt kernels where fla-core's are the default (ops.gdn)
    eng27ours) NINFER_GDN_PROMPT=ninfer engine 240 qwen3_6_27b_nvfp4 --concurrency 1 $ONE_STEP \
                 --no-breakdown --output "$out/ours" ;;
    eng35ours) NINFER_GDN_PROMPT=ninfer engine 300 qwen3_6_35b_a3b_nvfp4 --concurrency 1 \
                 $ONE_STEP --no-breakdown --output "$out/ours" ;;
    # the decode GEMV with its row masks kept (NINFER_DECODE_EVEN_N=0), the A/B of EVEN_N
    eng27masked) NINFER_DECODE_EVEN_N=0 engine 180 qwen3_6_27b_nvfp4 --concurrency 1 \
                   --no-breakdown --output "$out/masked" ;;
    eng35masked) NINFER_DECODE_EVEN_N=0 engine 240 qwen3_6_35b_a3b_nvfp4 --concurrency 1,8 \
                   --no-breakdown --output "$out/masked" ;;
    # a 27B start that tunes its decode plans afresh (Triton's cache kept): run it again
    # (eng27retune.2) to see whether the tuner picks the same plans and decode speed
    eng27retune) NINFER_HOME=$(mktemp -d) engine 300 qwen3_6_27b_nvfp4 --concurrency 1 \
                   --no-breakdown --output "$out/retune" ;;
    # the same without the tuner's wave-split candidates (NINFER_DECODE_WAVE_SPLIT=0), its A/B
    eng27nowave) NINFER_DECODE_WAVE_SPLIT=0 NINFER_HOME=$(mktemp -d) engine 300 qwen3_6_27b_nvfp4 \
                   --concurrency 1 --no-breakdown --output "$out/nowave" ;;
    eng35nowave) NINFER_DECODE_WAVE_SPLIT=0 engine 300 qwen3_6_35b_a3b_nvfp4 --concurrency 1,8 \
                   --no-breakdown --output "$out/nowave" ;;
    # a dense MLP's two decode GEMVs as two launches (NINFER_MLP_BLOCK=0), the block's A/B
    eng27twolaunch) NINFER_MLP_BLOCK=0 engine 300 qwen3_6_27b_nvfp4 --concurrency 1 \
                    --no-breakdown --output "$out/two-launch" ;;
    # the 27B with the decode plans tprobe found fastest streaming (run tprobe first)
    eng27best) NINFER_HOME=$ART/best-home engine 300 qwen3_6_27b_nvfp4 --concurrency 1 \
                 --no-breakdown --output "$out/best" ;;
    # the cost of compiling, with the tuners' candidates compiled side by side and one at a time
    cold27) cold "$out/cold" ;;
    cold27serial) NINFER_COMPILE_WORKERS=1 cold "$out/cold-serial" ;;
    mtp35) engine 150 qwen3_6_35b_a3b_nvfp4 --concurrency 1 --no-breakdown \
             --spec mtp --draft-tokens 3 --lm-head-draft ;;
    dflash35) engine 150 qwen3_6_35b_a3b_nvfp4 --concurrency 1 --no-breakdown \
                --spec dflash --draft-tokens 7 --lm-head-draft ;;
    ctx27) context 27b qwen3_6_27b_nvfp4 ;;
    ctx35) context 35b qwen3_6_35b_a3b_nvfp4 ;;
    # one 27B request at the 256K context: the memory plan's promise, end to end
    ctx27long) CTX_LIST=262144 MAX_CONTEXT=262144 SUITE_SECONDS=${SUITE_SECONDS:-540} \
                 context 27b-256k qwen3_6_27b_nvfp4 ;;
    sat27) saturation 27b qwen3_6_27b_nvfp4 ;;
    sat35) saturation 35b qwen3_6_35b_a3b_nvfp4 ;;
    hf27) timeout 200 python3 scripts/hf_baseline.py qwen3_6_27b --context "$CTX" --tokens 32 ;;
    hf35) timeout 200 python3 scripts/hf_baseline.py qwen3_6_35b_a3b --context "$CTX" --tokens 32 ;;
    splits) timeout 200 python3 scripts/split_sweep.py ${SPLIT_ARGS:-} ;;
    stream) timeout 240 python3 scripts/stream_probe.py ${STREAM_ARGS:-} ;;
    gdnprobe) timeout 240 python3 scripts/gdn_probe.py ${GDN_ARGS:-} ;;
    kattn) timeout 360 python3 -m ninfer_bench.cli kernels --only attention --output "$out/kernels-attn" ;;
    kmoe) timeout 420 python3 -m ninfer_bench.cli kernels --only moe --output "$out/kernels-moe" ;;
    klin27) NINFER_BENCH_MODELS=27B NINFER_BENCH_SCHEMES=nvfp4 timeout 300 python3 -m ninfer_bench.cli \
              kernels --only linear --output "$out/kernels-linear" ;;
    dprobe) timeout 420 python3 scripts/decode_probe.py ${DPROBE_ARGS:-} ;;
    # the decode tuner's picks against the fastest plan, over rounds (scripts/tuner_probe.py)
    # (its streaming-fastest plans kept in $ART/best-home for eng27best)
    tprobe) timeout 300 python3 scripts/tuner_probe.py --home "$ART/best-home" ${TPROBE_ARGS:-} ;;
    # a short GEMV's fixed and per-K-tile costs, its activation pass and K-parts' sum apart
    anatomy) timeout 200 python3 scripts/gemv_anatomy.py ${ANATOMY_ARGS:-} ;;
    boundary) timeout 200 python3 scripts/boundary_probe.py ${BOUNDARY_ARGS:-} ;;
    ncu) timeout 200 ncu --clock-control none --kernel-name regex:_decode_kernel \
           --section WarpStateStats --section SchedulerStats --section Occupancy \
           --section MemoryWorkloadAnalysis python3 scripts/ncu_decode.py ;;
    *) echo "unknown stage $name"; return 2 ;;
  esac
}

run_group() {  # run_group a+b+...: the stages run side by side (builds and tests share the wait)
  local stage pids=()
  for stage in ${1//+/ }; do
    ( start=$SECONDS; run_stage "$stage" > "$out/$stage.log" 2>&1; rc=$?
      echo "$stage rc=$rc ${SECONDS}s-total $((SECONDS - start))s" | tee -a "$out/stages.txt"
      tail -25 "$out/$stage.log" ) &
    pids+=($!)
  done
  wait "${pids[@]}"
}

for group in "$@"; do
  run_group "$group"
done
