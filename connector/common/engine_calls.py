"""How long the engine's calls spend in the connector, per hook.

An engine's step is its heartbeat: every running request waits for it. Each call an engine
makes into kvbridge (vLLM's worker hooks ``start_load_kv``, ``get_finished``, ...; its
scheduler hooks ``get_num_new_matched_tokens``, ``build_connector_meta``, ...; the example
engine's calls) is timed from entry to return, waiting for the worker's lock included, and
counted in one histogram, ``kvbridge_engine_call_seconds{hook=...}``. A peer that stalls
the engine shows there as a long tail on one hook, before anyone reads a log.

:class:`EngineCallTimes` keeps the histogram (cumulative, for the example servers'
``/metrics``) and the observations since the last :meth:`EngineCallTimes.take` (vLLM's stats
pipeline carries observations from the workers to the process that exports them).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import deque

ENGINE_CALL_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
ENGINE_CALL_HELP = "Seconds each engine call spent in the connector (lock wait included)."
RECENT_KEPT = 4096  # observations kept for the next take(); older ones are dropped


class EngineCallTimes:
    """Per hook: the seconds of every call, as histogram buckets and a sum. Thread-safe:
    the engine's threads and kvbridge's own record into one instance."""

    __slots__ = ("_buckets", "_lock", "_recent", "_sums")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[str, list[int]] = {}
        self._sums: dict[str, float] = {}
        self._recent: deque[tuple[str, float]] = deque(maxlen=RECENT_KEPT)

    def observe(self, hook: str, seconds: float) -> None:
        with self._lock:
            counts = self._buckets.get(hook)
            if counts is None:
                counts = self._buckets[hook] = [0] * (len(ENGINE_CALL_BUCKETS) + 1)
            counts[bisect_left(ENGINE_CALL_BUCKETS, seconds)] += 1
            self._sums[hook] = self._sums.get(hook, 0.0) + seconds
            self._recent.append((hook, seconds))

    def histogram(self) -> dict[str, tuple[list[int], float]]:
        """Per hook: its count in each of ``ENGINE_CALL_BUCKETS`` (not cumulative; the last
        slot counts those above the largest bound) and its sum of seconds."""
        with self._lock:
            return {hook: (list(c), self._sums[hook]) for hook, c in self._buckets.items()}

    def take(self) -> list[tuple[str, float]]:
        """The (hook, seconds) observed since the last call (at most ``RECENT_KEPT``)."""
        with self._lock:
            out = list(self._recent)
            self._recent.clear()
            return out

    def slowest(self) -> dict[str, float]:
        """Per hook: the upper bound of the highest bucket any call reached (inf: past the
        last bound), a coarse worst case for logs and tests."""
        out = {}
        for hook, (counts, _) in self.histogram().items():
            top = max(i for i, n in enumerate(counts) if n)
            out[hook] = ENGINE_CALL_BUCKETS[top] if top < len(ENGINE_CALL_BUCKETS) else float("inf")
        return out
