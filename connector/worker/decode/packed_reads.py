"""Decode side of packed transfers: one range of prefill's packed rows, then into place.

A source whose plan would move at least ``MIN_ROWS`` rows, from or to a prefill that
advertises a gather arena in pages of ours (``extra.gather_mib`` on both sides), moves
packed (``kvbridge.connector.worker.packed_rows``)::

    start     rows of the load (our plan) -> a run of free pages of our arena (the
              landing), or the rows as they are (no run free: counted)
    pull      Prepare(packed, plan digest, tokens); wait for the answer
              Prepared(packed_at >= 0) -> one READ: their pages -> our landing pages
              Prepared(packed_at = -1)  -> landing back, read the rows (counted)
    push      Push(packed_at: our landing) -> prefill WRITEs its packed pages there
              Pushed(packed)  -> the rows are in the landing; not packed: in our blocks
    arrived   scatter the landing into our blocks; the landing back once that finished

The landing belongs to the READ, or the push round, that writes into it until it ended
(the READ: NIXL says so; the round: prefill answered it): a load that fails before hands
it to the quarantine with them (``kvbridge.connector.worker.decode.quarantine``), which
gives the pages back only then. After the scatter the pages go back once its kernels
finished (a mark, looked at each step, never waited for), since the next packed load may
land in them. Both ranges are runs of adjacent 64 KiB pages:
kvbridge posts (and counts in ``descriptors_posted``) one row per page, which NIXL
coalesces into one operation. Waiting for prefill's answer before the READ (the rows
must be packed first) costs a pull the claim's round trip, which an unpacked load
without rewrites does not wait for.
"""

from __future__ import annotations

import numpy as np
import torch

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.transfer.transport import PostFailedError, TransferEngine
from kvbridge.connector.worker.decode.inflight import Load, LoadState, Source
from kvbridge.connector.worker.device_order import DeviceOrder, Mark
from kvbridge.connector.worker.digests import PlanSide
from kvbridge.connector.worker.packed_rows import packed_rows, scatter
from kvbridge.connector.worker.peers import Peer
from kvbridge.connector.worker.plan_lists import GATHER_LIST
from kvbridge.connector.worker.rows import GroupRows
from kvbridge.connector.worker.staging.arenas import StagingArena, StagingPool
from kvbridge.connector.worker.staging.staged_reads import StageBatch
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.errors import KVBridgeError

MIN_ROWS = 64  # a load that would post fewer rows reads them as they are


