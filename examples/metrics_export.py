"""The worker's ``/metrics``: a ``prometheus_client`` collector over the connector's
metrics (names, HELP and the load-phase histogram from
``kvbridge.connector.common.metrics``, which the vLLM adapter exports too) and the
engine's state, read at scrape time. Each server has its own registry.

=============================================  =======  =====================================
``kvbridge_<counter>_total``                   counter  every :class:`ConnectorMetrics` field
``kvbridge_load_phase_seconds{phase}``         hist.    decode loads: peer, prepare, data,
                                                        finish
``kvbridge_live_transfer_handles``             gauge    NIXL transfer handles not yet ended
``kvbridge_free_blocks{pool}``                 gauge    free KV blocks
``kvbridge_total_blocks{pool}``                gauge    all KV blocks
``kvbridge_requests{state}``                   gauge    requests by state
``kvbridge_requests_finished_total{reason}``   counter  finished requests by reason
``kvbridge_load_outcomes_total{outcome}``      counter  decode loads by outcome
``kvbridge_send_outcomes_total{outcome}``      counter  prefill holds by outcome
``kvbridge_loads_unserved_total``              counter  decode loads the params could not
                                                        serve (computed locally)
=============================================  =======  =====================================
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvbridge.connector.common.metrics import HELP, metric_families
from kvbridge.examples.engine_loop import EngineLoop

CONTENT_TYPE = CONTENT_TYPE_LATEST


class WorkerCollector(Collector):
    """Reads one engine loop's figures at each scrape (plain reads of counters the engine
    thread updates; a scrape may see one step's changes half applied, never torn values)."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    def collect(self) -> Iterator[Metric]:
        loop = self.loop
        worker = loop.worker
        if worker is not None:
            yield from metric_families(worker.metrics)
            yield GaugeMetricFamily(
                "kvbridge_live_transfer_handles",
                "NIXL transfer handles posted and not yet ended.",
                value=worker.num_live_handles,
            )
        yield _labelled(
            GaugeMetricFamily, "free_blocks", "Free KV blocks.", "pool", {"kv": loop.free_blocks}
        )
        total = {"kv": loop.engine.pool.num_blocks}
        yield _labelled(GaugeMetricFamily, "total_blocks", "All KV blocks.", "pool", total)
        yield _labelled(
            GaugeMetricFamily, "requests", "Requests by state.", "state", dict(loop.status_counts)
        )
        finished = dict(loop.finished)
        yield _labelled(
            CounterMetricFamily,
            "requests_finished",
            "Finished requests by reason.",
            "reason",
            finished,
        )
        sched = loop.engine.scheduler
        if sched is not None:
            loads = {s.name.lower(): n for s, n in list(sched.load_outcomes.items())}
            sends = {s.name.lower(): n for s, n in list(sched.send_outcomes.items())}
            yield _labelled(
                CounterMetricFamily, "load_outcomes", "Decode loads by outcome.", "outcome", loads
            )
            yield _labelled(
                CounterMetricFamily,
                "send_outcomes",
                "Prefill holds by outcome (done: read and released).",
                "outcome",
                sends,
            )
            yield CounterMetricFamily(
                "kvbridge_loads_unserved",
                HELP["loads_unserved"],
                value=sched.num_unserved_loads,
            )


def _labelled(cls: type, name: str, doc: str, label: str, values: dict[str, float]) -> Metric:
    family = cls(f"kvbridge_{name}", doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


def make_registry(loop: EngineLoop) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(loop))
    return registry


def metrics_text(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
