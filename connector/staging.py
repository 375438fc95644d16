"""Staging slots: registered landing pages for remote pages larger than the local blocks.

A sender's engine-packed page (``block_packing``) that is ``r`` times larger than the
reader's block cannot be cut into the reader's blocks by byte ranges, so it is read whole
into a slot here; the reader's engine then splits the tokens it loads into its own blocks
and the slot goes back to the pool. One pool per slot size, allocated and registered with
the transfer engine the first time a plan needs it; its capacity is fixed (loads larger
than the pool move in rounds)::

    slot s:  [ layer 0 page | layer 1 page | ... ]     (a plan's streams, back to back)
"""

from __future__ import annotations

import numpy as np
import torch

from connector.config import ConfigError
from connector.transport import DescList, TransferEngine
from layouts.errors import KVBridgeError

DEFAULT_STAGING_MIB = 64


def staging_capacity(extra: dict[str, object]) -> int:
    """Bytes per staging pool from ``extra["staging_mib"]`` (default 64 MiB)."""
    mib = extra.get("staging_mib", DEFAULT_STAGING_MIB)
    if isinstance(mib, bool) or not isinstance(mib, int | float) or mib <= 0:
        raise ConfigError(
            f"extra.staging_mib={mib!r} must be a positive number of MiB (landing pages for "
            f"remote blocks larger than the local ones)"
        )
    return int(mib * (1 << 20))


class StagingPool:
    """``num_slots`` slots of ``slot_bytes`` each, registered once."""

    def __init__(
        self,
        engine: TransferEngine,
        *,
        slot_bytes: int,
        capacity_bytes: int,
        device: torch.device | str = "cpu",
    ) -> None:
        num_slots = capacity_bytes // slot_bytes
        if num_slots < 1:
            raise KVBridgeError(
                f"one staging slot needs {slot_bytes} B (a remote block of every layer of the "
                f"group) but the pool holds {capacity_bytes} B; raise extra.staging_mib"
            )
        self._engine = engine
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._buf = torch.zeros(num_slots, slot_bytes, dtype=torch.uint8, device=device)
        engine.register([self._buf])
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._leased: set[int] = set()
        self._lists: dict[tuple[int, int], DescList] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lease(self, n: int) -> np.ndarray:
        """Up to ``n`` free slots (none when every slot is taken)."""
        slots = [self._free.pop() for _ in range(min(n, len(self._free)))]
        self._leased.update(slots)
        return np.asarray(slots, dtype=np.int64)

    def give_back(self, slots: np.ndarray) -> None:
        for s in slots.tolist():
            if s not in self._leased:
                raise KVBridgeError(f"staging slot {s} given back but it was not leased")
            self._leased.discard(s)
            self._free.append(s)

    def local_list(self, offset: int, length: int) -> DescList:
        """Descriptors of ``length`` bytes at ``offset`` in every slot (row = slot)."""
        if offset < 0 or offset + length > self.slot_bytes:
            raise KVBridgeError(
                f"staging piece [{offset}, {offset + length}) outside a {self.slot_bytes} B slot"
            )
        dl = self._lists.get((offset, length))
        if dl is None:
            base = self._buf.data_ptr() + offset
            rows = np.arange(self.num_slots, dtype=np.int64)
            table = np.stack(
                [
                    base + rows * self.slot_bytes,
                    np.full(self.num_slots, length, dtype=np.int64),
                    np.zeros(self.num_slots, dtype=np.int64),
                ],
                axis=1,
            )
            dl = self._engine.prep_local(table)
            self._lists[(offset, length)] = dl
        return dl

    def pages(self, slots: np.ndarray, offset: int, length: int) -> torch.Tensor:
        """A copy of bytes ``[offset, offset + length)`` of ``slots``: ``[len(slots), length]``."""
        idx = torch.as_tensor(slots, dtype=torch.int64)
        return self._buf[:, offset : offset + length].index_select(0, idx)

    def close(self) -> None:
        for dl in self._lists.values():
            dl.release()
        self._lists.clear()


class StagingPools:
    """Pools by slot size, created on first use, each of ``capacity_bytes``."""

    def __init__(
        self, engine: TransferEngine, capacity_bytes: int, device: torch.device | str = "cpu"
    ) -> None:
        if capacity_bytes <= 0:
            raise KVBridgeError(f"staging capacity must be positive, got {capacity_bytes} B")
        self._engine = engine
        self._device = device
        self.capacity_bytes = capacity_bytes
        self._pools: dict[int, StagingPool] = {}

    def pool(self, slot_bytes: int) -> StagingPool:
        pool = self._pools.get(slot_bytes)
        if pool is None:
            pool = StagingPool(
                self._engine,
                slot_bytes=slot_bytes,
                capacity_bytes=self.capacity_bytes,
                device=self._device,
            )
            self._pools[slot_bytes] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
