"""A load's phases add up to its duration and land in the metrics by name."""

from __future__ import annotations

import logging

import pytest

from kvbridge.connector.common.metrics import ConnectorMetrics, parse_metrics
from kvbridge.connector.worker.decode.inflight import SLOW_LOAD_S, LoadTimeline


def test_phases_split_the_load_at_its_marks():
    t = LoadTimeline(added=10.0, started=10.5, posted=10.75, arrived=12.0)
    assert t.phases(12.25) == {"peer": 0.5, "prepare": 0.25, "data": 1.25, "finish": 0.25}


def test_a_load_without_prepare_counts_no_prepare_time():
    t = LoadTimeline(added=1.0, started=1.5, arrived=2.0)  # posted at once: no Prepare
    phases = t.phases(2.0)
    assert phases == {"peer": 0.5, "prepare": 0.0, "data": 0.5, "finish": 0.0}


def test_record_adds_each_phase_to_its_counter():
    metrics = ConnectorMetrics()
    LoadTimeline(added=0.0, started=1.0, posted=3.0, arrived=6.0).record("r1", 10.0, metrics)
    LoadTimeline(added=0.0, started=0.5, posted=0.5, arrived=1.0).record("r2", 1.0, metrics)
    assert metrics.load_peer_seconds == pytest.approx(1.5)
    assert metrics.load_prepare_seconds == pytest.approx(2.0)
    assert metrics.load_data_seconds == pytest.approx(3.5)
    assert metrics.load_finish_seconds == pytest.approx(4.0)
    samples = parse_metrics(metrics.prometheus())
    assert samples['kvbridge_load_phase_seconds_sum{phase="data"}'] == pytest.approx(3.5)
    assert samples['kvbridge_load_phase_seconds_count{phase="data"}'] == 2
    # data took 3.0 s and 0.5 s: one by the 0.5 s bound, both by 5 s
    assert samples['kvbridge_load_phase_seconds_bucket{le="0.5",phase="data"}'] == 1
    assert samples['kvbridge_load_phase_seconds_bucket{le="5.0",phase="data"}'] == 2


def test_a_slow_load_is_logged_with_its_phases(caplog):
    metrics = ConnectorMetrics()
    with caplog.at_level(logging.INFO, logger="kvbridge.connector.worker.decode.inflight"):
        LoadTimeline(added=0.0, started=0.1, posted=0.2, arrived=0.3).record("fast", 0.4, metrics)
        slow = SLOW_LOAD_S + 1.0
        LoadTimeline(added=0.0, started=slow - 0.5, posted=slow - 0.5, arrived=slow).record(
            "slow", slow, metrics
        )
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert lines[0].startswith("load slow took 2000.0 ms: peer 1500.0 ms, prepare 0.0 ms")
