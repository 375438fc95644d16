"""The worker's NIXL engine, and the lock its engine-facing calls share with the
idle-progress thread (kept apart from ``worker.py``, which is the per-step logic). The
settings it reads from ``extra`` are typed fields of
:class:`~kvbridge.connector.common.config.ExtraConfig`."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from kvbridge.connector.transfer.nixl_config import MergeRuns
from kvbridge.connector.transfer.transport import TransferEngine

P = ParamSpec("P")
R = TypeVar("R")


def engine_call(method: Callable[P, R]) -> Callable[P, R]:
    """An engine-facing call: one at a time with the idle-progress thread, timed from entry
    (the lock's wait included) into ``metrics.engine_calls`` under the method's name."""
    hook = method.__name__

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        self: Any = args[0]  # a KVBridgeWorker: _lock, _idle, metrics
        start = time.perf_counter()
        try:
            with self._lock:
                if self._idle is not None:
                    self._idle.touch()
                result = method(*args, **kwargs)
            if self._idle is not None:
                self._idle.kick()  # work left in flight: out of the thread's idle wait
            return result
        finally:
            self.metrics.engine_calls.observe(hook, time.perf_counter() - start)

    return call


def nixl_engine(
    agent_name: str,
    progress_us: int = 0,
    *,
    shared: bool = True,
    merge: MergeRuns = MergeRuns.OFF,
) -> TransferEngine:
    from kvbridge.connector.transfer.nixl_engine import (
        NixlEngineConfig,
        NixlTransferEngine,
        ProgressMode,
    )

    progress = ProgressMode.PROGRESS_THREAD_DELAY if progress_us else None
    return NixlTransferEngine(
        NixlEngineConfig(
            agent_name=agent_name,
            shared=shared,
            merge=merge,
            **({"progress": progress, "progress_delay_us": progress_us} if progress else {}),
        )
    )
