"""Staging slots: registered landing pages for remote pages that do not fit local blocks.

A sender's engine-packed page (``block_packing``) that is larger than the reader's block,
or of a size that does not divide it, cannot be cut into the reader's blocks by byte
ranges, so it lands whole in a slot here (read by decode, or written by prefill in push
mode); the reader's engine then splits the tokens it loads into its own blocks and the
slot goes back. A load larger than the free slots moves in rounds.

One registered arena of ``extra.staging_mib`` bytes holds every slot. Slot ``i`` of size
``S`` is bytes ``[i*S, (i+1)*S)`` of it (:func:`slot_region`, the same addresses on both
sides of a push), so pools of different slot sizes overlap: the arena leases byte ranges,
and a slot is free only while no leased slot of any size covers one of its bytes::

    arena    [ 0  | 1  | 2  | 3  | 4  | 5  ]        pool of 96 KiB slots
             [  0    |  1    |  2    |  3    ]      pool of 144 KiB slots
    slot s   [ layer 0 page | layer 1 page | ... ]  (a plan's streams, back to back)

Pull registers the arena the first time a plan needs a slot. Push registers it before the
worker describes itself: prefill writes into it, so the NIXL metadata it gets in the
handshake must cover it, and the description advertises it (``WorkerDescription.staging``).
"""

from __future__ import annotations

import numpy as np
import torch

# re-exported for the decode side's receiver, which sizes its own pools when none are handed
# in; the default lives with the key (ExtraConfig.staging_mib)
from kvbridge.connector.common.config import DEFAULT_STAGING_MIB as DEFAULT_STAGING_MIB
from kvbridge.connector.transfer.transport import DescList, TransferEngine
from kvbridge.handshake.plan_model import GroupPlan
from kvbridge.layouts.descriptors import block_descriptors
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.region import KVRegion, MemoryKind


def slot_region(arena: KVRegion, slot_bytes: int) -> KVRegion:
    """The arena as ``capacity // slot_bytes`` slots of ``slot_bytes``: the region both a
    reader's pool and a pushing writer's descriptors index by slot id."""
    num_slots = arena.block_bytes // slot_bytes
    if num_slots < 1:
        raise KVBridgeError(
            f"one staging slot needs {slot_bytes} B (a remote block of every layer of the "
            f"group) but the pool holds {arena.block_bytes} B; raise extra.staging_mib"
        )
    return KVRegion(
        name=f"{arena.name}/{slot_bytes}",
        base_addr=arena.base_addr,
        block_bytes=slot_bytes,
        block_stride_bytes=slot_bytes,
        num_blocks=num_slots,
        memory_kind=arena.memory_kind,
        device_id=arena.device_id,
    )


def slot_offsets(g: GroupPlan) -> tuple[int, ...]:
    """Where each of a staged plan's streams lands inside a slot (its pages back to back)."""
    ends = np.cumsum([0, *(s.local_chunk_bytes for s in g.streams)])
    return tuple(int(ends[i]) + s.local_offsets[0] for i, s in enumerate(g.streams))


