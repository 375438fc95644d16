"""Prefill side of packed transfers: a load's rows copied into one range of an arena.

A decode whose load would move many small rows asks for them packed (``extra.gather_mib``
on both sides; ``kvbridge.connector.worker.packed_rows``). Prefill names the rows with
decode's own plan, as it does to digest a verified load
(``kvbridge.connector.worker.prefill.reader_digests``), copies them, in the plan's order,
into a run of free pages of its arena, and waits for the copy on the device::

    pull  Prepare(packed, plan digest, tokens) -> rows of decode's plan, on our block ids
                                               -> a run of free pages: gather, fence
                                               <- Prepared(packed_at, packed_bytes)
          (no run free, no plan)               <- Prepared(packed_at=-1): decode reads rows
    push  Push(packed_at: decode's landing)    -> gather, fence, one WRITE of the run into
          (``kvbridge.connector.worker.prefill.pushes``)  decode's landing, Pushed(packed)

A claim's pages are lent like the blocks: to the request, until its hold ends (every
reader's ``Done``, or the lease), since decode's READ of them counts only within that
hold. The same claim sent again (same reader, plan, tokens and rewrites) is answered the
same range, copied once; another claim gets its own. A push's pages belong to its WRITE
until NIXL says it ended. The last page's tail is zeroed: the whole pages move. The arena
is registered before the worker describes itself, so the NIXL metadata a peer gets covers
it, and advertised in pages (``WorkerDescription.gather``). On a GPU it is allocated after
the engine sized its KV cache: outside vLLM's ``gpu_memory_utilization``.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvbridge.connector.common.metadata import SendSpec
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import Prepare
from kvbridge.connector.transfer.transport import DescList, TransferEngine
from kvbridge.connector.worker.device_order import DeviceOrder
from kvbridge.connector.worker.digests import PlanSide
from kvbridge.connector.worker.packed_rows import PackedRows, gather, packed_rows
from kvbridge.connector.worker.prefill.reader_digests import ReaderDigests, writer_rows
from kvbridge.connector.worker.staging.arenas import StagingArena, slot_region
from kvbridge.layouts.descriptors import descriptor_table
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.region import KVRegion

logger = logging.getLogger(__name__)

PAGE_BYTES = 64 << 10  # the arena's lending unit (a packed range is a run of pages)


def open_arena(
    engine: TransferEngine, capacity_bytes: int, device: torch.device | str
) -> StagingArena:
    """Register the arena (``extra.gather_mib``, whole pages): before the worker
    describes itself. Decode lands packed ranges in pages of the same arena."""
    pages = capacity_bytes // PAGE_BYTES
    if pages < 1:
        raise KVBridgeError(
            f"extra.gather_mib: {capacity_bytes} B is less than one {PAGE_BYTES} B page"
        )
    return StagingArena(engine, pages * PAGE_BYTES, device)


class GatherArena:
    """The registered pages rows are packed into: lent to a claim until its request's
    hold ends (pull), or to a push until its WRITE ended (``kvbridge.connector.worker
    .prefill.pushes``)."""

    def __init__(
        self,
        engine: TransferEngine,
        arena: StagingArena,
        units: list[torch.Tensor],
        plans: ReaderDigests,
        order: DeviceOrder,
        metrics: ConnectorMetrics,
    ) -> None:
        """``arena``: from :func:`open_arena`; ``units``: this worker's region memory,
        where NIXL moves from (the host mirror when staged); ``plans``: the readers' plans
        (negotiated from the descriptions they sent with their handshake)."""
        self._engine = engine
        self._arena = arena
        self.region: KVRegion = slot_region(arena.region, PAGE_BYTES)
        self._units = units
        self._plans = plans
        self._order = order
        self._metrics = metrics
        self._list: DescList | None = None
        # request -> claim (reader, plan, tokens, rewrites) -> (pages, byte offset, bytes)
        self._lent: dict[str, dict[tuple, tuple[np.ndarray, int, int]]] = {}

    @property
    def num_lent_bytes(self) -> int:
        return self._arena.num_leased_bytes

    def local_list(self) -> DescList:
        """The arena's pages as this worker's descriptor list (row = page), prepared once."""
        if self._list is None:
            self._list = self._engine.prep_local(descriptor_table(self.region))
        return self._list

    def pack(self, spec: SendSpec, agent: str, msg: Prepare) -> tuple[int, int, str]:
        """Copy the rows ``msg``'s reader reads into a run of free pages: (byte offset,
        bytes, '') or (-1, 0, why not). Called after the claim's rewrites: the rows are
        copied as the reader would READ them."""
        key = (agent, msg.reader_rank, msg.plan_digest, msg.start_token, msg.end_token)
        key += tuple(msg.rewrites)
        lent = self._lent.get(spec.request_id, {}).get(key)
        if lent is not None:  # the same claim sent again: the range is there already
            return lent[1], lent[2], ""
        try:
            layout, plan = self._plans.plan_for(agent, msg.plan_digest)
            packed = packed_rows(
                plan, PlanSide.WRITER, writer_rows(layout, spec, msg.start_token, msg.end_token)
            )
        except Exception as exc:  # a claim naming rows we cannot plan: never this worker's
            return -1, 0, f"not packed: {exc!s}"
        if packed is None:
            return -1, 0, "not packed: a group of the plan goes through staging slots"
        pages, why = self.fill(packed)
        if not pages.size:
            return -1, 0, f"not packed: {why}"
        at = int(pages[0]) * PAGE_BYTES
        self._lent.setdefault(spec.request_id, {})[key] = (pages, at, packed.num_bytes)
        return at, packed.num_bytes, ""

    def fill(self, packed: PackedRows) -> tuple[np.ndarray, str]:
        """Lend a run of free pages and copy ``packed``'s rows into it, fenced: the pages
        (give them back with :meth:`give_back_pages`), or none and why."""
        if packed.num_bytes == 0:
            return np.zeros(0, dtype=np.int64), "the load moves no rows"
        pages = self._arena.lease_run(PAGE_BYTES, -(-packed.num_bytes // PAGE_BYTES))
        if not pages.size:
            self._metrics.packed_refused += 1
            return pages, (
                f"no run of {packed.num_bytes} B free in the gather arena "
                f"({self.num_lent_bytes} of {self._arena.capacity_bytes} B lent)"
            )
        at = int(pages[0]) * PAGE_BYTES
        try:
            gather(packed, self._units, self._arena.buf[at : at + packed.num_bytes])
            # the last page's tail is read too: no bytes of an earlier range go with it
            self._arena.buf[at + packed.num_bytes : at + int(pages.size) * PAGE_BYTES].zero_()
            self._order.fence("packed rows")  # UCX's copies do not see our stream
        except (KVBridgeError, RuntimeError) as exc:  # RuntimeError: torch
            self._arena.give_back(PAGE_BYTES, pages)
            logger.warning("packing %d rows failed: %s", packed.num_rows, exc)
            return pages[:0], str(exc)
        self._metrics.packed_bytes += packed.num_bytes
        return pages, ""

    def give_back_pages(self, pages: np.ndarray) -> None:
        self._arena.give_back(PAGE_BYTES, pages)

    def give_back(self, request_id: str) -> None:
        """The request's hold ended: every range lent for its claims is free again."""
        for pages, _, _ in self._lent.pop(request_id, {}).values():
            self._arena.give_back(PAGE_BYTES, pages)
