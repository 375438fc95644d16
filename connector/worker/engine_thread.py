"""Lower the priority of an engine thread that busy-waits, so transfer threads can run.

vLLM's CPU worker pins its thread to one core and, between steps, spins on
``sched_yield``. On a machine with fewer cores than such threads (two servers and a TP-2
engine on 2 cores), the threads that move KV -- NIXL's progress thread, UCX's, kvbridge's
idle progress -- sometimes got no CPU for the whole 30 s load timeout (measured: a
``/proc`` sampler saw the prefill worker thread on its core for 30 s without a break,
exactly while a decode load sat in ``reading``). With that thread at nice 19 the stalls
went away. kvbridge's threads start before the change (a thread inherits its creator's
nice value, and raising it back needs privileges), so they keep the process's priority.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)


def lower_calling_thread_priority(nice: int) -> int:
    """Set the calling thread's nice value to ``nice`` if that is lower priority than it
    has (never raises it); returns the nice value it now has. Linux-only (elsewhere a
    no-op that returns 0)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0
    current = os.getpriority(os.PRIO_PROCESS, 0)  # on Linux: this thread
    if nice > current:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        logger.info("kvbridge: engine thread %d now at nice %d", threading.get_native_id(), nice)
    return os.getpriority(os.PRIO_PROCESS, 0)
