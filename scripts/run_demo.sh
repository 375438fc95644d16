#!/usr/bin/env bash
# The README's main command: set up .venv if needed (with the `router` extra), launch a
# prefill worker, a decode worker and vllm-router in P/D mode in front of them
# (tiny-hybrid; prefill pages 64-token NHD cross-layer blocks, decode 16-token HND blocks
# with 8-token kernel blocks), check the pairing with `kvbridge probe` (the plan decode
# will use), send a few prompts through the router,
# print the answers next to the single-process reference check and the transfer summary,
# then tear everything down. DEVICE=cuda (or cuda:N) runs the workers and the reference on
# a GPU (default cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
KVBRIDGE_EXTRAS="${KVBRIDGE_EXTRAS:-test,router}"
source scripts/setup_env.sh

export MODEL="${MODEL:-tiny-hybrid}" DEVICE="${DEVICE:-cpu}"
export PREFILL_BLOCK_SIZE="${PREFILL_BLOCK_SIZE:-64}" PREFILL_KV_LAYOUT="${PREFILL_KV_LAYOUT:-NHD}"
export PREFILL_CROSS_LAYERS="${PREFILL_CROSS_LAYERS:-1}"
export DECODE_BLOCK_SIZE="${DECODE_BLOCK_SIZE:-16}" DECODE_KERNEL_BLOCK_SIZE="${DECODE_KERNEL_BLOCK_SIZE:-8}"
export DECODE_KV_LAYOUT="${DECODE_KV_LAYOUT:-HND}" DECODE_CROSS_LAYERS="${DECODE_CROSS_LAYERS:-0}"
export NUM_PROMPTS="${NUM_PROMPTS:-4}" MAX_TOKENS="${MAX_TOKENS:-24}" SHOW_ANSWERS=1 CHECK_PAIRING=1
exec scripts/run_integration.sh