class StagingArena:
    """The registered bytes every slot size leases from (see the module docstring)."""

    def __init__(
        self, engine: TransferEngine, capacity_bytes: int, device: torch.device | str = "cpu"
    ) -> None:
        if capacity_bytes <= 0:
            raise KVBridgeError(f"staging capacity must be positive, got {capacity_bytes} B")
        self.buf = torch.zeros(capacity_bytes, dtype=torch.uint8, device=device)
        engine.register([self.buf])
        self.region = KVRegion(
            name="staging",
            base_addr=self.buf.data_ptr(),
            block_bytes=capacity_bytes,
            block_stride_bytes=capacity_bytes,
            num_blocks=1,
            memory_kind=MemoryKind.of(self.buf),
            device_id=self.buf.device.index or 0,
        )
        # leased byte ranges [start, end): disjoint, sorted by start (so also by end)
        self._starts = np.zeros(0, dtype=np.int64)
        self._ends = np.zeros(0, dtype=np.int64)

    @property
    def capacity_bytes(self) -> int:
        return self.region.block_bytes

    @property
    def num_leased_bytes(self) -> int:
        return int((self._ends - self._starts).sum())

    def free_slots(self, slot_bytes: int) -> np.ndarray:
        """Ids of the ``slot_bytes`` slots no leased range touches, lowest first."""
        starts = np.arange(self.capacity_bytes // slot_bytes, dtype=np.int64) * slot_bytes
        # the last leased range that starts before a slot ends is the only one that can
        # reach into it (ranges are disjoint and sorted)
        last = np.searchsorted(self._starts, starts + slot_bytes, side="left") - 1
        ends = np.concatenate([self._ends, [0]])[last]  # last == -1: nothing before
        return np.flatnonzero((last < 0) | (ends <= starts))

    def lease(self, slot_bytes: int, n: int) -> np.ndarray:
        """Up to ``n`` free ``slot_bytes`` slots (none when no such slot is free)."""
        return self._take(slot_bytes, self.free_slots(slot_bytes)[: max(n, 0)])

    def lease_run(self, slot_bytes: int, n: int) -> np.ndarray:
        """``n`` free ``slot_bytes`` slots in a row, the lowest such run (none when no run
        of ``n`` is free): one contiguous range of the arena (packed reads)."""
        free = self.free_slots(slot_bytes)
        if n <= 0 or free.size < n:
            return free[:0]
        runs = np.flatnonzero(free[n - 1 :] - free[: free.size - n + 1] == n - 1)
        return self._take(slot_bytes, free[runs[0] : runs[0] + n] if runs.size else free[:0])

    def _take(self, slot_bytes: int, slots: np.ndarray) -> np.ndarray:
        starts = np.concatenate([self._starts, slots * slot_bytes])
        ends = np.concatenate([self._ends, (slots + 1) * slot_bytes])
        order = np.argsort(starts, kind="stable")
        self._starts, self._ends = starts[order], ends[order]
        return slots

    def give_back(self, slot_bytes: int, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        starts = slots * slot_bytes
        leased = np.zeros(slots.size, dtype=bool)
        at = np.searchsorted(self._starts, starts)
        if self._starts.size:
            at = np.minimum(at, self._starts.size - 1)
            leased = (self._starts[at] == starts) & (self._ends[at] == starts + slot_bytes)
        if not leased.all() or np.unique(slots).size != slots.size:
            bad = slots[~leased][0] if not leased.all() else slots[0]
            raise KVBridgeError(f"staging slot {int(bad)} given back but it was not leased")
        self._starts = np.delete(self._starts, at)
        self._ends = np.delete(self._ends, at)


class StagingPool:
    """The arena's slots of one size: leases, descriptor lists, page copies."""

    def __init__(self, engine: TransferEngine, arena: StagingArena, slot_bytes: int) -> None:
        self.region = slot_region(arena.region, slot_bytes)
        self._engine = engine
        self._arena = arena
        self.slot_bytes = slot_bytes
        self.num_slots = self.region.num_blocks
        self._slots = arena.buf[: self.num_slots * slot_bytes].view(self.num_slots, slot_bytes)
        self._lists: dict[tuple[int, int], DescList] = {}

    @property
    def num_free(self) -> int:
        return int(self._arena.free_slots(self.slot_bytes).size)

    def lease(self, n: int) -> np.ndarray:
        """Up to ``n`` free slots (none when every slot is taken)."""
        return self._arena.lease(self.slot_bytes, n)

    def lease_run(self, n: int) -> np.ndarray:
        """``n`` free slots in a row (none when no such run is free)."""
        return self._arena.lease_run(self.slot_bytes, n)

    def run_bytes(self, slots: np.ndarray) -> torch.Tensor:
        """The arena's bytes of a run of slots (from :meth:`lease_run`), as one 1-D view."""
        first = int(slots[0]) * self.slot_bytes
        return self._arena.buf[first : first + int(slots.size) * self.slot_bytes]

    def give_back(self, slots: np.ndarray) -> None:
        self._arena.give_back(self.slot_bytes, slots)

    def local_list(self, offset: int, length: int) -> DescList:
        """Descriptors of ``length`` bytes at ``offset`` in every slot (row = slot)."""
        if offset < 0 or offset + length > self.slot_bytes:
            raise KVBridgeError(
                f"staging piece [{offset}, {offset + length}) outside a {self.slot_bytes} B slot"
            )
        dl = self._lists.get((offset, length))
        if dl is None:
            table = block_descriptors(
                self.region, np.arange(self.num_slots), offsets=np.array([offset]), length=length
            )
            dl = self._engine.prep_local(table)
            self._lists[(offset, length)] = dl
        return dl

    def pages(self, slots: np.ndarray, offset: int, length: int) -> torch.Tensor:
        """A copy of bytes ``[offset, offset + length)`` of ``slots``: ``[len(slots), length]``."""
        idx = torch.as_tensor(slots, dtype=torch.int64, device=self._slots.device)
        return self._slots[:, offset : offset + length].index_select(0, idx)

    def close(self) -> None:
        for dl in self._lists.values():
            dl.release()
        self._lists.clear()


class StagingPools:
    """Pools by slot size, carved from one arena of ``capacity_bytes`` (registered by
    :meth:`open`, or on first use)."""

    def __init__(
        self, engine: TransferEngine, capacity_bytes: int, device: torch.device | str = "cpu"
    ) -> None:
        if capacity_bytes <= 0:
            raise KVBridgeError(f"staging capacity must be positive, got {capacity_bytes} B")
        self._engine = engine
        self._device = device
        self.capacity_bytes = capacity_bytes
        self._arena: StagingArena | None = None
        self._pools: dict[int, StagingPool] = {}

    @property
    def region(self) -> KVRegion | None:
        """The registered arena (None until :meth:`open` or a first pool)."""
        return self._arena.region if self._arena is not None else None

    @property
    def num_leased_bytes(self) -> int:
        return self._arena.num_leased_bytes if self._arena is not None else 0

    def open(self) -> KVRegion:
        """Register the arena now (push: before the worker describes itself)."""
        if self._arena is None:
            self._arena = StagingArena(self._engine, self.capacity_bytes, self._device)
        return self._arena.region

    def pool(self, slot_bytes: int) -> StagingPool:
        pool = self._pools.get(slot_bytes)
        if pool is None:
            self.open()
            assert self._arena is not None
            pool = StagingPool(self._engine, self._arena, slot_bytes)
            self._pools[slot_bytes] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
