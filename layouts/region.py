"""Registered memory regions: what NIXL registers and what descriptors index.

A region is a run of equally spaced blocks inside one allocation::

    base_addr
    |<- block_stride_bytes ->|<- block_stride_bytes ->|
    [ block 0 .. block_bytes ][ block 1 .. block_bytes ] ... (num_blocks)

Per-layer caches and canonical cross-layer buffers describe themselves the same way, so
registration and descriptor code never need to know which one they hold.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kvbridge.layouts.errors import LayoutError


class MemoryKind(enum.Enum):
    """Where a region lives; maps onto NIXL's ``DRAM`` / ``VRAM`` in one place (connector)."""

    DRAM = "DRAM"
    VRAM = "VRAM"

    @classmethod
    def of(cls, tensor: torch.Tensor) -> MemoryKind:
        return cls.VRAM if tensor.device.type == "cuda" else cls.DRAM


@dataclass(frozen=True, kw_only=True)
class KVRegion:
    """``num_blocks`` blocks of ``block_bytes`` each, ``block_stride_bytes`` apart."""

    name: str
    base_addr: int
    block_bytes: int
    block_stride_bytes: int
    num_blocks: int
    memory_kind: MemoryKind
    device_id: int = 0

    def __post_init__(self) -> None:
        if self.block_bytes <= 0 or self.num_blocks <= 0:
            raise LayoutError(
                f"region {self.name!r}: block_bytes={self.block_bytes} and "
                f"num_blocks={self.num_blocks} must both be positive"
            )
        if self.block_stride_bytes < self.block_bytes:
            raise LayoutError(
                f"region {self.name!r}: block_stride_bytes={self.block_stride_bytes} is "
                f"smaller than block_bytes={self.block_bytes}; blocks would overlap"
            )

    @property
    def span_bytes(self) -> int:
        """Bytes from the first block's start to the last block's end."""
        return (self.num_blocks - 1) * self.block_stride_bytes + self.block_bytes

    def block_addr(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            from kvbridge.layouts.errors import BlockIdError

            raise BlockIdError(
                f"region {self.name!r}: block id {block_id} outside [0, {self.num_blocks})"
            )
        return self.base_addr + block_id * self.block_stride_bytes
