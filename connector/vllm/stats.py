"""kvbridge's counters in vLLM's stats pipeline and on its Prometheus ``/metrics``.

Workers and the scheduler each report the *increase* of their counters since their last
report (plus a few gauges, reported as current values); vLLM aggregates the reports and
hands them to :class:`KVBridgePromMetrics`, which exports ``vllm:kvbridge_<name>``
(counters get Prometheus' ``_total`` suffix) with the HELP text of
``kvbridge.connector.common.metrics``, the catalogue the example servers export from too.
The load phases' sums are counters here (``vllm:kvbridge_load_data_seconds_total``):
vLLM's stats pipeline carries increases from the workers, not observations.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvbridge.connector.common.metrics import GAUGE_HELP, HELP

# Every counter the worker side (ConnectorMetrics.counters()) and the scheduler side
# report, and the scheduler's gauges, each with its HELP text.
GAUGES = tuple(GAUGE_HELP)
COUNTERS = tuple(HELP)


class KVBridgeStats(KVConnectorStats):
    """``data``: counter increases and gauge values, by name."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVBridgeStats:
        merged = dict(self.data)
        for name, value in other.data.items():
            if name in GAUGES:
                merged[name] = value
            else:
                merged[name] = merged.get(name, 0) + value
        return KVBridgeStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if v}
        seconds, transfers = self.data.get("transfer_seconds", 0.0), self.data.get("transfers", 0)
        if transfers:
            out["avg_transfer_ms"] = round(1000 * seconds / transfers, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values()) and not any(name in self.data for name in GAUGES)


class CounterDelta:
    """Turns monotonic counters into increases since the previous call."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def take(self, current: dict[str, float]) -> dict[str, float]:
        out = {}
        for name, value in current.items():
            delta = value - self._last.get(name, 0)
            if delta:
                out[name] = delta
            self._last[name] = value
        return out


class KVBridgePromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, dict[int, Any]] = {}
        for name in COUNTERS + GAUGES:
            cls = self._gauge_cls if name in GAUGES else self._counter_cls
            metric = cls(
                name=f"vllm:kvbridge_{name}",
                documentation=GAUGE_HELP[name] if name in GAUGES else HELP[name],
                labelnames=labelnames,
            )
            self._metrics[name] = {
                idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._metrics.get(name)
            if per_engine is None or engine_idx not in per_engine:
                continue
            if name in GAUGES:
                per_engine[engine_idx].set(value)
            elif value > 0:
                per_engine[engine_idx].inc(value)
