"""The soak script, shortened for CI: it must pass (outputs equal the reference, no block
or NIXL handle left, memory flat) and report that it injected faults and aborts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_soak_passes_with_faults_and_aborts(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/soak.py",
            "--duration-s",
            "20",
            "--concurrency",
            "16",
            "--fault-every-s",
            "2",
            "--log-dir",
            str(tmp_path),
            "--verify",
            "all",  # every load proves its bytes (tests/verified_loads.py)
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = re.search(
        r"completed=(\d+) aborted=(\d+) mismatched=(\d+) errors=(\d+) faults=(\d+)", out
    )
    assert summary, out[-4000:]
    completed, aborted, mismatched, errors, faults = map(int, summary.groups())
    assert completed > 50 and aborted > 0 and faults >= 4
    assert mismatched == 0 and errors == 0
    assert "leaked_blocks={'prefill': 0, 'decode': 0}" in out
    assert "live_handles={'prefill': 0, 'decode': 0}" in out
    verified = re.search(r"verified=(\d+) verify_failures=(\d+)", out)
    assert verified and int(verified[1]) > 0 and int(verified[2]) == 0, out[-4000:]
