"""kvbridge's stats in vLLM's pipeline: engine-call observations travel from the workers
and the scheduler, merge across reports, and land in one Prometheus histogram per hook."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvbridge.connector.common.engine_calls import EngineCallTimes
from kvbridge.connector.common.metrics import parse_metrics
from kvbridge.connector.vllm.stats import (
    ENGINE_CALLS,
    KVBridgePromMetrics,
    KVBridgeStats,
    engine_call_data,
)


def test_reports_carry_each_call_once_and_merge_by_concatenation():
    times = EngineCallTimes()
    times.observe("start_load_kv", 0.001)
    first = KVBridgeStats(data={"transfers": 1, **engine_call_data(times)})
    assert engine_call_data(times) == {}  # nothing new since the last report
    times.observe("get_finished", 0.004)
    second = KVBridgeStats(data={"transfers": 2, **engine_call_data(times)})
    merged = first.aggregate(second)
    assert merged.data[ENGINE_CALLS] == [["start_load_kv", 0.001], ["get_finished", 0.004]]
    assert merged.data["transfers"] == 3
    assert merged.reduce()["engine_call_max_ms"] == 4.0
    assert ENGINE_CALLS not in merged.reduce()


def test_observations_land_in_the_engines_histogram_per_hook():
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=None)
    prom = KVBridgePromMetrics(vllm_config, types, ["engine"], {0: ["0"], 1: ["1"]})
    calls = [["start_load_kv", 0.002], ["start_load_kv", 0.3], ["request_finished", 0.0001]]
    prom.observe({ENGINE_CALLS: calls, "transfers": 2}, engine_idx=1)
    samples = parse_metrics(generate_latest(registry).decode())
    name = "vllm:kvbridge_engine_call_seconds"
    assert samples[f'{name}_count{{engine="1",hook="start_load_kv"}}'] == 2
    assert samples[f'{name}_bucket{{engine="1",hook="start_load_kv",le="0.0025"}}'] == 1
    assert samples[f'{name}_count{{engine="1",hook="request_finished"}}'] == 1
    assert samples['vllm:kvbridge_transfers_total{engine="1"}'] == 2
    assert not any('engine="0",hook' in key for key in samples)


def test_the_log_accumulator_merges_in_place_and_stays_bounded():
    """vLLM's log accumulator merges every step's report into one: the merge extends its
    own list (no copy per step), the report it was built from stays as it was, and past
    MERGED_CALLS_KEPT each hook keeps its slowest call."""
    from kvbridge.connector.vllm.connector import KVBridgeConnector
    from kvbridge.connector.vllm.stats import MERGED_CALLS_KEPT

    first = {ENGINE_CALLS: [["start_load_kv", 0.001]]}
    acc = KVBridgeConnector.build_kv_connector_stats(data=first)
    step = KVBridgeStats(data={ENGINE_CALLS: [["get_finished", 0.002]] * 1000})
    for _ in range(2 * MERGED_CALLS_KEPT // 1000):
        acc = acc.aggregate(step)
        assert len(acc.data[ENGINE_CALLS]) <= MERGED_CALLS_KEPT
    acc = acc.aggregate(KVBridgeStats(data={ENGINE_CALLS: [["get_finished", 0.5]]}))
    assert first == {ENGINE_CALLS: [["start_load_kv", 0.001]]}  # its source untouched
    assert len(step.data[ENGINE_CALLS]) == 1000
    slowest: dict[str, float] = {}
    for hook, seconds in acc.data[ENGINE_CALLS]:
        slowest[hook] = max(seconds, slowest.get(hook, 0.0))
    assert slowest == {"start_load_kv": 0.001, "get_finished": 0.5}
    assert acc.reduce()["engine_call_max_ms"] == 500.0
