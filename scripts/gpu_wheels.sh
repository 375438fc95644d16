#!/usr/bin/env bash
# Download, on a machine where pip reaches PyPI, the wheels scripts/gpu_check.sh installs
# on a GPU machine that has a CUDA torch but no network: NIXL (the CUDA 13 build and its
# selector package), msgspec and pyzmq, for CPython 3.12 on x86-64 Linux, into .whl/
# (ignored by git). Pass another Python version as $PY (e.g. PY=3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-3.12}"
NIXL_VERSION="${NIXL_VERSION:-1.5.1}"
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version "$PY" \
    --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 \
    -d .whl "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION" msgspec pyzmq
ls -l .whl
