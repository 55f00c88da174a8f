#!/usr/bin/env bash
# The first run on a GPU machine, sized for a 15-minute window on one H100 or H200: about 8 minutes, the most
# important numbers first, so that a run cut off still leaves them (docs/gpu.md):
#   a. the device's ceilings at the configs' shapes (matmul, memory copy, flash attention; tools/gpu_probe.py)
#   b. bench.py gpt2_125m bf16, compile on, then off     c. bench.py tr3_1b3_1gpu bf16
#   d. the compiled bf16 loss against fp32               e. the host syncs of one training step
#   f. the cuda-marked tests, with what is left of the 8 minutes (at least 3)
#   g. one verdict line: the MFU targets on one GPU (gpt2_125m >= 40%, tr3_1b3_1gpu bf16 >= 50%) and every failure
# Each step has its own timeout and log; a failed step is recorded and the next one runs.
#   bash tools/gpu_check.sh [LOGDIR]          # on the GPU machine; logs in LOGDIR (out/gpu_check)
#   bash tools/gpu_check.sh --cpu [LOGDIR]    # the same steps at tiny shapes on the CPU: a smoke test of the script
set -uo pipefail  # no -e: a failing step must not end the run, its exit code is recorded instead
cd "$(dirname "$0")/.."

CPU=0
if [ "${1:-}" = "--cpu" ]; then CPU=1; shift; fi
LOG=${1:-out/gpu_check}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1  # a step killed by its timeout still leaves what it printed in its log
TARGET_SMALL=40 TARGET_LARGE=50  # MFU targets on one GPU, %
BUDGET=480                       # seconds for the whole check; the tests get what is left, at least 180
DEADLINE=540                     # no step before the tests starts or runs past this (worst case: 540 + 180 s)
LIMIT=${GPU_CHECK_LIMIT:-}       # a window's per-command limit, s (e.g. 600): the tests end 20 s before it
problems=()
declare -A TOKENS MFU

# bench.py's fixed part: the bundled corpus (nothing to download), 10 timed iterations after 3 untimed (compiles
# happen there), then one profiled for the cost shares; bench sets each config's LR schedule and ramp-up aside.
BENCH=(--use_bundled_corpus --bench_steps=10 --bench_warmup=3)
SMALL=(config/gpt2_125m.py --global_batch_size=64)  # 2 micro-batches of 32 x 1024: accumulation included
LARGE=(config/tr3_1b3_1gpu.py --bf16 --fp16=false --global_batch_size=16)  # 2 micro-batches of 8 x 2048
TINY=()
if [ "$CPU" = 1 ]; then
    # the same configs, cut to a 1-layer 64-wide model (the 50304-wide output layer stays), fp32 where bf16
    # matmuls are slow on the CPU (the loss check is bf16 on its own); compile off, as train.py has it on the CPU
    TINY=(--num_layers=1 --hidden_size=64 --num_attention_heads=2 --seq_length=64 --micro_batch_size=2
          --global_batch_size=4 --device=cpu)
    BENCH=(--use_bundled_corpus --bench_steps=1 --bench_warmup=1)
    SMALL=(config/gpt2_125m.py --bf16=false)
    LARGE=(config/tr3_1b3_1gpu.py --bf16=false --fp16=false)
fi

# run_step NAME SECONDS COMMAND...: COMMAND under its own timeout (cut to the deadline), output to $LOG/NAME.txt;
# a non-zero exit or a timeout is recorded in problems. Returns COMMAND's exit code.
run_step() {
    local name=$1 seconds=$2 log="$LOG/$1.txt" start=$SECONDS rc
    shift 2
    local left=$((DEADLINE - SECONDS))
    if [ "$CPU" = 1 ]; then  # a smoke test of the script, on a CPU that may be shared: no GPU budget to keep
        seconds=$((seconds * 5))
    elif [ "$name" != tests ] && [ "$left" -lt "$seconds" ]; then seconds=$((left > 30 ? left : 30)); fi
    timeout --kill-after=15 "$seconds" "$@" >"$log" 2>&1
    rc=$?
    case $rc in
        0) ;;
        124|137) problems+=("$name timed out after ${seconds}s") ;;
        *) problems+=("$name failed (exit $rc)") ;;
    esac
    # why it failed: the log's last lines, less the result lines the caller prints anyway
    if [ "$rc" -ne 0 ]; then grep -v -E "^(ceiling|loss|syncs):" "$log" | tail -n 3 | sed 's/^/   | /'; fi
    echo "   ($name: exit $rc in $((SECONDS - start)) s of ${seconds}; $log)"
    return "$rc"
}

# bench_row LOGNAME LABEL [KEY]: the table row of a bench.py log; its tokens/s and MFU kept under KEY for the verdict
bench_row() {
    local log="$LOG/$1.txt" tokens mfu memory costs
    tokens=$(sed -n 's/^tokens\/s: *\([0-9,.]*\).*/\1/p' "$log" | tr -d , | awk '{ printf "%.0f", $1 }')
    mfu=$(sed -n 's/^MFU: *\([0-9.]*\)%.*/\1/p' "$log")
    memory=$(sed -n 's/^peak memory: *\([0-9,]*\) MiB.*/\1/p' "$log")
    costs=$(sed -n 's/^costs: *\(.*\) of one profiled iteration/\1/p' "$log")
    printf '| %s | %s | %s%% | %s MiB | %s |\n' "$2" "${tokens:-?}" "${mfu:-?}" "${memory:-?}" "${costs:-?}"
    if [ -n "${3:-}" ]; then TOKENS[$3]=${tokens:-}; MFU[$3]=${mfu:-}; fi
}

