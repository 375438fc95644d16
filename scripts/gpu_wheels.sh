#!/usr/bin/env bash
# Download, on a machine where pip reaches PyPI, every wheel scripts/gpu_check.sh installs
# on a GPU machine that has a CUDA torch but no network, for CPython 3.12 on x86-64 Linux,
# into .whl/ (ignored by git). Pass another Python version as $PY (e.g. PY=3.11).
#
#   NIXL           nixl and nixl-cu13 (no dependencies: torch and numpy come with the
#                  host's CUDA torch), rewritten without nixl_ep_cu13, NIXL's
#                  expert-parallel extensions kvbridge never imports (26 MiB of the 59;
#                  scripts/slim_nixl_wheel.py; SLIM=0 keeps them). NIXL_CUDA=12 fetches
#                  nixl-cu12 instead, for a host whose torch is built for CUDA 12
#   kvbridge       msgspec, pyzmq, and the example servers' HTTP stack and metrics
#                  (fastapi, uvicorn, prometheus_client), with their dependencies
#   the router     vllm-router (a Rust binary; setproctitle and orjson beside it)
#
# `bash scripts/gpu_check.sh setup` on the GPU machine says whether the folder is complete.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-3.12}"
NIXL_VERSION="${NIXL_VERSION:-1.5.1}"
ROUTER_VERSION="${ROUTER_VERSION:-0.1.17}"
NIXL_CUDA="${NIXL_CUDA:-13}"
case "$NIXL_CUDA" in
    12|13) ;;
    *) echo "gpu_wheels: NIXL_CUDA must be 12 or 13 (the host torch's CUDA major), not '$NIXL_CUDA'" >&2
       exit 2 ;;
esac
mkdir -p .whl
download() {
    python3 -m pip download -q --only-binary=:all: --python-version "$PY" \
        --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any \
        -d .whl "$@"
}
download --no-deps "nixl==$NIXL_VERSION" "nixl-cu$NIXL_CUDA==$NIXL_VERSION"
download --no-deps "vllm-router==$ROUTER_VERSION" setproctitle orjson
download msgspec pyzmq fastapi uvicorn prometheus_client
if [ "${SLIM:-1}" != 0 ]; then
    python3 scripts/slim_nixl_wheel.py .whl/nixl_cu"$NIXL_CUDA"-*.whl
fi
ls -l .whl
du -sh .whl
