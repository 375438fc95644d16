"""Progress between the engine's calls: for an engine that stops stepping, and for a peer
that should not wait for the engine's next step.

kvbridge's worker advances transfers (reads notifications, answers ``Prepare``, polls
reads, flushes its outbox) when the engine calls it each step. Two things that are not
enough:

- **An idle engine does not step**: vLLM, once a prefill request has finished, waits for
  new requests, so a decode's ``Prepare`` would wait until the next request arrives.
  :class:`IdleProgress` runs the worker's progress whenever the engine has not called in
  for ``interval_s`` (``extra.idle_progress_ms``).
- **A busy engine steps once per forward** (tens of milliseconds for a large prefill), and
  every claim, ``Push`` and WRITE completion waited for that step: on a quiet pair, a
  load's fixed cost was prefill's step interval, not the link. While the worker has a
  transfer in flight (``busy()``), the thread runs a round once the engine has not called
  for ``busy_interval_s`` (``extra.busy_progress_us``), every ``busy_interval_s``, so a
  peer is answered within about that time (the wait runs from the engine's last call, not
  from the thread's last look). An engine call that leaves the worker busy
  ends the thread's idle wait (its first busy round still comes one interval after that call).
  Busy rounds take at most ``MAX_BUSY_SHARE`` of the thread's time: after a round of
  ``r`` seconds the next one waits at least ``r * (1 - share) / share``, so a worker with
  many transfers in flight (or a peer that answers nothing) cannot turn the thread into a
  spinner holding the GIL.

The engine's calls and this thread share one lock, so the worker is never entered twice at
once. The thread only ever *tries* the lock: a round the engine's call overlaps is skipped,
not queued. An engine call that comes during a thread round waits for that one round
(``kvbridge_engine_call_seconds`` includes the wait).

The thread also reports when it could not run: it wakes every ``interval_s``, so a wake-up
``STALL_S`` or more late means it could not get the GIL or a CPU (the GIL held through a
long native call, e.g. an Inductor-compiled kernel of the engine's forward, which keeps
it; or the process starved of CPU). Every transfer step kvbridge takes in this process waited as
long; the stall is logged and counted so that a slow load can be told from a slow network.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvbridge.handshake.affinity import unpin_current_thread

logger = logging.getLogger(__name__)

MAX_BUSY_SHARE = 0.5  # busy rounds take at most this share of the thread's time
IDLE_CHECK_S = 0.05  # no idle progress: how often a quiet thread looks for work (or a kick)
STALL_S = 1.0  # a wake-up this much later than due is a stall: logged and counted
STALL_LOG_EVERY_S = 10.0  # at most one warning this often (every stall is counted)


class IdleProgress:
    __slots__ = (
        "_busy",
        "_busy_cadence",
        "_busy_interval_s",
        "_clock",
        "_interval_s",
        "_last_call",
        "_lock",
        "_on_failure",
        "_on_stall",
        "_progress",
        "_stall_logged_at",
        "_stalls_unlogged",
        "_stop",
        "_thread",
        "_wake",
        "failure",
    )

    def __init__(
        self,
        lock: threading.RLock,
        progress: Callable[[], None],
        interval_s: float,
        *,
        busy: Callable[[], bool] = lambda: False,
        busy_interval_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        on_failure: Callable[[str], None] = lambda reason: None,
        on_stall: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        """``interval_s``: a round once the engine has not called for that long (0: never
        for that reason). ``busy()``: whether a transfer is in flight; while it is, a round
        every ``busy_interval_s`` (0: never for that reason) once the engine has not
        called for as long. ``on_failure(reason)``: the thread died (a bug in a progress
        round); the worker then reports itself unhealthy, and progress is left to the
        engine's calls.
        ``on_stall(seconds)``: the thread woke ``seconds`` (>= ``STALL_S``) later than due."""
        self._lock = lock
        self._on_failure = on_failure
        self._on_stall = on_stall
        self._stall_logged_at = -STALL_LOG_EVERY_S
        self._stalls_unlogged = 0
        self.failure: str | None = None  # why the thread stopped, if it died
        self._progress = progress
        self._interval_s = interval_s
        self._busy = busy
        self._busy_interval_s = busy_interval_s
        self._busy_cadence = False  # the thread waits a busy interval (no kick needed)
        self._clock = clock
        self._last_call = clock()
        self._stop = False
        self._wake = threading.Event()  # an engine call left work in flight, or close()
        self._thread = threading.Thread(target=self._run, name="kvbridge-idle", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def touch(self) -> None:
        """The engine called in: no idle progress needed for another interval."""
        self._last_call = self._clock()

    def kick(self) -> None:
        """An engine call is over (called outside the lock): if it left a transfer in
        flight while the thread waits in its idle cadence, end that wait."""
        if self._busy_interval_s and not self._busy_cadence and not self._wake.is_set():
            if self._busy():
                self._wake.set()

    def _run(self) -> None:
        unpin_current_thread()  # never on a core the engine pinned for itself
        try:
            self._loop()
        except Exception as exc:  # a bug: say so loudly, and leave progress to the engine
            logger.exception("idle progress failed; stopping it: the worker is unhealthy")
            self.failure = f"idle progress thread died: {type(exc).__name__}: {exc}"
            self._on_failure(self.failure)

    def _loop(self) -> None:
        round_s = 0.0  # the last round's own time (real time)
        round_end = self._last_call  # when the thread's last round ended (its clock)
        while True:
            busy = bool(self._busy_interval_s) and self._busy()
            self._busy_cadence = busy
            start = self._clock()
            wait = self._next_wait(start, busy, round_s, round_end)
            due = start + wait  # a progress round's own time excluded
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop:
                return
            now = self._clock()
            self._check_stall(now - due, now, wait)
            if now - self._last_call < self._quiet_s(busy):
                continue  # the engine called within the interval: its call advanced them
            if not self._lock.acquire(blocking=False):
                round_end = now  # the engine is in a call: look again an interval later
                continue
            started = time.perf_counter()
            try:
                self._progress()
            finally:
                self._lock.release()
            round_s = time.perf_counter() - started
            round_end = now + round_s

    def _quiet_s(self, busy: bool) -> float:
        """How long the engine must not have called before a round: the busy interval
        while busy (the idle one when that is shorter: idle progress would come then),
        else the idle one (0 idle progress: never, inf)."""
        idle = self._interval_s or float("inf")
        return min(self._busy_interval_s, idle) if busy else idle

    def _next_wait(self, now: float, busy: bool, round_s: float, round_end: float) -> float:
        """How long to sleep before the next round may be due: until the engine has been
        quiet for the interval (measured from its last call, so a call just before the
        thread woke does not cost a whole second interval), and at least the interval
        since the thread's own last round (busy: or the share cap, if longer). Whenever
        this is 0, the engine has been quiet long enough: the round runs, no spin."""
        quiet = self._quiet_s(busy)
        if quiet == float("inf"):
            return IDLE_CHECK_S
        spacing = quiet
        if busy:
            share = MAX_BUSY_SHARE
            spacing = max(quiet, round_s * (1 - share) / share)
        due = max(self._last_call + quiet, round_end + spacing)
        return max(due - now, 0.0)

    def _check_stall(self, late_s: float, now: float, wait_s: float) -> None:
        if late_s < STALL_S:
            return
        self._on_stall(late_s)
        if now - self._stall_logged_at < STALL_LOG_EVERY_S:
            self._stalls_unlogged += 1
            return
        logger.warning(
            "kvbridge's progress thread could not run for %.1f s (due every %.0f ms): the GIL "
            "was held through a long native call (such as a compiled kernel of the engine's "
            "forward) or the process had no CPU; kvbridge's transfer steps in this process "
            "waited as long (%d more stalls since the last such line)",
            late_s + wait_s,
            1e3 * wait_s,
            self._stalls_unlogged,
        )
        self._stall_logged_at, self._stalls_unlogged = now, 0

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
