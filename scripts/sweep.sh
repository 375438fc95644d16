#!/usr/bin/env bash
# Run scripts/run_integration.sh over a matrix of prefill/decode formats; print a table.
#
#   scripts/sweep.sh                 # the default matrix below
#   MODELS="tiny-hybrid" MODES=push scripts/sweep.sh
#
# Each row: MODEL  mode  prefill (block/kernel/layout/cross)  decode (same)  result  summary.
# MODES [pull push]: every row runs once per transfer mode.
# Exits non-zero when any row fails. NUM_PROMPTS / MAX_TOKENS pass through.
set -uo pipefail
cd "$(dirname "$0")/.."

MODELS="${MODELS:-tiny-dense tiny-hybrid tiny-hybrid-state}"
MODES="${MODES:-pull push}"
# prefill_bs:prefill_kb:prefill_layout:prefill_cross  decode_bs:decode_kb:decode_layout:decode_cross
# The last four rows pair block sizes that are not multiples of each other.
PAIRS="${PAIRS:-16:16:NHD:0/16:16:NHD:0 16:16:NHD:1/16:8:HND:1 64:64:NHD:1/16:8:HND:0 16:8:HND:0/64:16:NHD:1 32:32:HND:1/16:16:NHD:1 80:16:NHD:0/32:32:HND:1 96:32:HND:1/64:64:NHD:0 528:16:NHD:1/64:32:HND:0 32:16:HND:0/48:48:NHD:1}"
export NUM_PROMPTS="${NUM_PROMPTS:-6}" MAX_TOKENS="${MAX_TOKENS:-8}"

printf '%-18s %-5s %-16s %-16s %-6s %s\n' model mode prefill decode result summary
failed=0
for model in $MODELS; do
  for mode in $MODES; do
    for pair in $PAIRS; do
        IFS=: read -r pbs pkb play pcross <<<"${pair%/*}"
        IFS=: read -r dbs dkb dlay dcross <<<"${pair#*/}"
        out="$(MODEL="$model" TRANSFER_MODE="$mode" \
            PREFILL_BLOCK_SIZE="$pbs" PREFILL_KERNEL_BLOCK_SIZE="$pkb" PREFILL_KV_LAYOUT="$play" \
            PREFILL_CROSS_LAYERS="$pcross" DECODE_BLOCK_SIZE="$dbs" DECODE_KERNEL_BLOCK_SIZE="$dkb" \
            DECODE_KV_LAYOUT="$dlay" DECODE_CROSS_LAYERS="$dcross" \
            scripts/run_integration.sh 2>&1)"
        rc=$?
        summary="$(grep -o 'SUMMARY .*' <<<"$out" | tail -n 1 | cut -d' ' -f2-)"
        [ -n "$summary" ] || summary="$(grep -v '^ *$' <<<"$out" | tail -n 1)"
        result=PASS
        [ "$rc" = 0 ] || { result=FAIL; failed=$((failed + 1)); }
        [ "$pcross" = 1 ] && pc=x || pc=-
        [ "$dcross" = 1 ] && dc=x || dc=-
        printf '%-18s %-5s %-16s %-16s %-6s %s\n' "$model" "$mode" "$pbs/$pkb/$play/$pc" \
            "$dbs/$dkb/$dlay/$dc" "$result" "$summary"
    done
  done
done
echo "(block/kernel block/layout/cross-layer x)  failed rows: $failed"
[ "$failed" = 0 ]
