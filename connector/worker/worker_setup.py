"""The worker's settings read from ``extra``, its NIXL engine, and the lock its engine-facing
calls share with the idle-progress thread (kept apart from ``worker.py``, which is the
per-step logic)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from kvbridge.connector.common.config import ConfigError
from kvbridge.connector.transfer.nixl_config import MergeRuns
from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.handshake.modes import TransferMode
from kvbridge.layouts.errors import LayoutError

P = ParamSpec("P")
R = TypeVar("R")


def engine_call(method: Callable[P, R]) -> Callable[P, R]:
    """An engine-facing call: one at a time with the idle-progress thread."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        self: Any = args[0]  # a KVBridgeWorker: _lock, _idle
        with self._lock:
            if self._idle is not None:
                self._idle.touch()
            return method(*args, **kwargs)

    return call


def idle_progress_ms(extra: dict) -> float:
    """``extra["idle_progress_ms"]``: 0 (default) advances transfers only when the engine
    calls in; > 0 also from a thread whenever the engine has been idle that long (vLLM
    stops stepping when it has no requests, yet a decode may wait on this worker)."""
    value = extra.get("idle_progress_ms", 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(
            f"extra.idle_progress_ms={value!r} must be a non-negative number (milliseconds)"
        )
    return float(value)


def transfer_mode(extra: dict) -> TransferMode:
    """``extra["transfer_mode"]``: ``"pull"`` (default: decode READs prefill's blocks) or
    ``"push"`` (prefill WRITEs into decode's); prefill and decode must set the same."""
    value = extra.get("transfer_mode", TransferMode.PULL.value)
    try:
        return TransferMode.parse(value)
    except LayoutError:
        choices = [m.value for m in TransferMode]
        raise ConfigError(f"extra.transfer_mode={value!r} is not one of {choices}") from None


def rewrite_on_save(extra: dict) -> bool:
    """``extra["rewrite_on_save"]``: false (default) rewrites a kept request's blocks when
    its reader asks (``Prepare``/``Push``); true rewrites them into the last reader's format
    as soon as they are saved, off the handover's critical path (readers that need no
    rewrite then ask first too)."""
    value = extra.get("rewrite_on_save", False)
    if not isinstance(value, bool):
        raise ConfigError(f"extra.rewrite_on_save={value!r} must be true or false")
    return value


def warm_peers(extra: dict) -> list[tuple[str, int]]:
    """``extra["warm_peers"]``: side-channel listeners (``"host:port"``, one per remote rank)
    to handshake and connect with at startup, so the first request to them pays neither:
    a decode lists its prefills; a pushing prefill lists its decodes."""
    value = extra.get("warm_peers", [])
    if not isinstance(value, list):
        raise ConfigError(f"extra.warm_peers={value!r} must be a list of 'host:port' strings")
    out = []
    for item in value:
        host, sep, port = item.rpartition(":") if isinstance(item, str) else ("", "", "")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"extra.warm_peers entry {item!r} is not 'host:port' (a side-channel listener, "
                f"port 1-65535)"
            )
        out.append((host, int(port)))
    return out


def progress_us(extra: dict) -> int:
    """``extra["nixl_progress_us"]``: 0 (default) leaves NIXL's progress to the worker's
    calls; > 0 runs NIXL's progress thread with that sleep between rounds, for engines
    that stop calling the connector while idle (vLLM)."""
    value = extra.get("nixl_progress_us", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"extra.nixl_progress_us={value!r} must be a non-negative integer (microseconds)"
        )
    return value


def merge_runs(extra: dict) -> MergeRuns:
    """``extra["merge_runs"]``: false (default) posts one descriptor per block and lets
    NIXL coalesce adjacent ones (it does, and faster than kvbridge can: see
    ``kvbridge.connector.transfer.nixl_config.MergeRuns``); true posts each run of blocks adjacent
    on both sides as one descriptor."""
    value = extra.get("merge_runs", False)
    if not isinstance(value, bool):
        raise ConfigError(f"extra.merge_runs={value!r} must be true or false")
    return MergeRuns.ON if value else MergeRuns.OFF


def nixl_engine(
    agent_name: str,
    progress_us: int = 0,
    *,
    shared: bool = False,
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


def engine_thread_nice(extra: dict) -> int:
    """``extra["engine_thread_nice"]``: 0 (default) leaves the engine's thread alone; 1-19
    lowers the scheduling priority of the thread that registers the KV caches (vLLM's
    worker thread, which busy-waits between steps) to that nice value once kvbridge's own
    threads are running. On a machine with fewer cores than busy engine threads, a
    busy-waiting thread otherwise starves the transfer threads sharing its core."""
    value = extra.get("engine_thread_nice", 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 19:
        raise ConfigError(
            f"extra.engine_thread_nice={value!r} must be an integer from 0 (leave the engine "
            f"thread's priority alone) to 19 (lowest)"
        )
    return value
