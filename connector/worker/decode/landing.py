"""Decode's own work on a load's blocks once every transfer into them ended.

Runs only after NIXL reported each READ of the load done (pull) or prefill answered every
Push round (push), and before the load is reported to the engine::

    host staging    mirror -> cache (the READs landed in the host mirror)
    receiver        rewrite the wire arrangement into the cache's own (GroupPlan.receiver)
    engine merge    whole smaller remote pages side by side -> the engine's page order
    fence           every kernel above finished (kvbridge.connector.worker.device_order)

so the engine's next forward pass, on whatever stream, reads finished blocks.
"""

from __future__ import annotations

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.worker.decode.load_records import Load
from kvbridge.connector.worker.device_order import DeviceOrder
from kvbridge.connector.worker.staging.host_stage import HostStage
from kvbridge.connector.worker.staging.staged_reads import Repacker
from kvbridge.handshake.plan_model import TransferPlan
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.transforms import rewrite_group


class Landing:
    """Finishes loads whose transfers all ended."""

    def __init__(
        self,
        buffers: KVCacheBuffers,
        metrics: ConnectorMetrics,
        order: DeviceOrder,
        *,
        stage: HostStage | None = None,
        repacker: Repacker | None = None,
    ) -> None:
        self._buffers = buffers
        self._metrics = metrics
        self._order = order
        self._stage = stage
        self._repacker = repacker

    def finish(self, load: Load, plan: TransferPlan | None) -> None:
        """The load's blocks in the cache's own format, every kernel finished."""
        if self._stage is not None:
            for group_id, ids in load.touched.items():
                self._stage.to_device(group_id, ids)
        for g in plan.groups if plan is not None else ():
            ids = load.touched.get(g.group_id)
            if ids is None:
                continue
            if g.receiver:
                stats = rewrite_group(
                    self._buffers, g.group_id, ids, g.receiver.src, g.receiver.dst
                )
                self._metrics.receiver_rewrites += stats.num_blocks
            if g.repack_from:
                assert self._repacker is not None  # negotiation needs one for repacks
                self._repacker.merge(g.group_id, ids, g.repack_from)
                self._metrics.receiver_rewrites += int(ids.size)
        self._order.fence("load complete")
