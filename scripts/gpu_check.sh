#!/usr/bin/env bash
# kvbridge's GPU tier in one command, for a machine with a CUDA GPU:
#   1. pytest -m gpu: the worker matrix, the connector pair and the example servers end
#      to end with CUDA caches (NIXL VRAM), and the same with host staging
#      (kv_buffer_device "cpu": pinned host mirrors);
#   2. scripts/bench_layouts.py --device cuda: rewrites vs a device copy of the same bytes;
#   3. scripts/bench_transfer.py --device cuda --host-staging compare: connector loads vs
#      raw NIXL READ / WRITE on VRAM, direct and host-staged.
#
# Python: $PYTHON (default: .venv/bin/python if present, else python3), which must hold a
# CUDA build of torch. Packages missing there (nixl, msgspec, pyzmq) are installed from the
# wheels in $WHEELS (default .whl/, made on a networked machine by
# `bash scripts/gpu_wheels.sh`) into a private folder, never into the system.
# Logs go to $OUT (default gpu_check_out/). Exit status: non-zero if a step failed.
#
#   bash scripts/gpu_check.sh            # everything (about 5-8 minutes on an H100)
#   QUICK=1 bash scripts/gpu_check.sh    # smaller benchmarks
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT="${OUT:-gpu_check_out}"
WHEELS="${WHEELS:-.whl}"
mkdir -p "$OUT"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: $PYTHON sees no CUDA device (torch.cuda.is_available() is False)" >&2
    exit 2
fi

if ! "$PYTHON" -c "import nixl._api, msgspec, zmq" 2>/dev/null; then
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "gpu_check: nixl, msgspec or pyzmq is missing and $WHEELS/ has no wheels" \
            "(run scripts/gpu_wheels.sh where pip works)" >&2
        exit 2
    fi
    SITE="$(mktemp -d)/site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" "$WHEELS"/*.whl || exit 2
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# kvbridge is not pip-installed on the lent machine (no network, no build backend there):
# a kvbridge/ namespace folder of links to the checkout's packages gives the same import
# root as an install (kvbridge.layouts, kvbridge.connector, ...); "." keeps tests importable.
ROOT_LINKS="$(mktemp -d)"
mkdir "$ROOT_LINKS/kvbridge"
for pkg in layouts handshake connector examples; do
    ln -s "$PWD/$pkg" "$ROOT_LINKS/kvbridge/$pkg"
done
export PYTHONPATH=".:$ROOT_LINKS${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

"$PYTHON" - <<'EOF' | tee "$OUT/device.txt"
import nixl, torch
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, nixl {getattr(nixl, '__version__', '?')}")
EOF

failed=()
step() {
    local name="$1"
    shift
    echo "== $name: $*"
    if "$@" 2>&1 | tee "$OUT/$name.log"; then
        echo "== $name: ok"
    else
        echo "== $name: FAILED (log: $OUT/$name.log)"
        failed+=("$name")
    fi
}

step tests "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests
if [ -n "${QUICK:-}" ]; then
    step layouts "$PYTHON" scripts/bench_layouts.py --device cuda --quick
    step transfer "$PYTHON" scripts/bench_transfer.py --device cuda --layers 8 \
        --iterations 5 --host-staging compare
else
    step layouts "$PYTHON" scripts/bench_layouts.py --device cuda
    step transfer "$PYTHON" scripts/bench_transfer.py --device cuda --host-staging compare
fi

if [ "${#failed[@]}" -gt 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_check: all steps passed (logs in $OUT/)"
