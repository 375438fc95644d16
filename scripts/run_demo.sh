#!/usr/bin/env bash
# The README's main command: set up .venv if needed (with the `router` extra), launch a
# prefill worker, a decode worker and vllm-router in P/D mode in front of them
# (tiny-hybrid; prefill pages 64-token NHD cross-layer blocks, decode 16-token HND blocks
# with 8-token kernel blocks), check the pairing with `kvbridge probe`, send a few prompts
# through the router, then tear everything down. It prints:
#   - the transfer plan decode computed at its handshake, in words: how each side pages its
#     cache, who moves the bytes (pull: decode READs; push: prefill WRITEs), in what
#     chunks, and who rewrites blocks (examples/plan_words.py);
#   - per prompt, the verdict (exact / differs) and the generated token ids beside the
#     single-process reference's (examples/check.py);
#   - the transfer summary, every load verified by prefill's digests (VERIFY=all).
# DEVICE=cuda (or cuda:N) runs the workers and the reference on a GPU (default cpu);
# TRANSFER_MODE=push has prefill write instead; SKIP_SETUP=1 runs with .venv as it is
# (tests/scripts/test_run_demo.py runs it so).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${SKIP_SETUP:-0}" != 1 ]; then
    KVBRIDGE_EXTRAS="${KVBRIDGE_EXTRAS:-test,router}"
    source scripts/setup_env.sh
fi

export MODEL="${MODEL:-tiny-hybrid}" DEVICE="${DEVICE:-cpu}"
export PREFILL_BLOCK_SIZE="${PREFILL_BLOCK_SIZE:-64}" PREFILL_KV_LAYOUT="${PREFILL_KV_LAYOUT:-NHD}"
export PREFILL_CROSS_LAYERS="${PREFILL_CROSS_LAYERS:-1}"
export DECODE_BLOCK_SIZE="${DECODE_BLOCK_SIZE:-16}" DECODE_KERNEL_BLOCK_SIZE="${DECODE_KERNEL_BLOCK_SIZE:-8}"
export DECODE_KV_LAYOUT="${DECODE_KV_LAYOUT:-HND}" DECODE_CROSS_LAYERS="${DECODE_CROSS_LAYERS:-0}"
export NUM_PROMPTS="${NUM_PROMPTS:-4}" MAX_TOKENS="${MAX_TOKENS:-24}" SHOW_ANSWERS=1 CHECK_PAIRING=1
export VERIFY="${VERIFY:-all}"
exec scripts/run_integration.sh
