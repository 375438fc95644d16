"""scripts/run_integration.sh end to end: prefill, decode and vllm-router as real processes, NIXL
between them, output and per-step logits checked against the single-process reference."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "run_integration.sh"
RUN_TIMEOUT_S = 100


def session_members(sid: int) -> list[int]:
    """Pids of live processes whose session is ``sid`` (the script's own session)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
            pids.append(int(entry.name))
    return pids


def run_script(**env: str) -> tuple[int, str]:
    full_env = {
        **os.environ,
        "PYTHON": sys.executable,
        "NUM_PROMPTS": "6",
        "MAX_TOKENS": "8",
        "NUM_BLOCKS": "256",
        "VERIFY": "all",  # every load proves its bytes (tests/verified_loads.py)
        **env,
    }
    proc = subprocess.Popen(
        ["bash", str(SCRIPT)],
        cwd=REPO_ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own session: every process it starts can be found
    )
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for pid in session_members(proc.pid):
            os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"run_integration.sh ran past {RUN_TIMEOUT_S} s:\n{out}")
    deadline = time.monotonic() + 5
    while (left := session_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind by run_integration.sh: {left}\n{out}"
    return proc.returncode, out


MATRIX = {
    "hetero-64-NHD-cross-to-16k8-HND": dict(
        MODEL="tiny-hybrid",
        PREFILL_BLOCK_SIZE="64",
        PREFILL_KV_LAYOUT="NHD",
        PREFILL_CROSS_LAYERS="1",
        DECODE_BLOCK_SIZE="16",
        DECODE_KERNEL_BLOCK_SIZE="8",
        DECODE_KV_LAYOUT="HND",
        DECODE_CROSS_LAYERS="0",
    ),
    "state-16-HND-to-32-NHD-cross": dict(
        MODEL="tiny-hybrid-state",
        PREFILL_BLOCK_SIZE="16",
        PREFILL_KV_LAYOUT="HND",
        DECODE_BLOCK_SIZE="32",
        DECODE_KERNEL_BLOCK_SIZE="16",
        DECODE_KV_LAYOUT="NHD",
        DECODE_CROSS_LAYERS="1",
    ),
    "equal-16-NHD-cross": dict(MODEL="tiny-dense", CROSS_LAYERS="1"),
    # block sizes that are not multiples of each other (wire chunks of gcd = 16 tokens)
    "state-80k16-NHD-to-32-HND-cross": dict(
        MODEL="tiny-hybrid-state",
        PREFILL_BLOCK_SIZE="80",
        PREFILL_KERNEL_BLOCK_SIZE="16",
        PREFILL_KV_LAYOUT="NHD",
        DECODE_BLOCK_SIZE="32",
        DECODE_KV_LAYOUT="HND",
        DECODE_CROSS_LAYERS="1",
    ),
}
# push mode: prefill WRITEs into decode's blocks, same checks
MATRIX["push-hetero-64-NHD-cross-to-16k8-HND"] = {
    **MATRIX["hetero-64-NHD-cross-to-16k8-HND"],
    "TRANSFER_MODE": "push",
}
MATRIX["push-state-80k16-NHD-to-32-HND-cross"] = {
    **MATRIX["state-80k16-NHD-to-32-HND-cross"],
    "TRANSFER_MODE": "push",
}


@pytest.mark.parametrize("env", list(MATRIX.values()), ids=list(MATRIX))
def test_pair_matches_the_reference(env):
    rc, out = run_script(**env)
    assert rc == 0, out
    assert f"mode={env.get('TRANSFER_MODE', 'pull')}" in out, out
    assert "prompts matched: 6/6" in out and "RESULT: PASS" in out, out
    summary = re.search(
        r"SUMMARY matched=6/6 loaded=(\d+)/(\d+) bytes=(\d+) .* transfers=(\d+)", out
    )
    assert summary, out
    loaded, expected, num_bytes, transfers = map(int, summary.groups())
    # every prompt token but the last (which decode computes) came over the wire or
    # from decode's own prefix cache: none left behind
    assert loaded == expected > 0, out
    assert num_bytes > 0 and transfers > 0, out
    # each load proved, by prefill's digests, that decode holds what prefill sent
    verified = re.search(r"verified=(\d+) verify_failures=(\d+)", out)
    assert verified and (int(verified[1]), int(verified[2])) == (transfers, 0), out


def test_a_corrupted_block_fails_the_check():
    rc, out = run_script(MODEL="tiny-hybrid", FAULT_INJECT="corrupt-block")
    assert rc != 0, out
    assert "MISMATCH" in out and "RESULT: FAIL" in out, out
