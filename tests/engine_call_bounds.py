"""The bound the engine's calls into kvbridge keep while a peer misbehaves, read from a
worker's ``/metrics`` (``kvbridge_engine_call_seconds{hook}``, parsed by
``kvbridge.connector.common.metrics.parse_metrics``)."""

from __future__ import annotations

import re

# No engine call (a step's hook) may take longer than this while a peer is frozen, dead or
# slow: the engine keeps stepping for its other requests (docs/reliability.md)
ENGINE_CALL_BOUND_S = 1.0

_BUCKET = re.compile(r'kvbridge_engine_call_seconds_bucket\{hook="([^"]+)",le="([^"]+)"\}')


def slowest_engine_calls(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per hook called between the two samples: the upper bound of the smallest bucket that
    holds every call made in between (inf: one passed the last bound)."""
    buckets: dict[str, list[tuple[float, float]]] = {}
    for key, value in after.items():
        m = _BUCKET.fullmatch(key)
        if m:
            bound = float("inf") if m[2] == "+Inf" else float(m[2])
            buckets.setdefault(m[1], []).append((bound, value - before.get(key, 0.0)))
    out = {}
    for hook, rows in buckets.items():
        rows.sort()
        total = rows[-1][1]
        if total > 0:
            out[hook] = next(bound for bound, n in rows if n == total)
    return out
