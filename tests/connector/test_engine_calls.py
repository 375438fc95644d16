"""The engine's calls into the connector, timed per hook: the histogram, its Prometheus
form, and the worker's ``engine_call`` wrapper (lock wait included, failures counted)."""

from __future__ import annotations

import threading
import time

import pytest

from kvbridge.connector.common.engine_calls import RECENT_KEPT, EngineCallTimes
from kvbridge.connector.common.metrics import ConnectorMetrics, parse_metrics
from kvbridge.connector.worker.nixl_setup import engine_call


def test_each_call_lands_in_its_hooks_bucket_and_sum():
    times = EngineCallTimes()
    times.observe("start_load_kv", 0.0004)
    times.observe("start_load_kv", 3.0)
    times.observe("get_finished", 20.0)
    hist = times.histogram()
    counts, total = hist["start_load_kv"]
    assert total == pytest.approx(3.0004)
    assert sum(counts) == 2 and counts[2] == 1  # 0.4 ms: the 0.5 ms bucket
    assert counts[-1] == 0 and hist["get_finished"][0][-1] == 1  # 20 s: past the last bound
    assert times.slowest() == {"start_load_kv": 5.0, "get_finished": float("inf")}


def test_take_hands_over_each_observation_once_and_keeps_a_bounded_tail():
    times = EngineCallTimes()
    times.observe("a", 0.1)
    assert times.take() == [("a", 0.1)]
    assert times.take() == []
    for i in range(RECENT_KEPT + 10):
        times.observe("b", float(i))
    taken = times.take()
    assert len(taken) == RECENT_KEPT and taken[0] == ("b", 10.0)
    assert sum(times.histogram()["b"][0]) == RECENT_KEPT + 10  # the histogram lost none


def test_prometheus_shows_one_histogram_per_hook():
    metrics = ConnectorMetrics()
    metrics.engine_calls.observe("start_load_kv", 0.002)
    metrics.engine_calls.observe("start_load_kv", 0.2)
    samples = parse_metrics(metrics.prometheus())
    name = "kvbridge_engine_call_seconds"
    assert samples[f'{name}_count{{hook="start_load_kv"}}'] == 2
    assert samples[f'{name}_sum{{hook="start_load_kv"}}'] == pytest.approx(0.202)
    assert samples[f'{name}_bucket{{hook="start_load_kv",le="0.0025"}}'] == 1
    assert samples[f'{name}_bucket{{hook="start_load_kv",le="0.25"}}'] == 2


class _Worker:
    """What ``engine_call`` needs of a worker: its lock, its idle thread, its metrics."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._idle = None
        self.metrics = ConnectorMetrics()

    @engine_call
    def step(self) -> int:
        return 7

    @engine_call
    def broken(self) -> None:
        raise ValueError("boom")


def test_engine_call_counts_the_wait_for_the_lock():
    w = _Worker()
    held, release = threading.Event(), threading.Event()
    released_at: list[float] = []

    def hold() -> None:
        with w._lock:
            held.set()
            release.wait(10)
            released_at.append(time.perf_counter())

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10), "the holder thread never took the lock"
    timer = threading.Timer(0.3, release.set)  # a hold long enough to tell from a call
    timer.start()
    called_at = time.perf_counter()
    try:
        assert w.step() == 7  # waits until the holder lets go
    finally:
        release.set()
        holder.join(10)
        timer.cancel()
    counts, total = w.metrics.engine_calls.histogram()["step"]
    assert sum(counts) == 1 and total >= released_at[0] - called_at > 0.1


def test_engine_call_counts_a_call_that_raised():
    w = _Worker()
    with pytest.raises(ValueError, match="boom"):
        w.broken()
    assert sum(w.metrics.engine_calls.histogram()["broken"][0]) == 1
