#!/usr/bin/env bash
# Launch a prefill worker, a decode worker and vllm-router in P/D mode in front of them
# (examples/router.py; the `router` extra) as separate processes, send NUM_PROMPTS
# prompts through the router and through the single-process reference, and
# exit 0 only if every generated token matches and per-step logits agree (examples/check.py).
#
# Environment (defaults in brackets):
#   MODEL [tiny-hybrid]           tiny-dense | tiny-hybrid | tiny-hybrid-state
#   DEVICE [cpu]                  cpu | cuda | cuda:N: where prefill, decode and the
#                                 reference hold weights and KV cache (--device)
#   PREFILL_BLOCK_SIZE [16]       DECODE_BLOCK_SIZE [16]
#   PREFILL_KERNEL_BLOCK_SIZE     DECODE_KERNEL_BLOCK_SIZE   [= the block size]
#   PREFILL_KV_LAYOUT [NHD]       DECODE_KV_LAYOUT [NHD]
#   CROSS_LAYERS [0]              or PREFILL_CROSS_LAYERS / DECODE_CROSS_LAYERS (1 = on)
#   NUM_BLOCKS [512]              NUM_PROMPTS [8]    MAX_TOKENS [16]    ATOL [1e-4]
#   TRANSFER_MODE [pull]          pull: decode READs prefill's blocks; push: prefill WRITEs
#                                 into decode's (both workers get extra.transfer_mode)
#   VERIFY []                     decode's extra.verify: off | sample | all (all: every load
#                                 proves its bytes by prefill's digests); unset: its default
#   FAULT_INJECT []               "corrupt-block" (or 1): decode flips one loaded block
#   STARTUP_TIMEOUT [90]          seconds to wait for /health
#   SHOW_ANSWERS [0]              print each prompt's answer
#   ROUTER_POLICY [round_robin]   vllm-router's --policy (power_of_two, cache_aware, ...)
#   CHECK_PAIRING [0]             1: `kvbridge probe` both side channels before any request
#                                 and print the transfer plan (run_demo.sh sets it)
#   LOG_DIR [a fresh temp dir]    worker and router logs
# Always tears the processes down (each runs in its own process group), also on failure.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/integration_lib.sh
ROUTER_POLICY="${ROUTER_POLICY:-round_robin}"
CHECK_PAIRING="${CHECK_PAIRING:-0}"
LOG_DIR="${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/kvbridge-integration.XXXXXX")}"
mkdir -p "$LOG_DIR"

teardown() {
    local rc=$?
    trap - EXIT INT TERM
    stop_processes
    [ "$rc" = 0 ] || show_failure "$rc" "integration run"
    exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
set -m  # background jobs get their own process groups: teardown kills whole groups

"$PY" -m kvbridge.examples.server --role prefill --model "$MODEL" --port 0 --device "$DEVICE" \
    --block-size "$PREFILL_BLOCK_SIZE" --kernel-block-size "$PREFILL_KERNEL_BLOCK_SIZE" \
    --kv-layout "$PREFILL_KV_LAYOUT" $(flag "$PREFILL_CROSS_LAYERS") --num-blocks "$NUM_BLOCKS" \
    --kv-transfer-config "{\"kv_role\": \"kv_producer\", \"engine_id\": \"prefill-$$\", \"kv_port\": 0, $EXTRA}" \
    --ready-file "$LOG_DIR/prefill.ready.json" >"$LOG_DIR/prefill.log" 2>&1 &
PIDS+=($!)
"$PY" -m kvbridge.examples.server --role decode --model "$MODEL" --port 0 --device "$DEVICE" \
    --block-size "$DECODE_BLOCK_SIZE" --kernel-block-size "$DECODE_KERNEL_BLOCK_SIZE" \
    --kv-layout "$DECODE_KV_LAYOUT" $(flag "$DECODE_CROSS_LAYERS") --num-blocks "$NUM_BLOCKS" \
    --kv-transfer-config "{\"kv_role\": \"kv_consumer\", \"engine_id\": \"decode-$$\", \"kv_port\": 0, $DECODE_EXTRA}" \
    --ready-file "$LOG_DIR/decode.ready.json" "${FAULT_ARGS[@]}" >"$LOG_DIR/decode.log" 2>&1 &
PIDS+=($!)
P_URL=$(ready "$LOG_DIR/prefill.ready.json" "${PIDS[0]}")
D_URL=$(ready "$LOG_DIR/decode.ready.json" "${PIDS[1]}")
# vllm-router binds only once both workers answer /health; its launcher holds the ports
# it hands the router until then (the router refuses --port 0)
"$PY" -m kvbridge.examples.router --prefill "$P_URL" --decode "$D_URL" --policy "$ROUTER_POLICY" \
    --startup-timeout "$STARTUP_TIMEOUT" --ready-file "$LOG_DIR/router.ready.json" \
    >"$LOG_DIR/router.log" 2>&1 &
PIDS+=($!)
X_URL=$(ready "$LOG_DIR/router.ready.json" "${PIDS[2]}")

describe_pair
step "$PY" -m kvbridge.examples.check wait --timeout "$STARTUP_TIMEOUT" \
    --url "$P_URL/health" --url "$D_URL/health" --url "$X_URL/health" --pid "${PIDS[0]}" --pid "${PIDS[1]}" --pid "${PIDS[2]}"

if [ "$CHECK_PAIRING" = 1 ]; then
    # before any request: handshake with both side channels, and print the plan decode
    # will compute against prefill (kvbridge probe exits non-zero if they cannot pair)
    P_KV=$("$PY" -m kvbridge.examples.ready "$LOG_DIR/prefill.ready.json" --field kv_port)
    D_KV=$("$PY" -m kvbridge.examples.ready "$LOG_DIR/decode.ready.json" --field kv_port)
    echo "--- kvbridge probe 127.0.0.1:$D_KV --save decode.json"
    step "$PY" -m kvbridge.cli probe "127.0.0.1:$D_KV" --save "$LOG_DIR/decode.json"
    echo "--- kvbridge probe 127.0.0.1:$P_KV --as decode.json"
    step "$PY" -m kvbridge.cli probe "127.0.0.1:$P_KV" --as "$LOG_DIR/decode.json" \
        --prompt-tokens 200
fi

step "$PY" -m kvbridge.examples.check run --router "$X_URL" \
    --decode "$D_URL" --prefill "$P_URL" --model "$MODEL" \
    --num-prompts "$NUM_PROMPTS" --max-tokens "$MAX_TOKENS" --atol "$ATOL" --device "$DEVICE" \
    "${SHOW[@]}"
