"""Connector counters, rendered as Prometheus text by the example server."""

from __future__ import annotations

from dataclasses import dataclass, fields


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
    leases_expired: int = 0
    # decode: failed loads reported only after their in-flight READs ended (release is not
    # cancel), and those whose READs still ran transfer_timeout_s after the failure
    loads_held: int = 0
    held_overdue: int = 0
    # a background thread (idle progress) died: the worker reports itself unhealthy
    background_thread_failures: int = 0
    heartbeats_sent: int = 0
    claims_sent: int = 0  # decode: Prepare messages claiming a hold (one or more a source)
    # prefill: Push requests whose writes completed (one per load, or one per round of
    # decode's staging slots), and those answered with ok=False
    pushes_written: int = 0
    push_failures: int = 0
    bytes_written: int = 0  # prefill: bytes written into decode's blocks
    staged_to_host_bytes: int = 0  # host staging: cache -> host mirror (sender)
    staged_to_device_bytes: int = 0  # host staging: host mirror -> cache (receiver)
    # where decode's loads spent their time (kvbridge.connector.worker.decode.load_timeline):
    # waiting for the peer (handshake), the Prepare round trip, the data (READs or pushes),
    # finishing
    load_peer_seconds: float = 0.0
    load_prepare_seconds: float = 0.0
    load_data_seconds: float = 0.0
    load_finish_seconds: float = 0.0

    def prometheus(self, prefix: str = "kvbridge") -> str:
        lines = []
        for f in fields(self):
            kind = "counter"
            lines.append(f"# TYPE {prefix}_{f.name} {kind}")
            lines.append(f"{prefix}_{f.name} {getattr(self, f.name)}")
        return "\n".join(lines) + "\n"
