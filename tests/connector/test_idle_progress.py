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


# -- busy progress (extra.busy_progress_us) ---------------------------------------------------


class _Rounds:
    """Counts progress rounds; ``wait_for(n)`` waits (bounded) until there were ``n``."""

    def __init__(self) -> None:
        self.count = 0
        self._cond = threading.Condition()

    def __call__(self) -> None:
        with self._cond:
            self.count += 1
            self._cond.notify_all()

    def wait_for(self, n: int, what: str, timeout_s: float = 5.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.count >= n, timeout_s):
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _engine_steps(lock: threading.RLock, idle: IdleProgress, steps: int) -> None:
    """An engine that calls in every millisecond (each call takes the lock, as the
    worker's engine calls do): idle progress never comes due."""
    for _ in range(steps):
        with lock:
            idle.touch()
        time.sleep(0.001)  # the engine's step between calls; the thread runs meanwhile


@pytest.mark.parametrize("busy", [True, False])
def test_a_busy_worker_progresses_between_the_engines_calls(busy: bool) -> None:
    """A stepping engine keeps idle progress away (its interval here is a minute); while
    a transfer is in flight the thread still runs a round every busy interval, between
    the engine's calls. Not busy: no round at all while the engine steps."""
    lock, rounds = threading.RLock(), _Rounds()
    idle = IdleProgress(lock, rounds, 60.0, busy=lambda: busy, busy_interval_s=0.0002)
    idle.start()
    try:
        if busy:
            stepping = threading.Thread(target=_engine_steps, args=(lock, idle, 2000))
            stepping.start()
            try:
                rounds.wait_for(20, "20 busy rounds while the engine steps")
            finally:
                stepping.join()
        else:
            _engine_steps(lock, idle, 200)
    finally:
        idle.close()
    assert rounds.count >= 20 if busy else rounds.count == 0


@pytest.mark.parametrize("kicked", [True, False])
def test_an_engine_call_that_leaves_work_in_flight_starts_the_busy_rounds(
    monkeypatch: pytest.MonkeyPatch, kicked: bool
) -> None:
    """No idle progress, nothing in flight: the thread only looks for work every
    IDLE_CHECK_S (a minute here). An engine call that leaves a transfer in flight kicks
    it, and the busy rounds start at once; without the kick the thread sleeps on."""
    from kvbridge.connector.worker import idle_progress

    monkeypatch.setattr(idle_progress, "IDLE_CHECK_S", 60.0)
    in_flight = threading.Event()
    lock, rounds = threading.RLock(), _Rounds()
    idle = IdleProgress(lock, rounds, 0.0, busy=in_flight.is_set, busy_interval_s=0.0002)
    idle.start()
    try:
        in_flight.set()  # the engine's call started a load
        if kicked:
            idle.kick()  # what engine_call does when the call returns
            rounds.wait_for(3, "the busy rounds after the kick")
        else:
            with pytest.raises(AssertionError, match=r"timed out after 0\.5 s"):
                rounds.wait_for(1, "a round without a kick", timeout_s=0.5)
    finally:
        idle.close()
    assert rounds.count >= 3 if kicked else rounds.count == 0


def test_the_worker_is_busy_exactly_while_a_transfer_is_in_flight() -> None:
    """What the thread asks (``KVBridgeWorker._in_flight``): a prefill with a request
    lent to readers is busy until it is freed."""
    from kvbridge.connector.common.params import KVTransferParams
    from tests.connector.pair_harness import Request, prefill_finish, token_ids

    fmt = CacheFormat(layout=KVLayout.NHD, cross_layer=True)
    side = make_side("kv_producer", "p", 16, fmt, "F", FakeClock(), lease_s=30.0)
    try:
        assert not side.worker._in_flight()
        request = Request("p1", token_ids(40), KVTransferParams(do_remote_decode=True))
        prefill_finish(side, request)
        side.step()  # hands the worker its SendSpec: lent to readers
        assert side.worker._in_flight()
        side.worker.abort_send("p1")
        assert not side.worker._in_flight()
    finally:
        side.worker.shutdown()
