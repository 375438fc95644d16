"""A background thread that dies says so: the worker reports itself unhealthy.

Before, the idle-progress thread stopped for good after one exception and only a log line
said so; an idle prefill then answered nothing and its decodes timed out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

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
    """Counts progress rounds (and when each started); ``wait_for(n)`` waits, bounded,
    until there were ``n``. ``work_s``: how long each round keeps the thread busy."""

    def __init__(self, work_s: float = 0.0) -> None:
        self.count = 0
        self.starts: list[float] = []
        self.work_s = work_s
        self._cond = threading.Condition()

    def __call__(self) -> None:
        self.starts.append(time.perf_counter())
        if self.work_s:
            deadline = time.perf_counter() + self.work_s
            while time.perf_counter() < deadline:  # a round's own work, on the CPU
                pass
        with self._cond:
            self.count += 1
            self._cond.notify_all()

    def wait_for(self, n: int, what: str, timeout_s: float = 5.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.count >= n, timeout_s):
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _engine(lock: threading.RLock, idle: IdleProgress, stop: threading.Event, steps: int) -> None:
    """An engine that calls in every millisecond as the worker's engine calls do (touch
    under the lock, kick after it), until ``stop`` or ``steps`` calls."""
    for _ in range(steps):
        if stop.is_set():
            return
        with lock:
            idle.touch()
        idle.kick()
        time.sleep(0.001)  # the engine's step between calls; the thread runs meanwhile


def _first_look(busy: threading.Event) -> tuple[threading.Event, Callable[[], bool]]:
    """``busy.is_set`` that also says when the thread first asked (its start-up is over)."""
    asked = threading.Event()

    def is_busy() -> bool:
        asked.set()
        return busy.is_set()

    return asked, is_busy


@pytest.mark.parametrize("busy", [True, False])
def test_a_busy_worker_progresses_between_the_engines_calls(busy: bool) -> None:
    """A stepping engine keeps idle progress away (its interval here is a minute); while
    a transfer is in flight the thread still runs rounds in the engine's gaps (1 ms, the
    busy interval 0.2 ms). Not busy: no round at all while the engine steps."""
    lock, rounds, stop = threading.RLock(), _Rounds(), threading.Event()
    idle = IdleProgress(lock, rounds, 60.0, busy=lambda: busy, busy_interval_s=0.0002)
    idle.start()
    stepping = threading.Thread(target=_engine, args=(lock, idle, stop, 200))
    stepping.start()
    try:
        if busy:
            rounds.wait_for(20, "20 busy rounds while the engine steps")
    finally:
        if busy:
            stop.set()
        stepping.join()
        idle.close()
    assert rounds.count >= 20 if busy else rounds.count == 0


def test_no_busy_round_while_the_engine_calls_more_often_than_the_interval() -> None:
    """The engine's own calls advance the transfers: with a busy interval of 10 ms and
    the engine calling every millisecond (each call kicking), the thread adds no round."""
    lock, rounds, stop = threading.RLock(), _Rounds(), threading.Event()
    idle = IdleProgress(lock, rounds, 0.0, busy=lambda: True, busy_interval_s=0.01)
    idle.start()
    try:
        _engine(lock, idle, stop, 200)
    finally:
        idle.close()
    assert rounds.count == 0


def test_the_first_busy_round_comes_one_interval_after_the_engines_last_call() -> None:
    """The engine calls every 10 ms (no busy round: the interval is 100 ms), then makes a
    last call right after the thread looked and went back to sleep. The first round comes
    one interval after that call, not after a second full interval counted from the
    thread's own wake-up (which made a peer wait up to two intervals for an answer)."""
    interval = 0.1
    looked = threading.Event()

    def is_busy() -> bool:
        looked.set()
        return True

    lock, rounds = threading.RLock(), _Rounds()
    idle = IdleProgress(lock, rounds, 0.0, busy=is_busy, busy_interval_s=interval)
    with lock:
        idle.touch()
    idle.start()
    try:
        for _ in range(30):  # 300 ms of an engine calling every 10 ms
            with lock:
                idle.touch()
            time.sleep(0.01)  # the engine's step between calls
        assert rounds.count == 0
        looked.clear()
        assert looked.wait(5.0), "timed out after 5 s waiting for the thread's next look"
        with lock:
            idle.touch()  # the last call: the thread is asleep until its next look
        last_call = time.perf_counter()
        rounds.wait_for(1, "the first busy round after the engine's last call")
    finally:
        idle.close()
    gap = rounds.starts[0] - last_call
    # last_call is read just after the touch: the round may start a few us "early"
    assert interval - 0.002 <= gap < 1.5 * interval, gap


