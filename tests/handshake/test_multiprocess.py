"""A listener in a real second OS process; this process handshakes with it over TCP."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvbridge.handshake.client import ClientConfig, HandshakeClient
from kvbridge.handshake.errors import HandshakeTimeoutError
from kvbridge.handshake.framing import HandshakeSecurity

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
SECRET = "m" * 32
START_TIMEOUT_S = 30.0

# The child publishes a description naming its pid, prints its port, serves until stdin closes.
CHILD = """
import os, sys
from kvbridge.handshake import *
engine_id, secret = sys.argv[1], sys.argv[2].encode()
description = WorkerDescription(
    protocol_version=PROTOCOL_VERSION, engine_id=engine_id, agent_name=f"agent-{os.getpid()}",
    rank=0, tp_size=1, model_name="tiny", dtype="float16", num_layers=2, num_kv_heads=2,
    head_size=64, compat_hash="abc", block_size=16, kernel_block_size=16, kv_layout="NHD",
    kv_packing="kv_split", cross_layer=False, groups=[], regions=[],
    nixl_metadata=os.urandom(64),
)
config = ListenerConfig(port=0, security=HandshakeSecurity(secret=secret))
with HandshakeListener(config, lambda: description) as listener:
    print(listener.port, flush=True)
    sys.stdin.read()
"""


@contextmanager
def child_listener(engine_id: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}  # the tests package
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, engine_id, SECRET],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=env,
    )
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            assert selector.select(START_TIMEOUT_S), "child listener did not start in time"
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"child printed {line!r}, exit code {proc.poll()}"
        yield proc, int(line)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()  # asks the child to close its listener and exit
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()


def client() -> HandshakeClient:
    security = HandshakeSecurity(secret=SECRET.encode())
    return HandshakeClient(ClientConfig(timeout_s=5.0, retries=1, security=security))


def test_handshake_with_a_listener_in_another_process() -> None:
    with child_listener("prefill-mp") as (proc, port), client() as hs:
        description = hs.get("prefill-mp", 0, "127.0.0.1", port)
        assert description.engine_id == "prefill-mp"
        assert description.agent_name == f"agent-{proc.pid}" != f"agent-{os.getpid()}"
        assert len(description.nixl_metadata) == 64
    assert proc.returncode == 0  # closed its listener cleanly when asked


def test_dead_peer_costs_a_timeout_and_a_restarted_peer_is_handshaken_again() -> None:
    with client() as hs:
        with child_listener("prefill-mp") as (first, port):
            old = hs.get("prefill-mp", 0, "127.0.0.1", port)
            first.kill()
            first.wait(timeout=5)
        fast = ClientConfig(timeout_s=0.2, retries=0, security=hs.config.security)
        with HandshakeClient(fast) as probe, pytest.raises(HandshakeTimeoutError):
            probe.fetch("127.0.0.1", port)
        with child_listener("prefill-mp") as (second, new_port):
            hs.forget("prefill-mp", 0)
            new = hs.get("prefill-mp", 0, "127.0.0.1", new_port)
            assert new.agent_name == f"agent-{second.pid}" != old.agent_name
