#!/usr/bin/env bash
# kvbridge's GPU tier in one command, for a machine with a CUDA GPU:
#   1. pytest -m gpu: the worker matrix, the connector pair and the example servers end
#      to end with CUDA caches (NIXL VRAM), and the same with host staging
#      (kv_buffer_device "cpu": pinned host mirrors);
#   2. kvbridge bench layouts --device cuda: rewrites vs a device copy of the same bytes,
#      the default (batched) strategy, then the fused one (one Triton kernel);
#   3. kvbridge bench transfer --device cuda --host-staging compare --gather-mib N:
#      connector loads vs raw NIXL READ / WRITE on VRAM, direct, host-staged and packed
#      (the per-layer formats' rows moved as one range through gather arenas);
#   4. when `import vllm` finds a CUDA build and a GPU: real vLLM prefill + decode servers
#      on the GPU (scripts/run_vllm_pd.sh, tiny generated models, TP 1; a Mamba2 hybrid
#      too), pull and push,
#      different block sizes and so different layouts (kvbridge asks vLLM for BHLNC at
#      block sizes 16-64 and LBHNC above; VLLM_KV_CACHE_LAYOUT forces one), greedy tokens
#      and logprobs compared with a single server; "skipped: no CUDA vLLM" otherwise.
#
# Python: $PYTHON (default: .venv/bin/python if present, else python3), which must hold a
# CUDA build of torch. The wheels in $WHEELS (default .whl/, made on a networked machine by
# `bash scripts/gpu_wheels.sh`: NIXL, msgspec, pyzmq, the example servers' HTTP stack and
# vllm-router) whose distributions $PYTHON lacks are installed into a private folder, never
# into the system, and put on the import path and PATH; what is still missing is named.
# Logs go to $OUT (default gpu_check_out/). Exit status: non-zero if a step failed.
#
#   bash scripts/gpu_check.sh            # everything (about 5-8 minutes on an H100)
#   QUICK=1 bash scripts/gpu_check.sh    # smaller benchmarks
#   bash scripts/gpu_check.sh vllm       # step 4 only (prints the skip line without a GPU)
#   bash scripts/gpu_check.sh setup      # the set-up alone: wheels, imports, the router;
#                                        # prints where each comes from (no GPU needed)
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT="${OUT:-gpu_check_out}"
WHEELS="${WHEELS:-.whl}"
mkdir -p "$OUT"

ONLY="${1:-}"
if [ -n "$ONLY" ] && [ "$ONLY" != vllm ] && [ "$ONLY" != setup ]; then
    echo "gpu_check: unknown argument $ONLY (one of: vllm, setup)" >&2
    exit 2
fi

