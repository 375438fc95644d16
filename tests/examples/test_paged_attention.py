"""Paged K/V addressing on strided views, and the attention math over it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.examples.paged_attention import (
    AttentionCache,
    KVLayout,
    attend,
    paged_attention,
    read_kv,
    to_kernel_block_ids,
    write_kv,
)
from kvbridge.layouts.errors import BlockIdError, LayoutError

H, D = 2, 4


def carved_cache(
    *, num_blocks: int, block_size: int, kernel_block_size: int, layout: KVLayout, pad: int = 3
) -> tuple[AttentionCache, torch.Tensor, int]:
    """A cache whose K/V are views into one int8 buffer with ``pad`` floats around each page.

    Returns the cache, the buffer, and the float offset of the K page inside a buffer row.
    """
    r = block_size // kernel_block_size
    part = block_size * H * D  # floats in one K (or V) block
    row = pad + 2 * part + pad
    buf = torch.zeros((num_blocks, row * 4), dtype=torch.int8)
    floats = buf.view(torch.float32)
    inner = (kernel_block_size, H, D) if layout is KVLayout.NHD else (H, kernel_block_size, D)
    shape = (num_blocks, r, *inner)
    strides = (row, part // r, inner[1] * D, D, 1)
    k = floats.as_strided(shape, strides, storage_offset=pad)
    v = floats.as_strided(shape, strides, storage_offset=pad + part)
    assert not k.is_contiguous()
    cache = AttentionCache(
        k=k, v=v, layout=layout, kernel_block_size=kernel_block_size, block_size=block_size
    )
    return cache, buf, pad


def test_to_kernel_block_ids_expands_each_manager_block():
    got = to_kernel_block_ids(np.array([5, 0, 2]), 16, 4)
    assert got.tolist() == [20, 21, 22, 23, 0, 1, 2, 3, 8, 9, 10, 11]
    assert to_kernel_block_ids(np.array([3, 1]), 16, 16).tolist() == [3, 1]


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize(("block_size", "kernel_block_size"), [(16, 16), (16, 4), (8, 2)])
def test_write_lands_in_place_at_the_documented_address(layout, block_size, kernel_block_size):
    num_blocks = 6
    cache, buf, pad = carved_cache(
        num_blocks=num_blocks,
        block_size=block_size,
        kernel_block_size=kernel_block_size,
        layout=layout,
    )
    table = to_kernel_block_ids(np.array([4, 1, 3]), block_size, kernel_block_size)
    positions = torch.arange(0, 2 * block_size + 3)
    k = torch.randn(positions.numel(), H, D)
    v = torch.randn(positions.numel(), H, D)
    write_kv(cache, table, positions, k, v)

    floats = buf.view(torch.float32)
    part = block_size * H * D
    for p in (0, 1, block_size - 1, block_size, 2 * block_size + 2):
        kernel_id = int(table[p // kernel_block_size])
        r = block_size // kernel_block_size
        block, sub, slot = kernel_id // r, kernel_id % r, p % kernel_block_size
        base = pad + sub * (part // r)
        for h in range(H):
            inside = slot * H + h if layout is KVLayout.NHD else h * kernel_block_size + slot
            at = base + inside * D
            assert torch.equal(floats[block, at : at + D], k[p, h])
            assert torch.equal(floats[block, part + at : part + at + D], v[p, h])
    # Untouched blocks and the padding around pages stay zero.
    assert not floats[[0, 2, 5]].any()
    assert not floats[:, :pad].any() and not floats[:, pad + 2 * part :].any()

    k_back, v_back = read_kv(cache, table, positions)
    assert torch.equal(k_back, k) and torch.equal(v_back, v)


def test_out_of_range_ids_and_short_tables_raise():
    cache, _, _ = carved_cache(num_blocks=2, block_size=8, kernel_block_size=4, layout=KVLayout.NHD)
    kv = torch.zeros(1, H, D)
    with pytest.raises(BlockIdError, match="outside"):
        write_kv(cache, np.array([4]), torch.tensor([0]), kv, kv)
    with pytest.raises(BlockIdError, match="outside"):
        read_kv(cache, np.array([-1]), torch.tensor([0]))
    with pytest.raises(BlockIdError, match="needs entry 2"):
        read_kv(cache, np.array([0, 1]), torch.tensor([8]))


def test_cache_shape_must_match_layout_and_ratio():
    k = torch.zeros(3, 2, 4, H, D)
    AttentionCache(k=k, v=k, layout=KVLayout.NHD, kernel_block_size=4, block_size=8)
    with pytest.raises(LayoutError, match="does not match HND"):
        AttentionCache(k=k, v=k, layout=KVLayout.HND, kernel_block_size=4, block_size=8)
    with pytest.raises(LayoutError, match="does not divide"):
        AttentionCache(k=k, v=k, layout=KVLayout.NHD, kernel_block_size=3, block_size=8)


def test_attend_matches_explicit_softmax_with_window_and_gqa():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, D), torch.randn(6, 2, D), torch.randn(6, 2, D)
    q_pos, k_pos = torch.tensor([3, 4, 5]), torch.arange(6)
    out = attend(q, k, v, q_positions=q_pos, k_positions=k_pos, scale=0.7, sliding_window=2)
    for i, p in enumerate(q_pos.tolist()):
        for h in range(4):
            keys = [j for j in range(6) if p - 2 < j <= p]
            logits = torch.stack([q[i, h] @ k[j, h // 2] for j in keys]) * 0.7
            want = torch.softmax(logits, 0) @ v[keys, h // 2]
            torch.testing.assert_close(out[i, h], want)


@pytest.mark.parametrize("layout", list(KVLayout))
def test_sliding_window_reads_only_blocks_inside_the_window(layout):
    cache, _, _ = carved_cache(num_blocks=8, block_size=4, kernel_block_size=2, layout=layout)
    table = to_kernel_block_ids(np.arange(8)[::-1].copy(), 4, 2)
    torch.manual_seed(1)
    n = 20
    k, v = torch.randn(n, H, D), torch.randn(n, H, D)
    write_kv(cache, table, torch.arange(n - 1), k[:-1], v[:-1])
    window = 5
    q = torch.randn(1, 4, D)
    want = attend(
        q,
        k,
        v,
        q_positions=torch.tensor([n - 1]),
        k_positions=torch.arange(n),
        scale=1.0,
        sliding_window=window,
    )
    # Poison every kernel block wholly before the window (positions <= n - 1 - window).
    for entry in range((n - window) // 2):
        kid = int(table[entry])
        cache.k[kid // 2, kid % 2] = float("nan")
        cache.v[kid // 2, kid % 2] = float("nan")
    got = paged_attention(
        q,
        k[-1:],
        v[-1:],
        cache=cache,
        block_table=table,
        positions=torch.tensor([n - 1]),
        scale=1.0,
        sliding_window=window,
    )
    torch.testing.assert_close(got, want)
    full = paged_attention(
        q,
        k[-1:],
        v[-1:],
        cache=cache,
        block_table=table,
        positions=torch.tensor([n - 1]),
        scale=1.0,
    )
    assert torch.isnan(full).all(), "without the window the poisoned blocks must be read"
