#!/usr/bin/env bash
# Set up (if needed) and run kvbridge's checks: ruff, the import contracts (lint-imports),
# the manual (`mkdocs build --strict`: a broken link, anchor or a page left out of the nav
# fails), then pytest (vLLM tests included, so the venv gets the vllm extra; the vllm-router
# tests need the router extra, the plot tests the plot extra). Idempotent: a second run
# skips the installs.
set -euo pipefail
cd "$(dirname "$0")/.."
KVBRIDGE_EXTRAS="${KVBRIDGE_EXTRAS:-test,vllm,router,docs,plot}"
source scripts/setup_env.sh

.venv/bin/ruff check .
.venv/bin/lint-imports --no-cache
[ -x .venv/bin/mkdocs ] || { echo "mkdocs missing: KVBRIDGE_EXTRAS must include docs" >&2; exit 1; }
site_dir="$(mktemp -d)"  # the built site stays out of the repository
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site_dir"
rm -rf "$site_dir"
set +e
# the 30 slowest tests close the report: CI's time (target under 30 minutes) is read there
.venv/bin/python -m pytest --durations=30 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