if [ -z "$ONLY" ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: $PYTHON sees no CUDA device (torch.cuda.is_available() is False)" >&2
    exit 2
fi

SITE=""
ROOT_LINKS=""
trap 'rm -rf ${ROOT_LINKS:+"$ROOT_LINKS"} ${SITE:+"$(dirname "$SITE")"}' EXIT
# the wheels of $WHEELS whose distributions $PYTHON does not have (a host's own packages,
# say a vLLM's pinned pydantic, are never shadowed by ours)
MISSING_WHEELS=()
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    mapfile -t MISSING_WHEELS < <("$PYTHON" - "$WHEELS"/*.whl <<'EOF'
import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

for wheel in sys.argv[1:]:
    dist = re.sub(r"[-_.]+", "-", Path(wheel).name.split("-")[0]).lower()
    try:
        version(dist)
    except PackageNotFoundError:
        print(wheel)
EOF
    )
fi
if [ "${#MISSING_WHEELS[@]}" -gt 0 ]; then
    SITE="$(mktemp -d)/site"
    echo "gpu_check: installing ${#MISSING_WHEELS[@]} wheels of $WHEELS into $SITE"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" "${MISSING_WHEELS[@]}" || exit 2
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    # console scripts of those wheels (vllm-router: the example servers' front door)
    export PATH="$SITE/bin:$PATH"
fi
# kvbridge is not pip-installed on the lent machine (no network, no build backend there):
# a kvbridge/ namespace folder of links to the checkout's packages gives the same import
# root as an install (kvbridge.layouts, kvbridge.connector, ...); "." keeps tests importable.
ROOT_LINKS="$(mktemp -d)"
mkdir "$ROOT_LINKS/kvbridge"
for pkg in layouts handshake connector examples cli; do
    ln -s "$PWD/$pkg" "$ROOT_LINKS/kvbridge/$pkg"
done
export PYTHONPATH=".:$ROOT_LINKS${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# everything the tier imports, and the router; what is missing is named, with the fix
if ! "$PYTHON" - <<'EOF' 2>&1 | tee "$OUT/setup.txt"; then
import importlib
import shutil
import sys

NEEDED = ["nixl._api", "msgspec", "zmq", "fastapi", "uvicorn", "prometheus_client",
          "kvbridge.connector.worker.worker", "kvbridge.cli.bench"]
missing = []
print(f"python: {sys.executable} {sys.version.split()[0]}")
for name in NEEDED:
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        missing.append(name)
        print(f"{name}: MISSING ({type(exc).__name__}: {exc})")
        if "nixl-cu12" in str(exc):  # NIXL picks its build by the host's CUDA major
            print("  a CUDA 12 host: NIXL_CUDA=12 bash scripts/gpu_wheels.sh fetches nixl-cu12")
    else:
        print(f"{name}: {getattr(module, '__file__', '?')}")
try:  # as the example servers find it: next to this Python, else on PATH
    from kvbridge.examples.router import router_binary

    router = router_binary()
except Exception as exc:
    router = None
    print(f"vllm-router: MISSING ({exc})")
else:
    print(f"vllm-router: {router} (on PATH: {shutil.which('vllm-router') or 'none'})")
if missing or router is None:
    print("gpu_check: missing " + ", ".join(missing + ([] if router else ["vllm-router"]))
          + ": put their wheels in $WHEELS (bash scripts/gpu_wheels.sh where pip works)")
    sys.exit(2)
EOF
    exit 2
fi
if [ "$ONLY" = setup ]; then
    echo "gpu_check: set-up ok (wheels, imports, router)"
    exit 0
fi

if [ -z "$ONLY" ]; then
"$PYTHON" - <<'EOF' | tee "$OUT/device.txt"
import nixl, torch
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, nixl {getattr(nixl, '__version__', '?')}")
EOF
fi

failed=()
ran=0
step() {
    local name="$1"
    shift
    ran=$((ran + 1))
    echo "== $name: $*"
    if "$@" 2>&1 | tee "$OUT/$name.log"; then
        echo "== $name: ok"
    else
        echo "== $name: FAILED (log: $OUT/$name.log)"
        failed+=("$name")
    fi
}

if [ -z "$ONLY" ]; then
step tests "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests
if [ -n "${QUICK:-}" ]; then
    step layouts "$PYTHON" -m kvbridge.cli bench layouts --device cuda --quick
    step layouts-fused "$PYTHON" -m kvbridge.cli bench layouts --device cuda --quick \
        --strategy fused
    step transfer "$PYTHON" -m kvbridge.cli bench transfer --device cuda --layers 8 \
        --iterations 5 --host-staging compare --gather-mib 128
else
    step layouts "$PYTHON" -m kvbridge.cli bench layouts --device cuda
    step layouts-fused "$PYTHON" -m kvbridge.cli bench layouts --device cuda --strategy fused
    step transfer "$PYTHON" -m kvbridge.cli bench transfer --device cuda --host-staging compare \
        --gather-mib 512
fi
fi

# 4. vLLM on the GPU. run_vllm_pd.sh runs `.venv/bin/python -m kvbridge.examples.vllm.run_pd`;
# with another $PYTHON the step runs that module with it. Three servers share the GPU.
if "$PYTHON" - >"$OUT/vllm-probe.txt" 2>&1 <<'EOF'
import sys

import torch

try:
    from vllm.platforms import current_platform
except Exception as exc:  # no vLLM, or a build that does not import here
    print(f"import vllm failed: {type(exc).__name__}: {exc}")
    sys.exit(1)
print(f"vLLM platform {type(current_platform).__name__}, cuda {torch.cuda.is_available()}")
sys.exit(0 if current_platform.is_cuda() and torch.cuda.is_available() else 1)
EOF
then
    if [ "$PYTHON" = .venv/bin/python ]; then PD=(bash scripts/run_vllm_pd.sh); else
        PD=("$PYTHON" -m kvbridge.examples.vllm.run_pd); fi
    export KVBRIDGE_VLLM_SERVER_ARGS="${KVBRIDGE_VLLM_SERVER_ARGS:---gpu-memory-utilization 0.25}"
    # name, mode, prefill block, decode block, VLLM_KV_CACHE_LAYOUT ("-": kvbridge asks
    # vLLM), model (the Mamba2 hybrid runs with prefix caching on a GPU: "align" mode)
    CASES=(
        "pull-b32-b32 pull 32 32 - tiny-llama"
        "pull-b128-b32 pull 128 32 - tiny-llama"
        "push-b64-b128 push 64 128 - tiny-llama"
        "push-b32-b64-LBNHC push 32 64 LBNHC tiny-llama"
        "pull-b64-b32-BLHNC pull 64 32 BLHNC tiny-llama"
        "mamba-pull-b64-b128 pull 64 128 - tiny-granite-hybrid"
    )
    if [ -n "${QUICK:-}" ]; then CASES=("${CASES[1]}" "${CASES[2]}"); fi
    for case in "${CASES[@]}"; do
        read -r name mode pbs dbs layout model <<<"$case"
        envs=(PREFILL_BLOCK_SIZE="$pbs" DECODE_BLOCK_SIZE="$dbs" LOG_DIR="$OUT/vllm-pd-$name"
            MODEL="$model" KVBRIDGE_EXTRA="{\"transfer_mode\": \"$mode\"}")
        if [ "$layout" != - ]; then envs+=(VLLM_KV_CACHE_LAYOUT="$layout"); fi
        step "vllm-pd-$name" env "${envs[@]}" "${PD[@]}"
    done
else
    echo "== vllm-pd: skipped: no CUDA vLLM ($(tail -n 1 "$OUT/vllm-probe.txt"))"
fi

if [ "${#failed[@]}" -gt 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
if [ "$ran" -eq 0 ]; then
    echo "gpu_check: no step ran"
    exit 0
fi
echo "gpu_check: all $ran steps passed (logs in $OUT/)"
