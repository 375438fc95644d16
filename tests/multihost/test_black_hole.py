"""Adding a peer's agent behind a black-holed link returns at once.

NIXL's ``add_remote_agent`` creates the UCX endpoints to the peer. With UCX's default
(``UCX_TCP_CONN_NB=n``) that is a blocking TCP ``connect()`` under NIXL's agent lock:
against an address that drops packets the call, and every other NIXL call of the agent
with it, waited for the kernel's SYN retries (134 s by default; docs/nixl-holds.md).
kvbridge's UCX backends connect non-blocking (``nixl_calls.UCX_ENGINE_CONFIG``). Two processes, one
per namespace: prefill's agent published its metadata while the link was up, the link is
cut (every packet dropped, both ways), then decode adds prefill's agent and times it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.examples.netns import Link

pytestmark = pytest.mark.multihost

CHILD = [sys.executable, "-m", "tests.multihost._agent_side"]
REPO = Path(__file__).resolve().parents[2]
READY_S = 60.0  # an agent's start (import nixl, UCX backend) on a busy 2-core machine


@pytest.fixture
def link() -> Iterator[Link]:
    link = Link()
    try:
        yield link
    finally:
        link.close()


def _start(
    link: Link, side: str, folder: Path, env: dict[str, str], op: str = "add"
) -> subprocess.Popen:
    # the child sees kvbridge's default unless the test sets it: whatever UCX_TCP_* the
    # machine's environment has is left out
    extra = ["-u", "UCX_TCP_CONN_NB", "-u", "UCX_TCP_SYN_CNT"]
    extra += [f"{k}={v}" for k, v in env.items()]
    argv = link.argv(side, "env", *extra, *CHILD, side, str(folder), op)
    return subprocess.Popen(
        argv, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def _line(proc: subprocess.Popen, what: str, timeout_s: float) -> str:
    """The child's next ``kvb:`` line (NIXL logs to stdout too), read with a deadline: a
    held call never answers."""
    out: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("kvb:"):
                out.append(line.removeprefix("kvb:").strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert out, f"no {what} from side {proc.args[-2]!r} within {timeout_s} s"
    return out[0]


def _behind_a_cut(
    link: Link, folder: Path, env: dict[str, str], timeout_s: float, op: str = "add"
) -> dict:
    """Decode's ``op`` (``add`` prefill's agent; ``remove`` it, connected before the cut)
    made after the link was cut: its seconds (``op_s``) and error."""
    prefill = _start(link, "p", folder, env)
    decode = None
    try:
        assert _line(prefill, "ready", READY_S) == "ready"
        decode = _start(link, "d", folder, env, op)
        assert _line(decode, "ready", READY_S) == "ready"
        link.cut()
        decode.stdin.write("go\n")
        decode.stdin.flush()
        return json.loads(_line(decode, "add_peer's result", timeout_s))
    finally:
        for proc in (decode, prefill):
            if proc is not None:
                proc.kill()
        for proc in (decode, prefill):
            if proc is not None:
                proc.communicate(timeout=30)  # reaps it and closes its pipes


def test_adding_an_agent_behind_a_black_hole_returns_at_once(link, tmp_path):
    result = _behind_a_cut(link, tmp_path, {}, timeout_s=30.0)
    assert result["op_s"] < 1.0 and not result["error"], result


def test_a_blocking_connect_waits_for_the_black_hole(link, tmp_path):
    """The same with UCX's own default: the call waits out the kernel's SYN retries (one
    retry here: about 3 s) and fails. What kvbridge's default avoids, shown on this host."""
    env = {"UCX_TCP_CONN_NB": "n", "UCX_TCP_SYN_CNT": "1"}
    result = _behind_a_cut(link, tmp_path, env, timeout_s=60.0)
    assert result["op_s"] > 2.0 and result["error"], result


def test_removing_a_connected_agent_behind_a_black_hole_returns_at_once(link, tmp_path):
    """A peer that went silent mid-connection (a partition) is removed without waiting on
    it: ``remove_remote_agent`` keeps the GIL, so a wait here would stop every thread."""
    result = _behind_a_cut(link, tmp_path, {}, timeout_s=30.0, op="remove")
    assert result["op_s"] < 1.0 and not result["error"], result