class PackedReads:
    """The landing pages of one decode worker's packed reads."""

    def __init__(
        self,
        engine: TransferEngine,
        arena: StagingArena,
        page_bytes: int,
        buffers: KVCacheBuffers,
        units: list[torch.Tensor],
        order: DeviceOrder,
        metrics: ConnectorMetrics,
    ) -> None:
        """``arena``: the worker's gather arena (prefill packs into it, we land in it);
        ``units``: our region memory, where NIXL moves to (the host mirror when staged)."""
        self._engine = engine
        self._pool = StagingPool(engine, arena, page_bytes)
        self._buffers = buffers
        self._units = units
        self._order = order
        self._metrics = metrics
        # landings scattered, given back once the scatter's kernels finished (a mark)
        self._draining: list[tuple[Mark, StageBatch]] = []

    def lease(
        self, load: Load, src: Source, peer: Peer, found: dict[int, GroupRows] | None = None
    ) -> bool:
        """Lease a landing for ``src`` when its rows should move packed (``src.packed`` and
        ``src.landing`` set); False: they move as they are. ``found``: the load's rows by
        group, when the caller has them."""
        if GATHER_LIST not in peer.remote_lists or peer.plan is None:
            return False
        self.drain()  # landings whose scatter finished since the last step are free
        specs = self._buffers.config.groups
        if found is None:
            found = {g.group_id: load.rows(g, specs[g.group_id].spec) for g in peer.plan.groups}
        rows = packed_rows(peer.plan, PlanSide.READER, lambda g: found[g.group_id])
        if rows is None or rows.num_rows < MIN_ROWS:
            return False
        pages = self._pool.lease_run(-(-rows.num_bytes // self._pool.slot_bytes))
        if not pages.size:
            self._metrics.packed_fallbacks += 1
            return False
        for group_id, rows_of_group in found.items():  # the blocks that will get data
            if rows_of_group.touched is not None:
                load.touch(group_id, rows_of_group.touched)
        src.packed = rows
        src.landing = StageBatch(None, pages[:0], self._pool, pages)
        return True

    def landing_at(self, src: Source) -> int:
        """The byte offset of ``src``'s landing in our gather arena (push: where prefill
        WRITEs the packed range)."""
        assert src.landing is not None
        return int(src.landing.slots[0]) * self._pool.slot_bytes

    def pushed(self, load: Load, src: Source, *, ok: bool, packed: bool, num_bytes: int) -> None:
        """Prefill answered the push round that named the landing (none of its WRITEs runs
        any more): the rows into place when they came packed, then the landing goes back.
        Raises :class:`KVBridgeError` for packed bytes that are not the ones we named."""
        if ok and packed:
            assert src.packed is not None
            if num_bytes != src.packed.num_bytes:
                self._give_back(src)
                raise KVBridgeError(
                    f"prefill {src.key} wrote {num_bytes} B packed, we named {src.packed.num_bytes}"
                )
            self.land(load, src)
            return
        if ok:
            self._metrics.packed_fallbacks += 1  # written into the blocks as they are
        self._give_back(src)

    def post(self, load: Load, src: Source, peer: Peer) -> bool:
        """Prefill answered the claim: post the one READ of its packed range (True), or,
        not packed, give the landing back (False: read the rows). Raises
        :class:`KVBridgeError` for an answer that does not fit what we asked."""
        landing, rows = src.landing, src.packed
        assert landing is not None and rows is not None
        if src.packed_at < 0:
            self._give_back(src)
            self._metrics.packed_fallbacks += 1
            return False
        remote = peer.remote_lists.get(GATHER_LIST)
        page = self._pool.slot_bytes
        first, n = src.packed_at // page, int(landing.slots.size)
        if (
            remote is None
            or src.packed_bytes != rows.num_bytes
            or src.packed_at % page
            or first + n > remote.num_descs
        ):
            raise KVBridgeError(
                f"prefill {src.key} packed {src.packed_bytes} B at {src.packed_at}, we read "
                f"{rows.num_bytes} B in {page} B pages of its {remote.num_descs if remote else 0}"
            )
        local = self._pool.local_list(0, page)
        try:
            handle = self._engine.read(local, landing.slots, remote, np.arange(first, first + n))
        except PostFailedError as exc:  # part of it may run: held with the landing
            landing.handles.append(exc.handle)
            src.handles.append(exc.handle)
            raise
        landing.handles.append(handle)
        src.handles.append(handle)
        load.num_bytes += rows.num_bytes
        self._metrics.descriptors_posted += handle.num_descs
        return True

    def land(self, load: Load, src: Source) -> None:
        """The rows arrived: copy them into our blocks; the landing goes back once the
        copy finished (the next packed load may land in these pages), never waited for
        here: on a GPU by a mark that :meth:`drain` looks at."""
        landing, rows = src.landing, src.packed
        assert landing is not None and rows is not None
        # before the call (one that raises may have queued some): the load is reported,
        # landed or failed, once a mark after these completed
        load.kernels = True
        scatter(rows, self._units, self._pool.run_bytes(landing.slots)[: rows.num_bytes])
        self._metrics.packed_loads += 1
        self._release(src)
        self._draining.append((self._order.mark("packed scatter"), landing))
        self.drain()

    def drain(self) -> None:
        """Give back the landings whose scatter finished (no wait: a GPU's next step)."""
        busy = []
        for mark, landing in self._draining:
            if mark.done():
                landing.pool.give_back(landing.slots)
            else:
                busy.append((mark, landing))
        self._draining = busy

    def held(self, src: Source) -> StageBatch | None:
        """A failing load: the landing with the READ, or the push round, that may still
        write into it (for the quarantine, which waits for them), or None when neither
        runs (the pages go back now)."""
        landing, src.landing, src.packed = src.landing, None, None
        if landing is None or landing.handles or src.state is LoadState.PUSHED:
            return landing
        landing.pool.give_back(landing.slots)
        return None

    def close(self) -> None:
        """Shutdown: the memory goes with the process."""
        self._draining.clear()
        self._pool.close()

    def _give_back(self, src: Source) -> None:
        landing = self._release(src)
        if landing is not None:
            landing.pool.give_back(landing.slots)

    def _release(self, src: Source) -> StageBatch | None:
        """``src``'s landing, detached, with the READ that filled it released (it ended)."""
        landing, src.landing, src.packed = src.landing, None, None
        if landing is not None:
            for h in landing.handles:
                if h in src.handles:
                    src.handles.remove(h)
                self._engine.release(h)
            landing.handles.clear()
        return landing
