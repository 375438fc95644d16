"""scripts/run_multihost.sh end to end (two namespaces, a rate-limited link, the example
servers and vllm-router, the exactness check), and its refusal without root."""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_integration_script import session_members

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "run_multihost.sh"


def run(
    env: dict[str, str], user: list[str] | None = None, timeout_s: float = 120
) -> tuple[int, str]:
    proc = subprocess.Popen(
        [*(user or []), "bash", str(SCRIPT)],
        cwd=REPO_ROOT,
        # every load proves its bytes (tests/verified_loads.py)
        env={**os.environ, "PYTHON": sys.executable, "VERIFY": "all", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pid in session_members(proc.pid):
            os.kill(pid, 9)
        proc.communicate()
        raise AssertionError(f"run_multihost.sh did not finish within {timeout_s} s") from None
    return proc.returncode, out


@pytest.mark.multihost
def test_push_across_a_rate_limited_link_is_exact_and_crosses_it():
    env = {"TRANSFER_MODE": "push", "RATE": "1gbit", "NUM_PROMPTS": "2", "MAX_TOKENS": "2",
           "NUM_BLOCKS": "256", "PREFILL_BLOCK_SIZE": "64", "DECODE_KV_LAYOUT": "HND"}  # fmt: skip
    rc, out = run(env)
    assert rc == 0, out
    assert "prompts matched: 2/2" in out and "RESULT: PASS" in out, out
    assert re.search(r"verified=[1-9]\d* verify_failures=0", out), out
    m = re.search(r"link: prefill's end sent (\d+) bytes; the connector moved (\d+) KV bytes", out)
    assert m and int(m[1]) >= int(m[2]) > 0, out
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    pid = re.search(r"netns (kvb-\d+)-p", out)
    assert pid and pid[1] not in ns, ns  # its namespaces are gone


def test_without_root_it_says_why_and_exits_3():
    """Run as is where this is not root, as ``nobody`` where it is."""
    user: list[str] = []
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("nobody")
        except KeyError:
            pytest.skip("no 'nobody' user to run the script without root")
        user = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    rc, out = run({}, user=user, timeout_s=30)
    assert rc == 3, out
    assert "run it as root" in out or "needs iproute2" in out, out
