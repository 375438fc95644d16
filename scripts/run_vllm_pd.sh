#!/usr/bin/env bash
# Real vLLM prefill + decode servers behind vllm-router (the `router` extra), compared with a single
# vLLM server (greedy token ids and logprobs). Configure with environment variables:
#   CONNECTOR=kvbridge|nixl  MODEL=tiny-llama|tiny-gemma3|tiny-granite-hybrid
#   PREFILL_BLOCK_SIZE=32 DECODE_BLOCK_SIZE=32  NUM_PROMPTS=4 MAX_TOKENS=16 PROMPT_TOKENS=100
#   KVBRIDGE_EXTRA='{"...": ...}'  (see examples/vllm/run_pd.py for the rest)
# Prints RESULT: PASS|FAIL and a SUMMARY line; exits 0 iff PASS.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    echo "no .venv: run scripts/setup_vllm.sh first" >&2
    exit 2
fi
exec .venv/bin/python -m kvbridge.examples.vllm.run_pd "$@"
