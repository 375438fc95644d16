"""A bind that fails names the address and the process holding it: the side-channel
listener (and through it a worker's ``register_kv_caches``), and the vllm-router launcher's
fixed ``--port``. The holder is another OS process, so the pid named is not just our own."""

from __future__ import annotations

import selectors
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvbridge.examples import router
from kvbridge.handshake.errors import HandshakeError
from kvbridge.handshake.listener import HandshakeListener, ListenerConfig
from kvbridge.handshake.port_holder import bind_error_text, listening_pids, port_holder
from tests.handshake.descriptions import make_description

# listens on an ephemeral port, says which, and holds it until the test closes stdin
HOLDER = (
    "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
    "print(s.getsockname()[1], flush=True); sys.stdin.read()"
)
START_TIMEOUT_S = 30.0


@pytest.fixture
def held() -> Iterator[tuple[int, int]]:
    """(port, pid): a port another process listens on until the test ends."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "port-holder-marker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(child.stdout, selectors.EVENT_READ)
            assert sel.select(START_TIMEOUT_S), f"holder said nothing in {START_TIMEOUT_S} s"
        yield int(child.stdout.readline()), child.pid
    finally:
        child.kill()
        child.wait(timeout=10)


def test_port_holder_names_the_listening_process(held) -> None:
    port, pid = held
    assert port_holder(port).startswith(f"held by pid {pid} (")
    assert "port-holder-marker" in port_holder(port)


def test_listening_pids_names_the_listening_process_only(held) -> None:
    port, pid = held
    assert listening_pids(port) == [pid]
    assert listening_pids(0) == []


def test_listener_bind_error_names_address_and_holder(held) -> None:
    port, pid = held
    listener = HandshakeListener(ListenerConfig(port=port), make_description)
    with pytest.raises(HandshakeError) as err:
        listener.start()
    text = str(err.value)
    assert f"cannot bind handshake listener to 127.0.0.1:{port}" in text, text
    assert f"held by pid {pid} (" in text and "listening" in text, text
    assert not listener.is_alive


def test_worker_with_a_taken_kv_port_names_the_holder(held) -> None:
    from kvbridge.connector.worker.worker import KVBridgeWorker
    from tests.connector.conftest import MODEL, SideFormat, make_buffers, transfer_config

    port, pid = held
    worker = KVBridgeWorker(transfer_config("kv_producer", "taken", kv_port=port), MODEL)
    try:
        with pytest.raises(HandshakeError, match=rf"127\.0\.0\.1:{port}.*held by pid {pid} "):
            worker.register_kv_caches(make_buffers(SideFormat(block_size=16), "F", 8))
    finally:
        worker.shutdown()


def test_router_bind_error_names_the_holder(held, capsys) -> None:
    """Refused before vllm-router starts: the router binds only once every worker answers
    ``/health``, and these workers never will."""
    port, pid = held
    argv = ["--port", str(port), "--prefill", "http://127.0.0.1:1", "--decode", "http://h:1"]
    assert router.main(argv) == 2
    err = capsys.readouterr().err
    assert f"cannot bind vllm-router to 127.0.0.1:{port}" in err and f"pid {pid} " in err, err


def test_no_holder_lookup_for_other_errors() -> None:
    text = bind_error_text("x", "10.9.9.9", 5600, OSError(99, "Cannot assign requested address"))
    assert text == "cannot bind x to 10.9.9.9:5600: [Errno 99] Cannot assign requested address"
