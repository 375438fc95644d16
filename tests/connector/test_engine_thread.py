"""``extra.engine_thread_nice``: the engine's busy-waiting thread, and only it, yields."""

from __future__ import annotations

import os
import threading

import pytest

from kvbridge.connector.worker.engine_thread import lower_calling_thread_priority

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="needs setpriority")


def _in_thread(fn):
    """Run ``fn`` in a new thread (never renice the test runner's own thread); returns its
    result, the thread's nice before and after, and this thread's nice after."""
    out: dict = {}

    def run() -> None:
        out["before"] = os.getpriority(os.PRIO_PROCESS, 0)
        out["result"] = fn()
        out["after"] = os.getpriority(os.PRIO_PROCESS, 0)
        child = threading.Thread(
            target=lambda: out.update(child=os.getpriority(os.PRIO_PROCESS, 0))
        )
        child.start()  # a thread started afterwards inherits the new value
        child.join(timeout=10)

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive(), "the thread did not finish within 10 s"
    return out, os.getpriority(os.PRIO_PROCESS, 0)


def test_only_the_calling_thread_is_lowered():
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    target = min(19, mine + 5)
    out, after_here = _in_thread(lambda: lower_calling_thread_priority(target))
    assert out["before"] == mine
    assert out["result"] == out["after"] == target
    assert out["child"] == target
    assert after_here == mine  # the test runner's thread is untouched


def test_a_thread_already_lower_is_never_raised_and_zero_does_nothing():
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    if mine >= 19:
        pytest.skip("already at the lowest priority")

    def twice() -> int:
        lower_calling_thread_priority(19)
        return lower_calling_thread_priority(mine + 1)  # would raise the priority: no

    out, _ = _in_thread(twice)
    assert out["result"] == out["after"] == 19
    out, _ = _in_thread(lambda: lower_calling_thread_priority(0))
    assert out["result"] == out["after"] == mine
