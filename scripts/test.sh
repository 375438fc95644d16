#!/usr/bin/env bash
# Set up (if needed) and run kvbridge's checks: ruff, the import contracts (lint-imports),
# then pytest (vLLM tests included, so the venv gets the vllm extra; vllm-router tests, so
# the router extra). Idempotent: a second
# run skips the installs.
set -euo pipefail
cd "$(dirname "$0")/.."
KVBRIDGE_EXTRAS="${KVBRIDGE_EXTRAS:-test,vllm,router}"
source scripts/setup_env.sh

.venv/bin/ruff check .
.venv/bin/lint-imports --no-cache
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
