"""What crosses vLLM's scheduler <-> worker boundary for kvbridge.

vLLM pickles these between its engine-core and worker processes; they only wrap
kvbridge's own frozen metadata (``kvbridge.connector.common.metadata``).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvbridge.connector.common.metadata import ConnectorMetadata, WorkerOutput


class KVBridgeMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step. ``refused``: loads the scheduler side failed
    before any worker had them (``VLLMSchedulerSide.update_state_after_alloc``); every
    rank reports them finished and failed, so vLLM recomputes them."""

    def __init__(self, meta: ConnectorMetadata, refused: tuple[str, ...] = ()) -> None:
        self.meta = meta
        self.refused = refused


class KVBridgeWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: the whole :class:`WorkerOutput` (failures with
    their reasons, expired leases, heartbeats), not only vLLM's finished sets.

    vLLM aggregates the TP ranks' metadata into one; each rank's output stays apart
    (``outputs``), because a decode load ends only when every rank has reported it, and
    a union of the ranks' sets would count a load two ranks report in one step once."""

    def __init__(self, *outputs: WorkerOutput) -> None:
        self.outputs = outputs

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVBridgeWorkerMetadata:
        if not isinstance(other, KVBridgeWorkerMetadata):
            return self
        return KVBridgeWorkerMetadata(*self.outputs, *other.outputs)


@dataclass(frozen=True)
class KVBridgeHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once at startup (vLLM's ``get_handshake_metadata``, gathered
    from every rank into ``set_xfer_handshake_metadata``): the side-channel port this
    rank's listener bound, which the scheduler advertises in the params (with kv_port 0
    an ephemeral port only the worker knows). ``rank``: the worker among its engine's,
    stage-major (``pp_rank * tp_size + tp_rank``)."""

    rank: int
    side_channel_port: int
