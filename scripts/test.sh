#!/usr/bin/env bash
# Set up (if needed) and run kvbridge's checks: ruff, then pytest.
# Idempotent: a second run skips the installs and goes straight to the checks.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh

.venv/bin/ruff check .
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