# probe NAME SECONDS SUBCOMMAND ARGS...: a tools/gpu_probe.py step, its result lines printed
probe() {
    local name=$1 seconds=$2
    shift 2
    run_step "$name" "$seconds" python tools/gpu_probe.py "$@"
    grep -E "^(ceiling|loss|syncs):" "$LOG/$name.txt" | sed 's/^/   /'
}

if [ "$CPU" = 1 ]; then
    echo "== gpu_check --cpu: the GPU check's steps at tiny shapes on the CPU (a smoke test; logs in $LOG)"
else
    GPUS=$(python -c "import torch; print(torch.cuda.device_count())") || GPUS=0
    if [ "$GPUS" -lt 1 ]; then
        echo "verdict: FAIL -- torch sees no GPU (a CPU build of torch? see docs/gpu.md; --cpu for a smoke test)"
        exit 1
    fi
    echo "== gpu_check on $(python -c "import torch; print(torch.cuda.get_device_name(), 'torch', torch.__version__)")"\
         "($GPUS GPU(s) visible, GPU 0 used; logs in $LOG)"
fi

echo "== a. device ceilings at the configs' shapes (bf16; best and median of 10)"
probe ceilings 60 ceilings "${SMALL[0]}" "${LARGE[0]}" --bf16 --fp16=false "${TINY[@]}"

echo "== b. bench.py gpt2_125m bf16, compile on and off"
echo "| run | tokens/s | MFU | peak memory | cost shares |"
if [ "$CPU" = 1 ]; then
    echo "| gpt2_125m compile=true | skipped on the CPU: torch.compile takes minutes here (train.py leaves it off) |"
else
    run_step bench_gpt2_125m_compiled 210 python bench.py "${SMALL[@]}" "${BENCH[@]}" --compile=true
    bench_row bench_gpt2_125m_compiled "gpt2_125m compile=true" gpt2_125m
fi
run_step bench_gpt2_125m_eager 90 python bench.py "${SMALL[@]}" "${BENCH[@]}" "${TINY[@]}" --compile=false
# on the CPU the eager run is the one there is, and the verdict quotes it
bench_row bench_gpt2_125m_eager "gpt2_125m compile=false" "$([ "$CPU" = 1 ] && echo gpt2_125m)"

echo "== c. bench.py tr3_1b3_1gpu bf16 (compiled as train.py runs it on CUDA)"
run_step bench_tr3_1b3_1gpu 210 python bench.py "${LARGE[@]}" "${BENCH[@]}" "${TINY[@]}"
bench_row bench_tr3_1b3_1gpu "tr3_1b3_1gpu" tr3_1b3_1gpu

echo "== d. the compiled bf16 loss (output layer + cross-entropy) against fp32"
probe loss 90 loss "${SMALL[0]}" "${TINY[@]}"

echo "== e. host syncs of one training step (torch.cuda.set_sync_debug_mode)"
probe syncs 120 syncs "${SMALL[0]}" --num_layers=2 --global_batch_size=64 "${TINY[@]}"

left=$((BUDGET - SECONDS))
[ "$left" -ge 180 ] || left=180
# under a per-command limit the verdict must still print: the tests give way (their -v log says which ran)
if [ -n "$LIMIT" ] && [ $((LIMIT - 20 - SECONDS)) -lt "$left" ]; then left=$((LIMIT - 20 - SECONDS)); fi
[ "$left" -ge 1 ] || left=1  # timeout 0 would mean no limit at all
if [ "$CPU" = 1 ]; then
    echo "== f. the cuda-marked tests: collected only on the CPU (they skip without a GPU)"
    run_step tests "$left" python -m pytest -m cuda --collect-only -q -p no:cacheprovider tests lab/tests
    grep -E "tests? collected|selected" "$LOG/tests.txt" | tail -1 | sed 's/^/   /'
else
    echo "== f. the cuda-marked tests (${left} s left of the ${BUDGET} s budget)"
    run_step tests "$left" python -m pytest -m cuda -v -p no:cacheprovider tests lab/tests
    # -v: each test's result is in the log as it ends, so a timeout still says which passed
    echo "   $(grep -c " PASSED" "$LOG/tests.txt") passed, $(grep -c -E " (FAILED|ERROR)" "$LOG/tests.txt")" \
         "failed, $(grep -c " SKIPPED" "$LOG/tests.txt") skipped"
    grep -E " (FAILED|ERROR)" "$LOG/tests.txt" | head -5 | sed 's/^/   /'
fi

# g. the verdict: every step ran, and the MFU targets (reported, not enforced, on the CPU)
line() { echo "$1 ${TOKENS[$1]:-?} tokens/s ${MFU[$1]:-?}% MFU"; }
if [ "$CPU" = 1 ]; then
    targets="CPU smoke: targets not applicable"
else
    targets="targets ${TARGET_SMALL}% and ${TARGET_LARGE}%"
    awk -v a="${MFU[gpt2_125m]:-0}" -v t="$TARGET_SMALL" 'BEGIN { exit !(a >= t) }' ||
        problems+=("gpt2_125m ${MFU[gpt2_125m]:-?}% MFU < ${TARGET_SMALL}%")
    awk -v a="${MFU[tr3_1b3_1gpu]:-0}" -v t="$TARGET_LARGE" 'BEGIN { exit !(a >= t) }' ||
        problems+=("tr3_1b3_1gpu bf16 ${MFU[tr3_1b3_1gpu]:-?}% MFU < ${TARGET_LARGE}%")
fi
summary="$(line gpt2_125m), $(line tr3_1b3_1gpu) ($targets; ${SECONDS} s, logs in $LOG)"
if [ ${#problems[@]} -eq 0 ]; then
    echo "verdict: OK -- $summary; no failures"
else
    failures=$(printf '; %s' "${problems[@]}")
    echo "verdict: FAIL -- $summary${failures}"
    exit 1
fi
