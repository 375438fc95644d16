"""Block arrangements inside a unit: canonical views, same-bytes detection and run
permutations, all against naive per-element offsets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_reference import divisors

from layouts.arrangement import (
    BlockArrangement,
    UnitGeometry,
    canonical_view,
    run_permutation,
    same_bytes,
    token_major,
)
from layouts.errors import LayoutError
from layouts.layout import KVLayout

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def naive_offsets(g: UnitGeometry, arr: BlockArrangement) -> np.ndarray:
    """Element offset of every (layer, part, token, head, dim), written out longhand."""
    c, n = arr.num_chunks, arr.sub_blocks_per_chunk
    t = g.block_size // (c * n)
    out = np.empty((g.num_layers, g.num_kv_parts, g.block_size, g.num_heads, g.head_size), int)
    for layer in range(g.num_layers):
        for part in range(g.num_kv_parts):
            for token in range(g.block_size):
                chunk, sub, slot = token // (n * t), (token // t) % n, token % t
                sub_start = ((chunk * g.num_layers + layer) * n + sub) * g.num_kv_parts + part
                for head in range(g.num_heads):
                    for dim in range(g.head_size):
                        if arr.layout is KVLayout.NHD:
                            inner = (slot * g.num_heads + head) * g.head_size + dim
                        else:
                            inner = (head * t + slot) * g.head_size + dim
                        out[layer, part, token, head, dim] = (
                            sub_start * t * g.num_heads * g.head_size + inner
                        )
    return out


@st.composite
def geometries(draw):
    return UnitGeometry(
        num_layers=draw(st.integers(1, 3)),
        num_kv_parts=draw(st.integers(1, 2)),
        block_size=draw(st.sampled_from([1, 2, 4, 6, 8, 12])),
        num_heads=draw(st.integers(1, 3)),
        head_size=draw(st.integers(1, 4)),
        itemsize=draw(st.sampled_from([1, 2, 4, 8])),
    )


@st.composite
def arrangements(draw, block_size: int):
    chunk_tokens = draw(st.sampled_from(divisors(block_size)))
    sub = draw(st.sampled_from(divisors(chunk_tokens)))
    return BlockArrangement(
        layout=draw(st.sampled_from(list(KVLayout))),
        num_chunks=block_size // chunk_tokens,
        sub_blocks_per_chunk=chunk_tokens // sub,
    )


@settings(max_examples=100, deadline=None)
@given(g=geometries(), data=st.data())
def test_token_major_reads_the_naive_offsets(g, data):
    arr = data.draw(arrangements(g.block_size))
    num = data.draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(num)
    units = torch.randint(0, 256, (num, g.unit_bytes), dtype=torch.uint8, generator=gen)
    got = token_major(units, g, arr)
    assert got.shape == (num, g.num_layers, g.num_kv_parts, g.block_size, g.num_heads, g.head_size)
    assert got.dtype == g.element_dtype
    elems = units.numpy().view(_UINT[g.itemsize])  # (num, unit_elems)
    want = elems[:, naive_offsets(g, arr)]
    np.testing.assert_array_equal(got.numpy().view(_UINT[g.itemsize]), want)
    view = canonical_view(units, g, arr)
    c, n = arr.num_chunks, arr.sub_blocks_per_chunk
    assert view.shape[3:5] == (c, n) and view.shape[5] == g.block_size // (c * n)
    assert view.data_ptr() == units.data_ptr()  # a view, no copy


@settings(max_examples=100, deadline=None)
@given(g=geometries(), data=st.data())
def test_run_permutation_moves_every_element_to_its_destination(g, data):
    src = data.draw(arrangements(g.block_size))
    dst = data.draw(arrangements(g.block_size))
    off_src, off_dst = naive_offsets(g, src).reshape(-1), naive_offsets(g, dst).reshape(-1)
    assert same_bytes(g, src, dst) == bool(np.array_equal(off_src, off_dst))
    run, runs = run_permutation(g, src, dst)
    assert g.unit_elems % run == 0 and run % g.head_size == 0  # whole head vectors at least
    assert sorted(runs.tolist()) == list(range(g.unit_elems // run))
    source = np.arange(g.unit_elems) * 7 + 3
    moved = np.empty_like(source)
    moved.reshape(-1, run)[runs] = source.reshape(-1, run)
    want = np.empty_like(source)
    want[off_dst] = source[off_src]
    np.testing.assert_array_equal(moved, want)


def test_run_permutation_hand_example():
    g = UnitGeometry(
        num_layers=1, num_kv_parts=1, block_size=2, num_heads=2, head_size=3, itemsize=2
    )
    # NHD [t0h0 t0h1 t1h0 t1h1] -> HND [t0h0 t1h0 t0h1 t1h1]: 3-element runs, middle two swap
    run, runs = run_permutation(
        g, BlockArrangement(layout=KVLayout.NHD), BlockArrangement(layout=KVLayout.HND)
    )
    assert run == 3 and runs.tolist() == [0, 2, 1, 3]


def test_same_bytes_cases():
    g = UnitGeometry(
        num_layers=2, num_kv_parts=2, block_size=8, num_heads=1, head_size=4, itemsize=2
    )
    nhd, hnd = BlockArrangement(layout=KVLayout.NHD), BlockArrangement(layout=KVLayout.HND)
    assert same_bytes(g, nhd, hnd)  # one head: the layouts coincide
    multi = UnitGeometry(
        num_layers=1, num_kv_parts=2, block_size=8, num_heads=2, head_size=4, itemsize=2
    )
    assert not same_bytes(multi, nhd, hnd)
    sub2 = BlockArrangement(layout=KVLayout.NHD, sub_blocks_per_chunk=2)
    assert not same_bytes(multi, nhd, sub2)  # K/V interleave per sub-block
    one_part = UnitGeometry(
        num_layers=1, num_kv_parts=1, block_size=8, num_heads=1, head_size=4, itemsize=2
    )
    chunks = BlockArrangement(layout=KVLayout.HND, num_chunks=4, sub_blocks_per_chunk=2)
    assert same_bytes(one_part, nhd, chunks)


def test_geometry_and_arrangement_fields():
    g = UnitGeometry(
        num_layers=3, num_kv_parts=2, block_size=16, num_heads=4, head_size=8, itemsize=2
    )
    assert g.elems_per_token == 32
    assert g.unit_elems == 3 * 2 * 16 * 32 and g.unit_bytes == 2 * g.unit_elems
    assert g.element_dtype == torch.int16
    native = BlockArrangement.native(KVLayout.HND, 64, 16)
    assert (native.num_chunks, native.sub_blocks_per_chunk) == (1, 4)
    assert native.sub_block_size(64) == 16
    assert (
        str(BlockArrangement(layout=KVLayout.NHD, num_chunks=2, sub_blocks_per_chunk=3))
        == "2x3xNHD"
    )


def test_arrangement_errors_name_the_values():
    with pytest.raises(LayoutError, match=r"UnitGeometry\.num_heads=0 must be positive"):
        UnitGeometry(
            num_layers=1, num_kv_parts=2, block_size=4, num_heads=0, head_size=8, itemsize=2
        )
    with pytest.raises(LayoutError, match=r"itemsize=3 must be one of \[1, 2, 4, 8\]"):
        UnitGeometry(
            num_layers=1, num_kv_parts=2, block_size=4, num_heads=1, head_size=8, itemsize=3
        )
    with pytest.raises(LayoutError, match="num_chunks=0"):
        BlockArrangement(layout=KVLayout.NHD, num_chunks=0)
    arr = BlockArrangement(layout=KVLayout.NHD, num_chunks=2, sub_blocks_per_chunk=3)
    with pytest.raises(LayoutError, match="2 chunks x 3 sub-blocks does not divide 16"):
        arr.sub_block_size(16)
    with pytest.raises(LayoutError, match="kernel_block_size=5 does not divide block_size=16"):
        BlockArrangement.native(KVLayout.NHD, 16, 5)


def test_canonical_view_rejects_bad_units():
    g = UnitGeometry(
        num_layers=1, num_kv_parts=2, block_size=2, num_heads=1, head_size=2, itemsize=2
    )
    arr = BlockArrangement(layout=KVLayout.NHD)
    with pytest.raises(LayoutError, match=r"2-D uint8 tensor, got torch.int16 \(2, 8\)"):
        canonical_view(torch.zeros((2, 8), dtype=torch.int16), g, arr)
    with pytest.raises(LayoutError, match="rows hold 12 bytes but the geometry needs 16"):
        canonical_view(torch.zeros((2, 12), dtype=torch.uint8), g, arr)
    with pytest.raises(LayoutError, match="contiguous and element aligned"):
        canonical_view(torch.zeros((2, 33), dtype=torch.uint8)[:, :16], g, arr)
    with pytest.raises(LayoutError, match="contiguous and element aligned"):
        canonical_view(torch.zeros((16, 2), dtype=torch.uint8).t(), g, arr)