def test_an_idle_interval_shorter_than_the_busy_one_neither_spins_nor_waits_longer() -> None:
    """Idle progress after 5 ms, busy rounds after 10 ms, an engine calling every 8 ms:
    the thread runs a round once the engine has been quiet 5 ms (the shorter interval),
    and sleeps in between: it looks for work a few times per call, not in a loop holding
    the GIL (which it did between 5 and 8 ms after each call)."""
    looks = [0]

    def is_busy() -> bool:
        looks[0] += 1
        return True

    lock, rounds = threading.RLock(), _Rounds()
    idle = IdleProgress(lock, rounds, 0.005, busy=is_busy, busy_interval_s=0.01)
    idle.start()
    try:
        for _ in range(15):  # 120 ms of an engine calling every 8 ms
            with lock:
                idle.touch()
            time.sleep(0.008)  # the engine's step between calls
    finally:
        idle.close()
    assert rounds.count >= 5, rounds.count  # one in most 3 ms quiet gaps
    assert looks[0] < 200, looks[0]  # ~3 looks per call; a spinning thread makes thousands


def test_busy_rounds_skip_while_the_engine_holds_the_lock() -> None:
    """The thread only tries the lock: while an engine call holds it, no round runs (and
    the thread does not wait for it); once released, the rounds resume."""
    lock, rounds = threading.RLock(), _Rounds()
    idle = IdleProgress(lock, rounds, 0.0, busy=lambda: True, busy_interval_s=0.0002)
    with lock:
        idle.start()
        try:
            with pytest.raises(AssertionError, match=r"timed out after 0\.5 s"):
                rounds.wait_for(1, "a round while the lock is held", timeout_s=0.5)
        except BaseException:
            idle.close()
            raise
    try:
        rounds.wait_for(3, "rounds once the lock is free")
    finally:
        idle.close()


def test_busy_rounds_take_at_most_their_share_of_the_thread() -> None:
    """Rounds of 4 ms with a busy interval of 0.1 ms: each next round waits at least
    4 ms * (1 - share) / share, so a worker with much in flight cannot make the thread
    spin on the GIL."""
    from kvbridge.connector.worker.idle_progress import MAX_BUSY_SHARE

    lock, rounds = threading.RLock(), _Rounds(work_s=0.004)
    idle = IdleProgress(lock, rounds, 0.0, busy=lambda: True, busy_interval_s=0.0001)
    idle.start()
    try:
        rounds.wait_for(4, "four busy rounds")
    finally:
        idle.close()
    least = 0.004 + 0.004 * (1 - MAX_BUSY_SHARE) / MAX_BUSY_SHARE
    gaps = [b - a for a, b in zip(rounds.starts, rounds.starts[1:], strict=False)]
    assert min(gaps) >= least, gaps


@pytest.mark.parametrize("kicked", [True, False])
def test_an_engine_call_that_leaves_work_in_flight_starts_the_busy_rounds(
    monkeypatch: pytest.MonkeyPatch, kicked: bool
) -> None:
    """No idle progress, nothing in flight: the thread only looks for work every
    IDLE_CHECK_S (a minute here). An engine call that leaves a transfer in flight kicks
    it, and the busy rounds start; without the kick the thread sleeps on."""
    from kvbridge.connector.worker import idle_progress

    monkeypatch.setattr(idle_progress, "IDLE_CHECK_S", 60.0)
    in_flight = threading.Event()
    asked, is_busy = _first_look(in_flight)
    lock, rounds = threading.RLock(), _Rounds()
    idle = IdleProgress(lock, rounds, 0.0, busy=is_busy, busy_interval_s=0.0002)
    idle.start()
    try:
        assert asked.wait(5.0), "timed out after 5 s waiting for the thread's first look"
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


def test_an_error_in_the_busy_check_makes_the_worker_unhealthy() -> None:
    reasons: list[str] = []

    def broken() -> bool:
        raise RuntimeError("boom in busy()")

    idle = IdleProgress(
        threading.RLock(),
        lambda: None,
        0.0,
        busy=broken,
        busy_interval_s=0.001,
        on_failure=reasons.append,
    )
    idle.start()
    try:
        _wait(lambda: idle.failure is not None, "the thread's failure")
    finally:
        idle.close()
    assert reasons == [idle.failure] and "RuntimeError: boom in busy()" in idle.failure


def test_the_worker_is_busy_exactly_while_a_transfer_is_in_flight() -> None:
    """What the thread asks (``KVBridgeWorker._in_flight``): a prefill with a request
    lent to readers is busy until it is freed, and not while a peer's set-up holds the
    agent gate (a round would only be deferred)."""
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
        with side.worker._gate.setup():
            assert not side.worker._in_flight()
        assert side.worker._in_flight()
        side.worker.abort_send("p1")
        assert not side.worker._in_flight()
    finally:
        side.worker.shutdown()
