"""Who may call the worker's NIXL agent now: a progress round, or kvbridge's set-up thread.

NIXL serialises every call on one agent behind the agent's lock (kvbridge's agents are
``NIXL_THREAD_SYNC_STRICT``), and some bindings wait for that lock holding the GIL
(``release_xfer_handle``, ``remove_remote_agent``; docs/nixl-holds.md). A call that waits
on another process, ``add_remote_agent`` above all, therefore stalls every other caller
of the agent for as long as it is held. The gate makes that wait visible in Python, before
NIXL is entered::

    progress round (engine step, idle thread)   round(): never waits; busy -> skip the round
    set-up thread (peers.PeerSetup)             setup(): waits its turn, then may block in NIXL

So the engine's step never waits on a peer: while a peer's set-up is held, the step hands
its work to the next round and returns at once (``rounds_deferred`` counts it), and what
waits is the set-up thread and the transfers behind it. Re-entrant: a round may nest
calls that take the gate again. :meth:`held` says whether the calling thread holds it,
which the NIXL engine checks before every call (``NixlTransferEngine.guard``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class AgentGate:
    __slots__ = ("_count", "_lock", "_owner", "_setups", "_waiting", "rounds_deferred")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._owner: int | None = None  # the thread inside (None: free)
        self._waiting = 0  # set-ups waiting for the gate: rounds give way to them
        self._setups = 0  # set-ups waiting for the gate or holding it
        self._count = threading.Lock()  # guards _waiting (several threads may set up)
        self.rounds_deferred = 0  # rounds that found the gate taken and skipped

    @property
    def setting_up(self) -> bool:
        """A set-up waits for the gate or holds it: a round now would be deferred."""
        return self._setups > 0

    def held(self) -> bool:
        """The calling thread holds the gate."""
        return self._owner == threading.get_ident()

    @contextlib.contextmanager
    def round(self) -> Iterator[bool]:
        """A progress round: yields True with the gate held, or False at once (counted in
        ``rounds_deferred``) when another thread holds it or a set-up waits for it (a
        lock is not fair: an engine stepping back to back could take it again before the
        waiting set-up thread woke, for as long as it kept stepping)."""
        if (self._waiting and not self.held()) or not self._lock.acquire(blocking=False):
            self.rounds_deferred += 1
            yield False
            return
        try:
            with self._owned():
                yield True
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        """Set-up and teardown: waits until the gate is free (a round never waits on a
        peer, so the wait is bounded by a round's own work)."""
        with self._count:
            self._waiting += 1
            self._setups += 1
        try:
            try:
                self._lock.acquire()
            finally:
                with self._count:
                    self._waiting -= 1
            try:
                with self._owned():
                    yield
            finally:
                self._lock.release()
        finally:
            with self._count:
                self._setups -= 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside :meth:`setup` (taken once): let rounds in while the set-up waits on
        something that needs no NIXL call (a READ's progress; :attr:`setting_up` is False
        meanwhile), then take the gate back as :meth:`setup` does."""
        if not self.held():
            raise RuntimeError("AgentGate.paused() outside setup(): the gate is not held")
        owner, self._owner = self._owner, None
        with self._count:
            self._setups -= 1  # not setting up meanwhile: busy rounds may run
        self._lock.release()
        try:
            yield
        finally:
            with self._count:
                self._waiting += 1
                self._setups += 1
            try:
                self._lock.acquire()
            finally:
                with self._count:
                    self._waiting -= 1
            self._owner = owner

    @contextlib.contextmanager
    def _owned(self) -> Iterator[None]:
        outer, self._owner = self._owner, threading.get_ident()
        try:
            yield
        finally:
            self._owner = outer
