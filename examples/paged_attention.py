"""Paged attention over block tables: where a token's K/V live, writing them, reading them.

A layer's cache is a pair of tensors ``k`` and ``v`` (same shape), each either::

    NHD: (num_blocks, r, kernel_block_size, num_kv_heads, head_size)
    HND: (num_blocks, r, num_kv_heads, kernel_block_size, head_size)

``num_blocks`` counts manager blocks of ``block_size`` tokens; each holds ``r = block_size //
kernel_block_size`` kernel blocks. The tensors may be strided views into a bigger buffer
(e.g. one canonical cross-layer allocation), so nothing here assumes contiguity: reads
and writes use advanced indexing on the views, and writes land in place.

Block tables are in *kernel* block ids. Token position ``p`` of a request lives in::

    kernel id  k = table[p // kernel_block_size],  slot p % kernel_block_size
    manager block k // r, sub-block k % r

    manager:  [        b=0        ][        b=1        ]
    kernel:   [ 0  ][ 1  ][ 2  ][ 3  ][ 4  ][ 5  ] ...     (r = 3)

``to_kernel_block_ids`` turns a request's manager ids into such a table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvbridge.layouts.block_table import kernel_ratio, to_kernel_block_ids
from kvbridge.layouts.errors import BlockIdError, LayoutError
from kvbridge.layouts.layout import KVLayout

__all__ = [
    "AttentionCache",
    "AttentionWeights",
    "KVLayout",
    "attend",
    "paged_attention",
    "read_kv",
    "rope",
    "to_kernel_block_ids",
    "write_kv",
]

BlockTableLike = Sequence[int] | np.ndarray | torch.Tensor


@dataclass(frozen=True, kw_only=True)
class AttentionCache:
    """One attention layer's K and V cache views (see the module docstring for shapes)."""

    k: torch.Tensor
    v: torch.Tensor
    layout: KVLayout
    kernel_block_size: int
    block_size: int

    def __post_init__(self) -> None:
        r = kernel_ratio(self.block_size, self.kernel_block_size)
        if self.k.shape != self.v.shape or self.k.dim() != 5:
            raise LayoutError(
                f"AttentionCache: k {tuple(self.k.shape)} and v {tuple(self.v.shape)} must "
                f"share one 5-D shape (num_blocks, r, ...)"
            )
        token_dim = 2 if self.layout is KVLayout.NHD else 3
        if self.k.shape[1] != r or self.k.shape[token_dim] != self.kernel_block_size:
            raise LayoutError(
                f"AttentionCache: shape {tuple(self.k.shape)} does not match {self.layout.value} "
                f"with r={r} kernel blocks of {self.kernel_block_size} tokens per block"
            )

    @classmethod
    def allocate(
        cls,
        *,
        num_blocks: int,
        block_size: int,
        kernel_block_size: int,
        num_kv_heads: int,
        head_size: int,
        layout: KVLayout,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> AttentionCache:
        """Fresh contiguous (zeroed) K and V tensors."""
        r = kernel_ratio(block_size, kernel_block_size)
        inner = (
            (kernel_block_size, num_kv_heads, head_size)
            if layout is KVLayout.NHD
            else (num_kv_heads, kernel_block_size, head_size)
        )
        shape = (num_blocks, r, *inner)
        k = torch.zeros(shape, dtype=dtype, device=device)
        return cls(
            k=k,
            v=torch.zeros_like(k),
            layout=layout,
            kernel_block_size=kernel_block_size,
            block_size=block_size,
        )

    def check(self, *, num_kv_heads: int, head_size: int) -> None:
        if (self.num_kv_heads, self.head_size) != (num_kv_heads, head_size):
            raise LayoutError(
                f"AttentionCache holds {self.num_kv_heads} kv heads of {self.head_size}; "
                f"the layer needs {num_kv_heads} of {head_size}"
            )

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def blocks_per_manager_block(self) -> int:
        return self.k.shape[1]

    @property
    def num_kernel_blocks(self) -> int:
        return self.num_blocks * self.blocks_per_manager_block

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[3 if self.layout is KVLayout.NHD else 2]

    @property
    def head_size(self) -> int:
        return self.k.shape[4]


def _locate(
    cache: AttentionCache, block_table: BlockTableLike, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(manager block, sub-block, slot) index tensors of token ``positions``."""
    if isinstance(block_table, torch.Tensor):  # np.asarray cannot read a CUDA tensor
        table = block_table.to(positions.device, torch.int64)
    else:
        table = torch.as_tensor(np.asarray(block_table, dtype=np.int64), device=positions.device)
    kb = cache.kernel_block_size
    entry = positions // kb
    if positions.numel() and int(entry.max()) >= table.numel():
        raise BlockIdError(
            f"block table has {table.numel()} kernel blocks of {kb} tokens but position "
            f"{int(positions.max())} needs entry {int(entry.max())}"
        )
    kernel_ids = table[entry]
    if kernel_ids.numel() and (
        int(kernel_ids.min()) < 0 or int(kernel_ids.max()) >= cache.num_kernel_blocks
    ):
        bad = kernel_ids[(kernel_ids < 0) | (kernel_ids >= cache.num_kernel_blocks)]
        raise BlockIdError(
            f"kernel block id {int(bad[0])} lies outside [0, {cache.num_kernel_blocks}) "
            f"({cache.num_blocks} blocks x r={cache.blocks_per_manager_block})"
        )
    r = cache.blocks_per_manager_block
    return kernel_ids // r, kernel_ids % r, positions % kb


def write_kv(
    cache: AttentionCache,
    block_table: BlockTableLike,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store ``k``/``v`` of shape [T, num_kv_heads, head_size] at ``positions`` [T], in place."""
    block, sub, slot = _locate(cache, block_table, positions.to(cache.k.device))
    for dst, src in ((cache.k, k), (cache.v, v)):
        # With the head dim between the indices (HND) advanced indexing still yields
        # [T, H, D]: separated index tensors move their dimension to the front.
        if cache.layout is KVLayout.NHD:
            dst[block, sub, slot] = src.to(dst.dtype)
        else:
            dst[block, sub, :, slot] = src.to(dst.dtype)


def read_kv(
    cache: AttentionCache, block_table: BlockTableLike, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``positions`` [T] as new [T, num_kv_heads, head_size] tensors."""
    block, sub, slot = _locate(cache, block_table, positions.to(cache.k.device))
    if cache.layout is KVLayout.NHD:
        return cache.k[block, sub, slot], cache.v[block, sub, slot]
    return cache.k[block, sub, :, slot], cache.v[block, sub, :, slot]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal (optionally windowed) grouped-query attention.

    ``q`` [Tq, H, D], ``k``/``v`` [Tk, Hkv, D]; query ``i`` sees key ``j`` when
    ``q_pos - window < k_pos <= q_pos``. Returns [Tq, H, D].
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    delta = q_positions[:, None] - k_positions[None, :]
    visible = delta >= 0
    if sliding_window is not None:
        visible &= delta < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@dataclass(frozen=True, kw_only=True)
class AttentionWeights:
    """Projections of one attention layer (grouped-query: fewer K/V heads than Q heads)."""

    wq: torch.Tensor  # [hidden, num_heads * head_size]
    wk: torch.Tensor  # [hidden, num_kv_heads * head_size]
    wv: torch.Tensor  # [hidden, num_kv_heads * head_size]
    wo: torch.Tensor  # [num_heads * head_size, hidden]

    @classmethod
    def init(
        cls, gen: torch.Generator, *, hidden: int, num_heads: int, num_kv_heads: int, head_size: int
    ) -> AttentionWeights:
        q_dim, kv_dim = num_heads * head_size, num_kv_heads * head_size
        wq, wk, wv = (
            torch.randn(hidden, n, generator=gen) * hidden**-0.5 for n in (q_dim, kv_dim, kv_dim)
        )
        return cls(wq=wq, wk=wk, wv=wv, wo=torch.randn(q_dim, hidden, generator=gen) * q_dim**-0.5)

    def qkv(
        self, h: torch.Tensor, positions: torch.Tensor, *, head_size: int, rope_theta: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q [T, H, D], rotated k and v [T, Hkv, D] of normed hidden states ``h``."""
        q, k, v = ((h @ w).unflatten(-1, (-1, head_size)) for w in (self.wq, self.wk, self.wv))
        return rope(q, positions, theta=rope_theta), rope(k, positions, theta=rope_theta), v


def rope(x: torch.Tensor, positions: torch.Tensor, *, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` [T, H, D] (rotate-half convention)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cache: AttentionCache,
    block_table: BlockTableLike,
    positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Cache the new tokens' ``k``/``v``, then attend from ``q`` over everything cached.

    ``positions`` are the consecutive positions of the new tokens (one request).

    Only keys the queries can see are read: with a window, positions before
    ``positions[0] - window + 1`` are never touched, so their blocks may hold anything.
    """
    write_kv(cache, block_table, positions, k, v)
    start = int(positions[0]) if positions.numel() else 0
    first = 0 if sliding_window is None else max(0, start - sliding_window + 1)
    end = int(positions[-1]) + 1 if positions.numel() else 0
    key_positions = torch.arange(first, end, device=positions.device)
    k_all, v_all = read_kv(cache, block_table, key_positions)
    return attend(
        q,
        k_all,
        v_all,
        q_positions=positions,
        k_positions=key_positions,
        scale=scale,
        sliding_window=sliding_window,
    )
