"""kvbridge's counters in vLLM's stats pipeline and on its Prometheus ``/metrics``.

Workers and the scheduler each report the *increase* of their counters since their last
report (plus a few gauges, reported as current values); vLLM aggregates the reports and
hands them to :class:`KVBridgePromMetrics`, which exports ``vllm:kvbridge_<name>``
(counters get Prometheus' ``_total`` suffix) with the HELP text of
``kvbridge.connector.common.metrics``, the catalogue the example servers export from too.
The load phases' sums are counters here (``vllm:kvbridge_load_data_seconds_total``):
vLLM's stats pipeline carries increases from the workers, not observations. The engine's
calls into the connector are the exception: each report carries the (hook, seconds) of the
calls since the last one under :data:`ENGINE_CALLS`, and they are observed into a real
histogram, ``vllm:kvbridge_engine_call_seconds{hook=...}``. Peers are labelled too: each
report carries the peer states that changed (:data:`PEER_STATES`, ``{peer: state}``) and
the failed handshakes by reason since the last one (:data:`PEER_FAILURES`), exported as
``vllm:kvbridge_peer_state{peer,state}`` and ``vllm:kvbridge_peer_failures_total{reason}``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvbridge.connector.common.engine_calls import (
    ENGINE_CALL_BUCKETS,
    ENGINE_CALL_HELP,
    EngineCallTimes,
)
from kvbridge.connector.common.metrics import (
    GAUGE_HELP,
    HELP,
    PEER_FAILURES_HELP,
    PEER_STATE_HELP,
)
from kvbridge.connector.common.metrics import PEER_STATES as STATES

# Every counter the worker side (ConnectorMetrics.counters()) and the scheduler side
# report, and the scheduler's gauges, each with its HELP text.
GAUGES = tuple(GAUGE_HELP)
COUNTERS = tuple(HELP)
ENGINE_CALLS = "engine_calls"  # [(hook, seconds), ...] observed since the last report
PEER_STATES = "peer_states"  # {peer: state}: the peers whose state changed
PEER_FAILURES = "peer_failures"  # {reason: failed handshakes since the last report}
_LABELLED = (ENGINE_CALLS, PEER_STATES, PEER_FAILURES)
# a merged report keeps at most this many calls; past it (only vLLM's log accumulator, which
# merges every step of its interval, gets there) each hook keeps its slowest call
MERGED_CALLS_KEPT = 65536


def engine_call_data(times: EngineCallTimes) -> dict[str, Any]:
    """The report's entry for the calls ``times`` saw since its last report (or none)."""
    calls = times.take()
    return {ENGINE_CALLS: [[hook, seconds] for hook, seconds in calls]} if calls else {}


