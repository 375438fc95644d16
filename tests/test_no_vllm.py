"""Without vLLM (a GPU host running ``scripts/gpu_check.sh`` is the usual case), the suite
still collects: every module that needs vLLM is skipped by name, none fails collection.
Runs the GPU tier's own collection (``pytest -m gpu tests``) with vLLM made unimportable
(``tests/no_vllm.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# modules that import vLLM at their top (directly or through a helper): skipped by name
NEED_VLLM = [
    "tests/connector/vllm/test_translate.py",
    "tests/connector/vllm/test_host_buffer_ops.py",
    "tests/vllm_layouts/test_vllm_pairs.py",
    "tests/vllm_layouts/test_vllm_backends.py",
]


def _collect(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """``pytest --collect-only`` with ``tests.no_vllm`` loaded: the run and its whole output
    (bounded: collecting the suite takes about 35 s here)."""
    plugins = ["-p", "tests.no_vllm", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *plugins, "--collect-only", "-q", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done, done.stdout + done.stderr


def test_the_gpu_tier_collects_without_vllm_and_names_what_it_skips():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done, out = _collect(env, "-rs", "-m", "gpu", "tests")
    assert done.returncode == 0, out[-4000:]
    assert not re.search(r"^ERROR", out, re.M), out[-4000:]
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    for module in NEED_VLLM:
        named = [s for s in skipped if module in s and "needs vLLM" in s]
        assert named, f"{module} is not skipped by name: {skipped}"


def test_a_module_missing_inside_an_installed_vllm_fails_collection():
    """An installed vLLM whose API moved is a failure, never a skip."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "KVBRIDGE_TESTS_BLOCK": "vllm.config.kv_transfer",
    }
    done, out = _collect(env, NEED_VLLM[0])
    assert done.returncode != 0 and "vllm.config.kv_transfer" in out, out[-4000:]
    assert "needs vLLM" not in out, out[-4000:]
