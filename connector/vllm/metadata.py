"""What crosses vLLM's scheduler <-> worker boundary for kvbridge.

vLLM pickles these between its engine-core and worker processes; they only wrap
kvbridge's own frozen metadata (``connector.metadata``).
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from connector.metadata import ConnectorMetadata, WorkerOutput


class KVBridgeMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    def __init__(self, meta: ConnectorMetadata) -> None:
        self.meta = meta


class KVBridgeWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: the whole :class:`WorkerOutput` (failures with
    their reasons, expired leases, heartbeats), not only vLLM's finished sets."""

    def __init__(self, output: WorkerOutput) -> None:
        self.output = output

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVBridgeWorkerMetadata:
        if not isinstance(other, KVBridgeWorkerMetadata):
            return self
        a, b = self.output, other.output
        return KVBridgeWorkerMetadata(
            WorkerOutput(
                finished_sending=a.finished_sending | b.finished_sending,
                finished_recving=a.finished_recving | b.finished_recving,
                failed_loads=a.failed_loads + b.failed_loads,
                expired_leases=a.expired_leases | b.expired_leases,
                notes={**a.notes, **b.notes},
                heartbeats=a.heartbeats | b.heartbeats,
            )
        )
