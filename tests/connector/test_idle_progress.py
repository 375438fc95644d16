"""A background thread that dies says so: the worker reports itself unhealthy.

Before, the idle-progress thread stopped for good after one exception and only a log line
said so; an idle prefill then answered nothing and its decodes timed out.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvbridge.connector.worker.idle_progress import IdleProgress
from kvbridge.connector.worker.worker import KVBridgeWorker
from kvbridge.layouts.allocation import CacheFormat
from kvbridge.layouts.layout import KVLayout
from tests.connector.pair_harness import FakeClock, make_side


def _wait(condition, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.005)  # polling a background thread's state, bounded by the deadline


def test_a_dying_idle_thread_reports_why() -> None:
    reasons: list[str] = []

    def progress() -> None:
        raise RuntimeError("boom in a progress round")

    idle = IdleProgress(threading.RLock(), progress, 0.002, on_failure=reasons.append)
    idle.start()
    try:
        _wait(lambda: idle.failure is not None, "the idle thread's failure")
    finally:
        idle.close()
    assert reasons == [idle.failure]
    assert "RuntimeError: boom in a progress round" in idle.failure


def test_the_worker_is_unhealthy_once_its_idle_thread_died(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(self: KVBridgeWorker) -> None:
        raise ValueError("a bug in the worker's progress")

    monkeypatch.setattr(KVBridgeWorker, "_progress", broken)
    fmt = CacheFormat(layout=KVLayout.NHD, cross_layer=True)
    side = make_side("kv_producer", "p", 16, fmt, "F", FakeClock(), extra={"idle_progress_ms": 2})
    try:
        _wait(lambda: side.worker.unhealthy_reason is not None, "the worker to be unhealthy")
        assert "ValueError: a bug in the worker's progress" in side.worker.unhealthy_reason
        assert side.worker.metrics.background_thread_failures == 1
        assert "kvbridge_background_thread_failures_total 1.0" in side.worker.metrics.prometheus()
    finally:
        side.worker.shutdown()


def test_a_healthy_worker_says_so() -> None:
    fmt = CacheFormat(layout=KVLayout.NHD, cross_layer=True)
    side = make_side("kv_producer", "p", 16, fmt, "F", FakeClock(), extra={"idle_progress_ms": 2})
    try:
        assert side.worker.unhealthy_reason is None
    finally:
        side.worker.shutdown()


def test_a_late_wake_up_is_a_stall_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    """The thread wakes every interval; when it could not run (here its clock says its
    first wake-up came 3 s after it started waiting, as when the GIL was held through a
    long native call), it reports how late it was, each time, and logs it at most once in
    STALL_LOG_EVERY_S."""
    # the constructor, then per wake-up: the wait's start, its end. Two stalls 3 s apart:
    # both counted, one line logged (at most one every STALL_LOG_EVERY_S)
    readings = iter([0.0, 0.0, 3.0, 3.0, 6.0])

    def clock() -> float:
        return next(readings, 6.0)

    stalls: list[float] = []
    idle = IdleProgress(threading.RLock(), lambda: None, 0.002, clock=clock, on_stall=stalls.append)
    with caplog.at_level("WARNING", logger="kvbridge.connector.worker.idle_progress"):
        idle.start()
        try:
            _wait(lambda: len(stalls) == 2, "both stalls to be reported")
        finally:
            idle.close()
    assert stalls == [pytest.approx(3.0 - 0.002)] * 2  # later wake-ups were on time
    assert caplog.text.count("could not run for") == 1
    assert "could not run for 3.0 s" in caplog.text


def test_a_stall_shows_in_the_workers_metrics() -> None:
    fmt = CacheFormat(layout=KVLayout.NHD, cross_layer=True)
    side = make_side("kv_producer", "p", 16, fmt, "F", FakeClock(), extra={"idle_progress_ms": 2})
    try:
        side.worker._progress_stalled(2.5)
        text = side.worker.metrics.prometheus()
        assert "kvbridge_progress_stalls_total 1.0" in text
        assert "kvbridge_progress_stall_seconds_total 2.5" in text
    finally:
        side.worker.shutdown()
