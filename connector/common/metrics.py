"""The connector's counters and its load-phase histogram, and their Prometheus form.

:class:`ConnectorMetrics` is what a worker connector counts (monotonic, read by tests,
logs and exporters). :data:`HELP` is the one catalogue of what each means; both exporters
read it: the example servers' ``/metrics`` (:func:`metric_families`, through a
``prometheus_client`` collector) and the vLLM adapter (``kvbridge.connector.vllm.stats``,
through vLLM's own registry). Names follow Prometheus' conventions: every counter ends in
``_total`` (``kvbridge_transfers_total``, ``kvbridge_transfer_seconds_total``), and each
decode load's phases are one histogram, ``kvbridge_load_phase_seconds{phase=...}``.
Decode's quarantine is also shown per prefill agent as gauges
(``kvbridge_quarantined_blocks{peer=...}``, ``kvbridge_quarantined_bytes{peer=...}``), and
the time the engine's calls spend in the connector as a histogram per hook,
``kvbridge_engine_call_seconds{hook=...}`` (``kvbridge.connector.common.engine_calls``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kvbridge.connector.common.engine_calls import (
    ENGINE_CALL_BUCKETS,
    ENGINE_CALL_HELP,
    EngineCallTimes,
)

# the phases of a decode load (kvbridge.connector.worker.decode.inflight)
LOAD_PHASES = ("peer", "prepare", "data", "finish")
LOAD_PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class ConnectorMetrics:
    """Monotonic counters of one worker connector (read by tests, logs and /metrics)."""

    handshakes: int = 0
    handshake_failures: int = 0
    transfers: int = 0  # completed request loads
    transfer_failures: int = 0
    bytes_read: int = 0
    descriptors_posted: int = 0
    transfer_seconds: float = 0.0
    sender_rewrites: int = 0  # blocks rewritten after save
    sender_restores: int = 0
    eager_hits: int = 0  # requests rewritten on save that their reader wanted that way
    eager_misses: int = 0  # ... that their reader wanted another way (restored, redone)
    receiver_rewrites: int = 0
    # decode: rounds of whole remote pages through staging slots (read or pushed), split
    # into local blocks by the engine
    staging_rounds: int = 0
    notifications_sent: int = 0
    notifications_received: int = 0
    bad_notifications: int = 0
    # a peer's notification that raised while handled, and any other unit of work (a
    # scheduler order, a stage of a progress round) that did: that unit alone failed
    # (kvbridge.connector.worker.boundary); by kind in the labelled gauges' dicts
    peer_message_errors: int = 0
    unit_errors: int = 0
    peer_message_errors_by_kind: dict[str, int] = field(default_factory=dict, repr=False)
    unit_errors_by_kind: dict[str, int] = field(default_factory=dict, repr=False)
    # notifications that could not be encoded or sent, the peer not known to be gone: the
    # message failed (and what it belonged to), the peer was kept
    notifications_failed: int = 0
    leases_expired: int = 0
    # decode: failed loads reported only after their in-flight READs ended (release is not
    # cancel), and those whose READs still ran transfer_timeout_s after the failure
    loads_held: int = 0
    held_overdue: int = 0
    # decode: times a prefill's quarantined READs passed extra.max_quarantined_mib (no new
    # loads from it until they end or it is confirmed gone)
    quarantine_caps: int = 0
    # decode, a gauge per prefill agent: (block rows, bytes) of READs in the quarantine
    # that may still land (kvbridge.connector.worker.decode.quarantine)
    quarantined: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)
    # a background thread (idle progress) died: the worker reports itself unhealthy
    background_thread_failures: int = 0
    # the idle-progress thread woke STALL_S or more late: the process's Python could not run
    progress_stalls: int = 0
    progress_stall_seconds: float = 0.0
    # progress rounds skipped because the set-up thread held the agent (a peer's set-up in
    # NIXL): the engine's step went on without waiting (kvbridge.connector.worker.agent_gate)
    rounds_deferred: int = 0
    heartbeats_sent: int = 0
    # decode: peers READ at the handshake (extra.read_probe), their first READs' seconds,
    # and those whose GPU memory read below SLOW_GBPS (kvbridge.connector.worker.read_probe)
    read_probes: int = 0
    read_probe_first_seconds: float = 0.0
    read_probes_slow: int = 0
    # extra.gather_mib (kvbridge.connector.worker.packed_rows): decode loads moved as one
    # packed range, and those that could but moved their rows (no room in our arena or
    # prefill's); prefill: bytes it packed, claims or pushes it could not pack (no room)
    packed_loads: int = 0
    packed_fallbacks: int = 0
    packed_bytes: int = 0
    packed_refused: int = 0
    claims_sent: int = 0  # decode: Prepare messages claiming a hold (one or more a source)
    claims_resent: int = 0  # decode: ... of them sent again, the first one unanswered
    # extra.verify: decode loads whose digests matched prefill's, those that did not (the
    # load failed), and groups left out (staged pages); prefill: claims answered with digests
    loads_verified: int = 0
    load_verify_failures: int = 0
    verify_unverified_groups: int = 0
    digests_sent: int = 0
    # prefill: Push requests whose writes completed (one per load, or one per round of
    # decode's staging slots), and those answered with ok=False
    pushes_written: int = 0
    push_failures: int = 0
    bytes_written: int = 0  # prefill: bytes written into decode's blocks
    staged_to_host_bytes: int = 0  # host staging: cache -> host mirror (sender)
    staged_to_device_bytes: int = 0  # host staging: host mirror -> cache (receiver)
    # where decode's loads spent their time (kvbridge.connector.worker.decode.inflight):
    # waiting for the peer (handshake), the Prepare round trip, the data (READs or pushes),
    # finishing
    load_peer_seconds: float = 0.0
    load_prepare_seconds: float = 0.0
    load_data_seconds: float = 0.0
    load_finish_seconds: float = 0.0
    # per phase: how many loads fell into each of LOAD_PHASE_BUCKETS (not cumulative; the
    # last slot counts those above the largest bound)
    load_phase_buckets: dict[str, list[int]] = field(
        default_factory=lambda: {p: [0] * (len(LOAD_PHASE_BUCKETS) + 1) for p in LOAD_PHASES},
        repr=False,
    )
    # every engine call into this worker's connector, per hook (engine_calls)
    engine_calls: EngineCallTimes = field(default_factory=EngineCallTimes, repr=False)
    # each peer's state by address (one of PEER_STATES below: peer_health.PeerHealth), a
    # gauge; and failed handshakes by reason (incompatible, bad_secret, unreachable, failed)
    peer_states: dict[str, str] = field(default_factory=dict, repr=False)
    peer_failures: dict[str, int] = field(default_factory=dict, repr=False)

    def observe_load(self, phases: dict[str, float]) -> None:
        """One finished load's seconds per phase: into the sums and the histogram."""
        for phase in LOAD_PHASES:
            seconds = phases[phase]
            name = f"load_{phase}_seconds"
            setattr(self, name, getattr(self, name) + seconds)
            self.load_phase_buckets[phase][bisect_left(LOAD_PHASE_BUCKETS, seconds)] += 1

    def counters(self) -> dict[str, float]:
        """Every counter by field name (the histogram's buckets aside)."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self) if f.name in HELP}

    def prometheus(self, prefix: str = "kvbridge") -> str:
        """These metrics alone as Prometheus text (``prometheus_client``'s rendering)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(self, prefix))
        return generate_latest(registry).decode()


# HELP text of every counter of ConnectorMetrics, and of the scheduler's figures the vLLM
# adapter reports; a field without an entry here is not exported.
HELP = {
    "handshakes": "Side-channel handshakes with peers that succeeded.",
    "handshake_failures": "Side-channel handshakes that failed (refused pairing, no answer).",
    "transfers": "Decode request loads that completed.",
    "transfer_failures": "Decode request loads that failed.",
    "bytes_read": "Bytes decode loaded from prefill (read, or pushed to it).",
    "descriptors_posted": "NIXL descriptors posted (READs on decode, WRITEs on prefill).",
    "transfer_seconds": "Seconds decode spent in request loads, post to done.",
    "sender_rewrites": "Blocks prefill rewrote into its reader's format.",
    "sender_restores": "Blocks prefill restored to its own format after a reader.",
    "eager_hits": "Requests rewritten on save in the format their reader wanted.",
    "eager_misses": "Requests rewritten on save that their reader wanted another way.",
    "receiver_rewrites": "Blocks decode rewrote into its own format after loading.",
    "staging_rounds": "Rounds of remote pages through decode's staging slots.",
    "notifications_sent": "NIXL notifications sent.",
    "notifications_received": "NIXL notifications received.",
    "bad_notifications": "NIXL notifications received that could not be used.",
    "peer_message_errors": "Peer notifications whose handling raised: that request failed.",
    "unit_errors": "Scheduler orders and progress-round stages that raised: that unit failed.",
    "notifications_failed": "Notifications not sent (too large, or refused); peer kept.",
    "leases_expired": "Prefill holds freed because their reader's lease expired.",
    "loads_held": "Failed loads reported only after their in-flight READs ended.",
    "held_overdue": "Failed loads whose READs still ran transfer_timeout_s after failing.",
    "quarantine_caps": "Times a prefill's quarantined READs passed max_quarantined_mib.",
    "background_thread_failures": "Background threads that died (the worker is unhealthy).",
    "progress_stalls": "Times the progress thread could not run for a second or more.",
    "progress_stall_seconds": "Seconds the progress thread was late in those stalls.",
    "rounds_deferred": "Progress rounds skipped while a peer's set-up held the NIXL agent.",
    "heartbeats_sent": "Lease heartbeats decode sent to prefill.",
    "read_probes": "Prefills decode READ at the handshake (extra.read_probe).",
    "read_probe_first_seconds": "Seconds of those probes' first READs (connection, mapping).",
    "read_probes_slow": "Prefills whose GPU memory the probe READ slower than 5 GB/s.",
    "packed_loads": "Decode loads moved as one packed range (extra.gather_mib).",
    "packed_fallbacks": "Decode loads that could move packed but moved their rows (no room).",
    "packed_bytes": "Bytes prefill packed into its gather arena for decode workers.",
    "packed_refused": "Claims or pushes prefill could not pack: no room in its arena.",
    "claims_sent": "Prepare messages decode sent claiming a hold.",
    "claims_resent": "Claims decode sent again because the first went unanswered.",
    "loads_verified": "Decode loads whose landed bytes matched prefill's digests.",
    "load_verify_failures": "Decode loads failed: landed bytes differ from prefill's digests.",
    "verify_unverified_groups": "Groups of verified loads left undigested (staged pages).",
    "digests_sent": "Claims prefill answered with digests of what their reader reads.",
    "pushes_written": "Push requests prefill wrote to completion.",
    "push_failures": "Push requests prefill answered with a failure.",
    "bytes_written": "Bytes prefill wrote into decode's blocks (push mode).",
    "staged_to_host_bytes": "Bytes staged from the cache into the host mirror (sender).",
    "staged_to_device_bytes": "Bytes staged from the host mirror into the cache (receiver).",
    "load_peer_seconds": "Seconds decode loads waited for their peer (handshake).",
    "load_prepare_seconds": "Seconds decode loads spent in the Prepare round trip.",
    "load_data_seconds": "Seconds decode loads spent moving data (READs or pushes).",
    "load_finish_seconds": "Seconds decode loads spent finishing (staging in, rewrites).",
    # the scheduler side (the vLLM adapter reports these from its scheduler process)
    "sends_done": "Prefill holds a reader released after loading.",
    "sends_expired": "Prefill holds freed by lease expiry.",
    "sends_aborted": "Prefill holds freed because the request was aborted.",
    "loads_loaded": "Decode requests whose KV was loaded from prefill.",
    "loads_recomputed": "Decode requests recomputed after a failed load.",
    "loads_failed": "Decode requests failed after a failed load.",
    "loads_aborted": "Decode requests aborted while loading.",
    "loads_released": "Decode loads released to prefill without reading.",
    "loads_unserved": "Decode loads prefill's params could not serve (blocks not kept).",
    "bad_params": "Requests whose kv_transfer_params could not be used.",
}
PEER_STATE_HELP = (
    "1 for each peer's current state (ready, connecting, refused, incompatible, bad_secret, "
    "unreachable, failed), 0 for the others."
)
PEER_FAILURES_HELP = "Failed handshakes with peers, by reason (incompatible, bad_secret, ...)."
PEER_STATES = (
    "ready",
    "connecting",
    "refused",
    "incompatible",
    "bad_secret",
    "unreachable",
    "failed",
)
GAUGE_HELP = {
    "held_requests": "Prefill requests whose blocks are held for a reader.",
    "held_blocks": "Prefill blocks held for readers.",
    "loading_requests": "Decode requests waiting for a load.",
}
# counters the load-phase histogram shows better (its _sum is their value)
_IN_HISTOGRAM = {f"load_{p}_seconds" for p in LOAD_PHASES}


def metric_families(metrics: ConnectorMetrics, prefix: str = "kvbridge") -> Iterator[Metric]:
    """The counters (``<prefix>_<field>_total``) and the load-phase histogram."""
    for name, value in metrics.counters().items():
        if name not in _IN_HISTOGRAM:
            yield CounterMetricFamily(f"{prefix}_{name}", HELP[name], value=value)
    hist = HistogramMetricFamily(
        f"{prefix}_load_phase_seconds",
        "Seconds each decode load spent per phase: peer (handshake), prepare, data, finish.",
        labels=["phase"],
    )
    bounds = [str(b) for b in LOAD_PHASE_BUCKETS] + ["+Inf"]
    for phase in LOAD_PHASES:
        counts = metrics.load_phase_buckets[phase]
        cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
        buckets = list(zip(bounds, cumulative, strict=True))
        hist.add_metric([phase], buckets, getattr(metrics, f"load_{phase}_seconds"))
    yield hist
    yield engine_call_family(metrics.engine_calls, prefix)
    blocks = GaugeMetricFamily(
        f"{prefix}_quarantined_blocks",
        "Decode block rows of failed loads that this prefill's READs or owed push rounds "
        "may still write.",
        labels=["peer"],
    )
    num_bytes = GaugeMetricFamily(
        f"{prefix}_quarantined_bytes",
        "Bytes of failed loads that this prefill's READs or owed push rounds may still write.",
        labels=["peer"],
    )
    for peer, (n_blocks, n_bytes) in sorted(metrics.quarantined.items()):
        blocks.add_metric([peer], n_blocks)
        num_bytes.add_metric([peer], n_bytes)
    yield blocks
    yield num_bytes
    for name, by_kind, what in (
        ("peer_message_errors_by_kind", metrics.peer_message_errors_by_kind, "Peer notifications"),
        ("unit_errors_by_kind", metrics.unit_errors_by_kind, "Orders and round stages"),
    ):
        family = CounterMetricFamily(
            f"{prefix}_{name}", f"{what} whose handling raised, by kind.", labels=["kind"]
        )
        for kind, count in sorted(by_kind.items()):
            family.add_metric([kind], count)
        yield family
    yield from peer_families(metrics.peer_states, metrics.peer_failures, prefix)


def peer_families(
    states: dict[str, str], failures: dict[str, int], prefix: str = "kvbridge"
) -> Iterator[Metric]:
    """``<prefix>_peer_state{peer,state}`` (1 for the peer's state, 0 for the others) and
    ``<prefix>_peer_failures_total{reason}``."""
    gauge = GaugeMetricFamily(f"{prefix}_peer_state", PEER_STATE_HELP, labels=["peer", "state"])
    for peer, current in sorted(states.items()):
        for state in PEER_STATES:
            gauge.add_metric([peer, state], 1.0 if state == current else 0.0)
    yield gauge
    counter = CounterMetricFamily(f"{prefix}_peer_failures", PEER_FAILURES_HELP, labels=["reason"])
    for reason, count in sorted(failures.items()):
        counter.add_metric([reason], count)
    yield counter


def engine_call_family(times: EngineCallTimes, prefix: str = "kvbridge") -> Metric:
    """``<prefix>_engine_call_seconds{hook=...}``: the histogram of ``times``."""
    family = HistogramMetricFamily(
        f"{prefix}_engine_call_seconds", ENGINE_CALL_HELP, labels=["hook"]
    )
    bounds = [str(b) for b in ENGINE_CALL_BUCKETS] + ["+Inf"]
    for hook, (counts, total) in sorted(times.histogram().items()):
        cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
        family.add_metric([hook], list(zip(bounds, cumulative, strict=True)), total)
    return family


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as ``{'name{label="value",...}': value}`` (labels sorted by name; a
    sample without labels is just its name), parsed by ``prometheus_client.parser``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


class _Families(Collector):
    def __init__(self, metrics: ConnectorMetrics, prefix: str) -> None:
        self.metrics, self.prefix = metrics, prefix

    def collect(self) -> Iterator[Metric]:
        return metric_families(self.metrics, self.prefix)
