"""Manager blocks vs kernel blocks.

The scheduler allocates *manager* blocks of ``block_size`` tokens; the attention kernel
indexes *kernel* blocks of ``kernel_block_size`` tokens. With ``r = block_size //
kernel_block_size``, manager block ``b`` is kernel blocks ``b*r .. b*r + r - 1``::

    manager:  [      b=0      ][      b=1      ]
    kernel:   [ 0 ][ 1 ][ 2 ][ 3 ][ 4 ][ 5 ] ...    (r = 3)
"""

from __future__ import annotations

import numpy as np

from kvbridge.layouts.errors import LayoutError


def kernel_ratio(block_size: int, kernel_block_size: int) -> int:
    """Kernel blocks per manager block; raises when the kernel size does not divide."""
    if block_size <= 0 or kernel_block_size <= 0:
        raise LayoutError(
            f"block_size={block_size} and kernel_block_size={kernel_block_size} "
            f"must both be positive"
        )
    if block_size % kernel_block_size:
        raise LayoutError(
            f"kernel_block_size={kernel_block_size} does not divide block_size={block_size}; "
            f"pick a kernel block size among the divisors of {block_size}"
        )
    return block_size // kernel_block_size


def to_kernel_block_ids(
    block_ids: np.ndarray, block_size: int, kernel_block_size: int
) -> np.ndarray:
    """Manager block ids -> kernel block ids, ``b -> b*r .. b*r+r-1`` in order."""
    r = kernel_ratio(block_size, kernel_block_size)
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.ndim != 1:
        raise LayoutError(f"block ids must be 1-D, got shape {ids.shape}")
    if ids.size and ids.min() < 0:
        raise LayoutError(f"block ids must be non-negative, got {int(ids.min())}")
    return (ids[:, None] * r + np.arange(r, dtype=np.int64)[None, :]).reshape(-1)


def to_manager_block_ids(
    kernel_block_ids: np.ndarray, block_size: int, kernel_block_size: int
) -> np.ndarray:
    """Kernel ids (whole manager blocks, in order) -> manager ids; the inverse of above."""
    r = kernel_ratio(block_size, kernel_block_size)
    ids = np.asarray(kernel_block_ids, dtype=np.int64)
    if ids.size % r:
        raise LayoutError(f"{ids.size} kernel ids are not a whole number of {r}-block groups")
    grid = ids.reshape(-1, r)
    heads = grid[:, 0]
    if np.any(heads % r) or np.any(grid != heads[:, None] + np.arange(r)):
        raise LayoutError(f"kernel ids {ids.tolist()} are not whole manager blocks of r={r}")
    return heads // r


class BlockTable:
    """Per-request manager block ids of one group, with kernel-id conversion."""

    __slots__ = ("_ids", "block_size", "kernel_block_size")

    def __init__(self, block_size: int, kernel_block_size: int) -> None:
        kernel_ratio(block_size, kernel_block_size)
        self.block_size = block_size
        self.kernel_block_size = kernel_block_size
        self._ids = np.zeros(0, dtype=np.int64)

    def append(self, block_ids: np.ndarray | list[int]) -> None:
        self._ids = np.concatenate([self._ids, np.asarray(block_ids, dtype=np.int64)])

    @property
    def block_ids(self) -> np.ndarray:
        return self._ids

    @property
    def kernel_block_ids(self) -> np.ndarray:
        return to_kernel_block_ids(self._ids, self.block_size, self.kernel_block_size)

    def __len__(self) -> int:
        return int(self._ids.size)

    def __repr__(self) -> str:
        return (
            f"BlockTable(block_size={self.block_size}, "
            f"kernel_block_size={self.kernel_block_size}, ids={self._ids.tolist()})"
        )
