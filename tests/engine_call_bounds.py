"""The bound the engine's calls into kvbridge keep while a peer misbehaves, read from a
worker's ``/metrics`` (``kvbridge_engine_call_seconds{hook}``, parsed by
``kvbridge.connector.common.metrics.parse_metrics``; a vLLM server's
``vllm:kvbridge_engine_call_seconds`` by :func:`vllm_engine_call_buckets`)."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

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


def vllm_engine_call_buckets(text: str) -> dict[str, float]:
    """A vLLM server's ``/metrics`` text: its ``vllm:kvbridge_engine_call_seconds`` buckets,
    summed over every other label (engine, model), keyed as :func:`slowest_engine_calls`
    reads them."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:kvbridge_engine_call_seconds_bucket":
                hook, le = sample.labels["hook"], sample.labels["le"]
                key = f'kvbridge_engine_call_seconds_bucket{{hook="{hook}",le="{le}"}}'
                out[key] = out.get(key, 0.0) + sample.value
    return out
