# Sourced by scripts/run_integration.sh and scripts/run_multihost.sh: what the two runs
# share (the environment they read, its checks, the worker flags, process teardown, the
# ready and step helpers). Each script sets LOG_DIR first and adds its own topology.

PY="${PYTHON:-.venv/bin/python}"
MODEL="${MODEL:-tiny-hybrid}"
DEVICE="${DEVICE:-cpu}"
PREFILL_BLOCK_SIZE="${PREFILL_BLOCK_SIZE:-16}"
DECODE_BLOCK_SIZE="${DECODE_BLOCK_SIZE:-16}"
PREFILL_KERNEL_BLOCK_SIZE="${PREFILL_KERNEL_BLOCK_SIZE:-$PREFILL_BLOCK_SIZE}"
DECODE_KERNEL_BLOCK_SIZE="${DECODE_KERNEL_BLOCK_SIZE:-$DECODE_BLOCK_SIZE}"
PREFILL_KV_LAYOUT="${PREFILL_KV_LAYOUT:-NHD}"
DECODE_KV_LAYOUT="${DECODE_KV_LAYOUT:-NHD}"
CROSS_LAYERS="${CROSS_LAYERS:-0}"
PREFILL_CROSS_LAYERS="${PREFILL_CROSS_LAYERS:-$CROSS_LAYERS}"
DECODE_CROSS_LAYERS="${DECODE_CROSS_LAYERS:-$CROSS_LAYERS}"
NUM_BLOCKS="${NUM_BLOCKS:-512}"
NUM_PROMPTS="${NUM_PROMPTS:-8}"
MAX_TOKENS="${MAX_TOKENS:-16}"
ATOL="${ATOL:-1e-4}"
FAULT_INJECT="${FAULT_INJECT:-}"
TRANSFER_MODE="${TRANSFER_MODE:-pull}"
VERIFY="${VERIFY:-}"
STARTUP_TIMEOUT="${STARTUP_TIMEOUT:-90}"
SHOW_ANSWERS="${SHOW_ANSWERS:-0}"

case "$TRANSFER_MODE" in
    pull | push) ;;
    *) echo "TRANSFER_MODE=$TRANSFER_MODE: expected pull or push" >&2; exit 2 ;;
esac
case "$VERIFY" in
    "" | off | sample | all) ;;
    *) echo "VERIFY=$VERIFY: expected off, sample or all" >&2; exit 2 ;;
esac
case "$FAULT_INJECT" in
    "" | 0) FAULT_ARGS=() ;;
    1 | corrupt-block) FAULT_ARGS=(--fault-inject corrupt-block) ;;
    *) echo "FAULT_INJECT=$FAULT_INJECT: expected corrupt-block" >&2; exit 2 ;;
esac
EXTRA="\"extra\": {\"transfer_mode\": \"$TRANSFER_MODE\"}"
# decode's: also extra.verify when VERIFY is set (prefill answers whoever asks)
DECODE_EXTRA="\"extra\": {\"transfer_mode\": \"$TRANSFER_MODE\"${VERIFY:+, \"verify\": \"$VERIFY\"}}"
SHOW=()
[ "$SHOW_ANSWERS" = 1 ] && SHOW=(--show-answers)

flag() { [ "$1" = 1 ] || [ "$1" = true ] && echo "--cross-layers" || true; }

PIDS=()
stop_processes() {  # stop_processes: TERM every started process group, KILL the late ones
    set +m  # no job-status lines for the processes killed here
    for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    for _ in $(seq 50); do
        local alive=0
        for pid in "${PIDS[@]}"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
show_failure() {  # show_failure RC WHAT: the exit status and the tail of every log
    echo "$2 failed (exit $1); logs in $LOG_DIR" >&2
    for f in "$LOG_DIR"/*.log; do
        [ -f "$f" ] && { echo "--- tail of $f" >&2; tail -n 15 "$f" >&2; }
    done
}

# Every server binds port 0 (HTTP and side channel: "kv_port": 0) and writes the ports it
# got to its ready file; nothing here picks a port for a process to bind later.
ready() {  # ready FILE PID -> the server's URL, once it is bound (fails if it exits)
    "$PY" -m kvbridge.examples.ready "$1" --pid "$2" --timeout "$STARTUP_TIMEOUT"
}
# Steps run in the background and are waited for: bash runs the INT/TERM traps only
# between commands, and `wait` returns at once on a signal while a foreground child does not.
step() {
    "$@" &
    PIDS+=($!)
    wait "$!"
}
describe_pair() {
    echo "model $MODEL on $DEVICE: prefill bs=$PREFILL_BLOCK_SIZE kb=$PREFILL_KERNEL_BLOCK_SIZE" \
        "$PREFILL_KV_LAYOUT cross=$PREFILL_CROSS_LAYERS -> decode bs=$DECODE_BLOCK_SIZE" \
        "kb=$DECODE_KERNEL_BLOCK_SIZE $DECODE_KV_LAYOUT cross=$DECODE_CROSS_LAYERS" \
        "mode=$TRANSFER_MODE" \
        "${FAULT_INJECT:+(fault: $FAULT_INJECT)}"
}
