#!/usr/bin/env bash
# The integration run (scripts/run_integration.sh: same environment variables, same
# exactness check) with prefill and decode on two "hosts": two network namespaces joined
# by a veth pair, so the KV bytes cross a real network link (UCX over TCP, not shared
# memory). The front door (vllm-router, examples/router.py) and the check run beside decode;
# the router reaches prefill, and health-checks it, at prefill's link address.
#
#   ns kvb-<pid>-p                       ns kvb-<pid>-d
#   prefill  10.231.0.1  <== veth ==>  10.231.0.2  decode, router (127.0.0.1), check
#
# Environment, besides run_integration.sh's (MODEL, DEVICE, *_BLOCK_SIZE, *_KV_LAYOUT,
# CROSS_LAYERS, NUM_BLOCKS, NUM_PROMPTS, MAX_TOKENS, ATOL, TRANSFER_MODE, VERIFY,
# FAULT_INJECT, STARTUP_TIMEOUT, SHOW_ANSWERS, LOG_DIR):
#   RATE []            a tc rate ("1gbit", "200mbit"): a tbf limit on both ends of the link
#   UCX_TLS [tcp]      the UCX transports; tcp makes the bytes cross the link (on one machine
#                      UCX may otherwise pick shared memory even across namespaces)
#   SUBNET [10.231.0]  the /24 of the link (it exists only inside the two namespaces)
# Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2; exits 3 with a message
# without them. Always removes its namespaces (and so the link) and its processes.
# After the check it prints the bytes that crossed the link and fails if fewer bytes
# crossed than the connector moved (the proof that the network path carried them).
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/integration_lib.sh
RATE="${RATE:-}"
UCX_TLS="${UCX_TLS:-tcp}"
SUBNET="${SUBNET:-10.231.0}"

NS_P="kvb-$$-p"
NS_D="kvb-$$-d"
VETH_P="kvb$$p"  # interface names: at most 15 characters
VETH_D="kvb$$d"
P_IP="$SUBNET.1"
D_IP="$SUBNET.2"

if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    echo "run_multihost.sh needs iproute2 (ip, tc); run scripts/run_integration.sh instead" >&2
    exit 3
fi
if [ "$(id -u)" != 0 ]; then
    echo "run_multihost.sh creates network namespaces: run it as root (or with" \
        "CAP_NET_ADMIN and CAP_SYS_ADMIN); scripts/run_integration.sh runs without" >&2
    exit 3
fi

LOG_DIR="${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/kvbridge-multihost.XXXXXX")}"
mkdir -p "$LOG_DIR"

teardown() {
    local rc=$?
    trap - EXIT INT TERM
    stop_processes
    ip netns del "$NS_P" 2>/dev/null || true  # takes the veth pair with it
    ip netns del "$NS_D" 2>/dev/null || true
    [ "$rc" = 0 ] || show_failure "$rc" "multi-host run"
    exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- the two hosts and the link
if ! ip netns add "$NS_P" 2>"$LOG_DIR/netns.err"; then
    echo "cannot create a network namespace ($(cat "$LOG_DIR/netns.err")):" \
        "run_multihost.sh needs network namespaces; scripts/run_integration.sh runs without" >&2
    exit 3
fi
ip netns add "$NS_D"
ip link add "$VETH_P" netns "$NS_P" type veth peer name "$VETH_D" netns "$NS_D"
in_p() { ip netns exec "$NS_P" "$@"; }
in_d() { ip netns exec "$NS_D" "$@"; }
in_p ip addr add "$P_IP/24" dev "$VETH_P"
in_d ip addr add "$D_IP/24" dev "$VETH_D"
for ns in "$NS_P" "$NS_D"; do ip netns exec "$ns" ip link set lo up; done
in_p ip link set "$VETH_P" up
in_d ip link set "$VETH_D" up
if [ -n "$RATE" ]; then
    # burst: 4 ms of the rate (at least 16 KB), so the limit holds even for short transfers
    BURST=$("$PY" -c 'import re,sys
m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", sys.argv[1].lower())
if not m: sys.exit(f"RATE={sys.argv[1]}: expected e.g. 500mbit, 1gbit")
bps = float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]]
print(max(16000, int(bps / 8 * 0.004)))' "$RATE")
    in_p tc qdisc add dev "$VETH_P" root tbf rate "$RATE" burst "$BURST" latency 200ms
    in_d tc qdisc add dev "$VETH_D" root tbf rate "$RATE" burst "$BURST" latency 200ms
fi
link_bytes() {  # link_bytes NS DEV -> bytes sent by DEV so far
    ip netns exec "$1" cat "/sys/class/net/$2/statistics/tx_bytes"
}

