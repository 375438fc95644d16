"""Keep the side channel's threads off cores an engine pinned for itself.

Engines pin their worker threads (vLLM's CPU worker binds its main thread to one core and
busy-waits there between steps). Threads inherit the affinity of the thread that creates
them, so a listener started from such a worker -- and the ZMQ I/O thread behind it --
would share that one core with the spinning worker (and, on a small machine, with the
peer engine's spinning worker too). Measured inside vLLM on 2 cores: connections sat in
the listener's accept queue for 20 s. The side channel is light, so its threads may run
on any core the machine has.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def _all_cpus() -> set[int]:
    return set(range(os.cpu_count() or 1))


def unpin_current_thread() -> None:
    """Let the calling thread run on every CPU (a no-op where that is not allowed)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, _all_cpus())
    except OSError:  # a cpuset narrower than the machine: keep what we have
        pass


@contextmanager
def unpinned() -> Iterator[None]:
    """Threads started inside (Python or native, e.g. ZMQ's I/O thread) may run on every
    CPU; the calling thread's own affinity is restored afterwards."""
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    unpin_current_thread()
    try:
        yield
    finally:
        try:
            os.sched_setaffinity(0, before)
        except OSError:
            pass
