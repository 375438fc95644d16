#!/usr/bin/env bash
# Set up (if needed) and run kvbridge's checks: ruff, the import contracts (lint-imports),
# the manual (`mkdocs build --strict`: a broken link, anchor or a page left out of the nav
# fails), then pytest (vLLM tests included, so the venv gets the vllm extra; the vllm-router
# tests need the router extra, the plot tests the plot extra). Idempotent: a second run
# skips the installs. Arguments after the tier go to pytest.
#
#   bash scripts/test.sh [PYTEST ARGS]         everything (CI's run, `.ci/run`)
#   bash scripts/test.sh quick [PYTEST ARGS]   the quick tier: ruff, import contracts and
#       pytest -m "not slow": no vLLM server, no process, no benchmark (the `slow` marker,
#       defined in pyproject.toml's [tool.pytest.ini_options]); no docs build
set -euo pipefail
cd "$(dirname "$0")/.."
tier=full
if [ "${1:-}" = quick ]; then
    tier=quick
    shift
fi
KVBRIDGE_EXTRAS="${KVBRIDGE_EXTRAS:-test,vllm,router,docs,plot}"
source scripts/setup_env.sh

run_pytest() {  # pytest's own status, but "collected no tests" (5) fails too
    set +e
    .venv/bin/python -m pytest "$@"
    local rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then
        echo "pytest collected no tests: failing" >&2
        return 1
    fi
    return "$rc"
}

.venv/bin/ruff check .
.venv/bin/lint-imports --no-cache
if [ "$tier" = quick ]; then
    run_pytest -m "not slow" --durations=10 "$@"
    exit 0
fi
[ -x .venv/bin/mkdocs ] || { echo "mkdocs missing: KVBRIDGE_EXTRAS must include docs" >&2; exit 1; }
site_dir="$(mktemp -d)"  # the built site stays out of the repository
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site_dir"
rm -rf "$site_dir"
# the 30 slowest tests close the report: CI's time (target under 20 minutes) is read there
run_pytest --durations=30 "$@"
