"""Side-channel threads escape the core an engine pinned its step thread to."""

from __future__ import annotations

import os
import threading

import pytest

from kvbridge.handshake.affinity import unpinned
from kvbridge.handshake.listener import HandshakeListener, ListenerConfig
from tests.handshake.descriptions import make_description

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2,
    reason="needs Linux affinity and at least 2 CPUs",
)


def _thread_affinities(name_prefix: str) -> list[set[int]]:
    out = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip().startswith(name_prefix):
                out.append(os.sched_getaffinity(int(tid)))
    return out


def _pinned_run(fn):
    """Run ``fn`` in a thread pinned to CPU 0 (as vLLM pins its worker); return its result."""
    result: dict[str, object] = {}

    def body() -> None:
        os.sched_setaffinity(0, {0})
        result["value"] = fn()
        result["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=body)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "pinned helper thread did not finish within 30 s"
    return result


def test_threads_started_inside_unpinned_run_everywhere_and_caller_is_restored():
    all_cpus = set(range(os.cpu_count() or 1))
    seen: dict[str, set[int]] = {}

    def start_child() -> None:
        with unpinned():
            child = threading.Thread(
                target=lambda: seen.setdefault("child", os.sched_getaffinity(0))
            )
            child.start()
        child.join(timeout=10)

    result = _pinned_run(start_child)
    assert seen["child"] == all_cpus
    assert result["after"] == {0}


def test_listener_and_its_zmq_io_thread_are_not_pinned_with_the_engine():
    listener = HandshakeListener(
        ListenerConfig(host="127.0.0.1", port=0), describe=make_description
    )
    try:
        _pinned_run(listener.start)
        all_cpus = set(range(os.cpu_count() or 1))
        serving = [t for t in threading.enumerate() if t.name.startswith("kvbridge-handshake")]
        assert [os.sched_getaffinity(t.native_id) for t in serving] == [all_cpus]
        io_threads = _thread_affinities("ZMQbg/IO")
        assert io_threads and all(a == all_cpus for a in io_threads)
    finally:
        listener.close()