# --- the servers: prefill on host P, decode and the front door on host D
export UCX_TLS
set -m  # background jobs get their own process groups: teardown kills whole groups
UCX_NET_DEVICES="$VETH_P" in_p "$PY" -m kvbridge.examples.server --role prefill \
    --host "$P_IP" --port 0 --model "$MODEL" --device "$DEVICE" \
    --block-size "$PREFILL_BLOCK_SIZE" --kernel-block-size "$PREFILL_KERNEL_BLOCK_SIZE" \
    --kv-layout "$PREFILL_KV_LAYOUT" $(flag "$PREFILL_CROSS_LAYERS") --num-blocks "$NUM_BLOCKS" \
    --kv-transfer-config "{\"kv_role\": \"kv_producer\", \"engine_id\": \"prefill-$$\", \"kv_ip\": \"$P_IP\", \"kv_port\": 0, $EXTRA}" \
    --ready-file "$LOG_DIR/prefill.ready.json" >"$LOG_DIR/prefill.log" 2>&1 &
PIDS+=($!)
UCX_NET_DEVICES="$VETH_D" in_d "$PY" -m kvbridge.examples.server --role decode \
    --host "$D_IP" --port 0 --model "$MODEL" --device "$DEVICE" \
    --block-size "$DECODE_BLOCK_SIZE" --kernel-block-size "$DECODE_KERNEL_BLOCK_SIZE" \
    --kv-layout "$DECODE_KV_LAYOUT" $(flag "$DECODE_CROSS_LAYERS") --num-blocks "$NUM_BLOCKS" \
    --kv-transfer-config "{\"kv_role\": \"kv_consumer\", \"engine_id\": \"decode-$$\", \"kv_ip\": \"$D_IP\", \"kv_port\": 0, $DECODE_EXTRA}" \
    --ready-file "$LOG_DIR/decode.ready.json" "${FAULT_ARGS[@]}" >"$LOG_DIR/decode.log" 2>&1 &
PIDS+=($!)
P_URL=$(ready "$LOG_DIR/prefill.ready.json" "${PIDS[0]}")
D_URL=$(ready "$LOG_DIR/decode.ready.json" "${PIDS[1]}")

# The front door, beside decode: vllm-router in P/D mode (it binds only once both workers
# answer /health; its launcher holds the ports it hands the router until then)
front_door() {  # front_door PREFILL_URL DECODE_URL READY_FILE LOG
    in_d "$PY" -m kvbridge.examples.router --host 127.0.0.1 --port 0 \
        --prefill "$1" --decode "$2" --startup-timeout "$STARTUP_TIMEOUT" \
        --ready-file "$3" >"$4" 2>&1
}
front_door "$P_URL" "$D_URL" "$LOG_DIR/router.ready.json" "$LOG_DIR/router.log" &
PIDS+=($!)
X_URL=$(ready "$LOG_DIR/router.ready.json" "${PIDS[2]}")

echo "two hosts (netns $NS_P: prefill $P_IP | netns $NS_D: decode $D_IP, router)" \
    "link ${RATE:-unlimited}, UCX_TLS=$UCX_TLS"
describe_pair
step in_d "$PY" -m kvbridge.examples.check wait --timeout "$STARTUP_TIMEOUT" \
    --url "$D_URL/health" --url "$X_URL/health" --url "$P_URL/health" \
    --pid "${PIDS[0]}" --pid "${PIDS[1]}" --pid "${PIDS[2]}"

P_TX0=$(link_bytes "$NS_P" "$VETH_P")
step in_d "$PY" -m kvbridge.examples.check run --router "$X_URL" \
    --decode "$D_URL" --prefill "$P_URL" --model "$MODEL" \
    --num-prompts "$NUM_PROMPTS" --max-tokens "$MAX_TOKENS" --atol "$ATOL" --device "$DEVICE" \
    "${SHOW[@]}" | tee "$LOG_DIR/check.out"

# --- the proof that the KV bytes crossed the link: prefill's side of the link sent at
# least the bytes the connector moved (decode READ them, or prefill WROTE them)
P_TX=$(($(link_bytes "$NS_P" "$VETH_P") - P_TX0))
KV_BYTES=$(sed -n 's/^SUMMARY .* bytes=\([0-9]*\) .*/\1/p' "$LOG_DIR/check.out")
if [ "$TRANSFER_MODE" = push ]; then
    KV_BYTES=$(in_d "$PY" -c 'import sys
from kvbridge.examples.check import http_get, parse_metrics
print(int(parse_metrics(http_get(sys.argv[1] + "/metrics")[1].decode())["kvbridge_bytes_written_total"]))' "$P_URL")
fi
echo "link: prefill's end sent $P_TX bytes; the connector moved ${KV_BYTES:-?} KV bytes"
if [ -z "$KV_BYTES" ] || [ "$KV_BYTES" = 0 ] || [ "$P_TX" -lt "$KV_BYTES" ]; then
    echo "RESULT: FAIL (the KV bytes did not cross the link: check UCX_TLS=$UCX_TLS)" >&2
    exit 1
fi