class KVBridgeStats(KVConnectorStats):
    """``data``: counter increases and gauge values, by name."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVBridgeStats:
        merged = dict(self.data)
        for name, value in other.data.items():
            if name == ENGINE_CALLS:
                merged[name] = _merge_calls(self.data.get(name), value)
            elif name == PEER_STATES:
                merged[name] = {**self.data.get(name, {}), **value}
            elif name == PEER_FAILURES:
                failures = dict(self.data.get(name, {}))
                for reason, count in value.items():
                    failures[reason] = failures.get(reason, 0) + count
                merged[name] = failures
            elif name in GAUGES:
                merged[name] = value
            else:
                merged[name] = merged.get(name, 0) + value
        return KVBridgeStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            k: v for k, v in self.data.items() if v and k not in _LABELLED
        }
        for reason, count in self.data.get(PEER_FAILURES, {}).items():
            out[f"peer_failures_{reason}"] = count
        calls = self.data.get(ENGINE_CALLS)
        if calls:
            out["engine_call_max_ms"] = round(1000 * max(s for _, s in calls), 3)
        seconds, transfers = self.data.get("transfer_seconds", 0.0), self.data.get("transfers", 0)
        if transfers:
            out["avg_transfer_ms"] = round(1000 * seconds / transfers, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values()) and not any(name in self.data for name in GAUGES)


def _merge_calls(mine: list[Any] | None, theirs: list[Any]) -> list[Any]:
    """``theirs`` appended to ``mine`` in place (no copy per merge: vLLM's log accumulator
    merges every step's report into one; the list it extends is its own,
    :meth:`KVBridgeConnector.build_kv_connector_stats` copies it)."""
    out = mine if mine is not None else []
    out.extend(theirs)
    if len(out) > MERGED_CALLS_KEPT:
        slowest: dict[str, float] = {}
        for hook, seconds in out:
            slowest[hook] = max(float(seconds), slowest.get(hook, 0.0))
        out[:] = [[hook, seconds] for hook, seconds in slowest.items()]
    return out


def own_stats_data(data: dict[str, Any] | None) -> dict[str, Any]:
    """A report's data with its own list of calls, so that merging into it never changes
    the report it came from."""
    out = dict(data or {})
    if ENGINE_CALLS in out:
        out[ENGINE_CALLS] = [list(call) for call in out[ENGINE_CALLS]]
    return out


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


class PeerDelta:
    """The peer states that changed and the failures by reason added since the last call,
    as a report's :data:`PEER_STATES` and :data:`PEER_FAILURES` entries."""

    def __init__(self) -> None:
        self._states: dict[str, str] = {}
        self._failures = CounterDelta()

    def take(self, states: dict[str, str], failures: dict[str, int]) -> dict[str, Any]:
        changed = {peer: s for peer, s in states.items() if self._states.get(peer) != s}
        self._states = dict(states)
        counts = {reason: float(n) for reason, n in failures.items()}
        added = {reason: int(n) for reason, n in self._failures.take(counts).items()}
        out: dict[str, Any] = {}
        if changed:
            out[PEER_STATES] = changed
        if added:
            out[PEER_FAILURES] = added
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
        self._engine_calls = self._histogram_cls(
            name="vllm:kvbridge_engine_call_seconds",
            documentation=ENGINE_CALL_HELP,
            labelnames=[*labelnames, "hook"],
            buckets=list(ENGINE_CALL_BUCKETS),
        )
        self._engine_labels = dict(per_engine_labelvalues)
        self._engine_call_children: dict[tuple[int, str], Any] = {}
        self._peer_state = self._gauge_cls(
            name="vllm:kvbridge_peer_state",
            documentation=PEER_STATE_HELP,
            labelnames=[*labelnames, "peer", "state"],
        )
        self._peer_failures = self._counter_cls(
            name="vllm:kvbridge_peer_failures",
            documentation=PEER_FAILURES_HELP,
            labelnames=[*labelnames, "reason"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name == ENGINE_CALLS:
                self._observe_calls(value, engine_idx)
                continue
            if name in (PEER_STATES, PEER_FAILURES):
                self._observe_peers(name, value, engine_idx)
                continue
            per_engine = self._metrics.get(name)
            if per_engine is None or engine_idx not in per_engine:
                continue
            if name in GAUGES:
                per_engine[engine_idx].set(value)
            elif value > 0:
                per_engine[engine_idx].inc(value)

    def _observe_peers(self, name: str, value: dict[str, Any], engine_idx: int) -> None:
        labels = self._engine_labels.get(engine_idx)
        if labels is None:
            return
        if name == PEER_FAILURES:
            for reason, count in value.items():
                if count > 0:
                    self._peer_failures.labels(*labels, str(reason)).inc(count)
            return
        for peer, current in value.items():
            for state in STATES:
                self._peer_state.labels(*labels, str(peer), state).set(float(state == current))

    def _observe_calls(self, calls: list[list[Any]], engine_idx: int) -> None:
        labels = self._engine_labels.get(engine_idx)
        if labels is None:
            return
        for hook, seconds in calls:
            child = self._engine_call_children.get((engine_idx, hook))
            if child is None:
                child = self._engine_calls.labels(*labels, str(hook))
                self._engine_call_children[(engine_idx, hook)] = child
            child.observe(float(seconds))
