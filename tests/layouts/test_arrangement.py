"""Block arrangements inside a unit: canonical views, same-bytes detection and run
permutations, all against naive per-element offsets."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_reference import divisors

from kvbridge.layouts.arrangement import (
    BlockArrangement,
    HeadOrder,
    UnitGeometry,
    canonical_view,
    element_offsets,
    run_permutation,
    same_bytes,
    token_major,
)
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.layout import KVLayout
from kvbridge.layouts.transforms import rewrite_units

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


# --- head-major arrangements (heads outermost in a layer or in a chunk) ---

HEAD_MAJOR = (HeadOrder.IN_LAYER, HeadOrder.IN_CHUNK)
TP_GEOMETRY = UnitGeometry(
    num_layers=2, num_kv_parts=2, block_size=8, num_heads=4, head_size=3, itemsize=2
)


def naive_head_major_offsets(g: UnitGeometry, arr: BlockArrangement) -> np.ndarray:
    """Element offset of every (layer, part, token, head, dim) of a head-major arrangement,
    written out longhand from the module docstring's diagram."""
    c, n = arr.num_chunks, arr.sub_blocks_per_chunk
    t = g.block_size // (c * n)
    L, P, H, D = g.num_layers, g.num_kv_parts, g.num_heads, g.head_size
    out = np.empty((L, P, g.block_size, H, D), int)
    for layer in range(L):
        for part in range(P):
            for token in range(g.block_size):
                chunk, sub, slot = token // (n * t), (token // t) % n, token % t
                # index of the [t, D] piece of (sub, part) inside one head of one layer
                piece = part * n + sub if arr.parts_outer else sub * P + part
                for head in range(H):
                    if arr.heads is HeadOrder.IN_CHUNK:
                        where = ((chunk * H + head) * L + layer) * n * P + piece
                    else:
                        where = ((chunk * L + layer) * H + head) * n * P + piece
                    for dim in range(D):
                        out[layer, part, token, head, dim] = (where * t + slot) * D + dim
    return out


@st.composite
def head_major_arrangements(draw, block_size: int):
    chunk_tokens = draw(st.sampled_from(divisors(block_size)))
    sub = draw(st.sampled_from(divisors(chunk_tokens)))
    return BlockArrangement(
        layout=draw(st.sampled_from(list(KVLayout))),
        num_chunks=block_size // chunk_tokens,
        sub_blocks_per_chunk=chunk_tokens // sub,
        parts_outer=draw(st.booleans()),
        heads=draw(st.sampled_from(HEAD_MAJOR)),
    )


@settings(max_examples=100, deadline=None)
@given(g=geometries(), data=st.data())
def test_head_major_token_major_reads_the_naive_offsets(g, data):
    arr = data.draw(head_major_arrangements(g.block_size))
    gen = torch.Generator().manual_seed(g.unit_elems)
    units = torch.randint(0, 256, (2, g.unit_bytes), dtype=torch.uint8, generator=gen)
    elems = units.numpy().view(_UINT[g.itemsize])
    want = elems[:, naive_head_major_offsets(g, arr)]
    got = token_major(units, g, arr)
    np.testing.assert_array_equal(got.numpy().view(_UINT[g.itemsize]), want)
    assert canonical_view(units, g, arr).data_ptr() == units.data_ptr()
    # the layout field changes no byte of a head-major arrangement
    other = replace(arr, layout=KVLayout.HND if arr.layout is KVLayout.NHD else KVLayout.NHD)
    assert same_bytes(g, arr, other)


def _head_major_cases():
    return [
        pytest.param(heads, parts_outer, chunks, id=f"{heads.value}-po{int(parts_outer)}-c{chunks}")
        for heads in HEAD_MAJOR
        for parts_outer in (False, True)
        for chunks in (1, 2)
    ]


@pytest.mark.parametrize(("heads", "parts_outer", "chunks"), _head_major_cases())
def test_head_major_offsets_are_a_permutation(heads, parts_outer, chunks):
    g = TP_GEOMETRY
    arr = BlockArrangement(
        layout=KVLayout.NHD,
        num_chunks=chunks,
        sub_blocks_per_chunk=2,
        parts_outer=parts_outer,
        heads=heads,
    )
    off = element_offsets(g, arr)
    assert sorted(off.tolist()) == list(range(g.unit_elems))
    np.testing.assert_array_equal(off, naive_head_major_offsets(g, arr).reshape(-1))
    assert not same_bytes(g, arr, replace(arr, heads=HeadOrder.INNER))


def _head_slice_range(off: np.ndarray, g: UnitGeometry, chunks: int, chunk: int, layers, heads):
    """Sorted element offsets of heads ``heads`` of layers ``layers`` of one chunk."""
    per_chunk = g.block_size // chunks
    tokens = slice(chunk * per_chunk, (chunk + 1) * per_chunk)
    return np.sort(off[layers, :, tokens, heads, :].reshape(-1))


@pytest.mark.parametrize(("heads", "parts_outer", "chunks"), _head_major_cases())
def test_head_slice_is_one_contiguous_range(heads, parts_outer, chunks):
    g = TP_GEOMETRY
    arr = BlockArrangement(
        layout=KVLayout.HND,
        num_chunks=chunks,
        sub_blocks_per_chunk=2,
        parts_outer=parts_outer,
        heads=heads,
    )
    off = element_offsets(g, arr).reshape(
        g.num_layers, g.num_kv_parts, g.block_size, g.num_heads, g.head_size
    )
    chunk_elems = g.unit_elems // chunks
    head_elems = g.num_kv_parts * (g.block_size // chunks) * g.head_size  # one layer
    for chunk in range(chunks):
        for first in range(g.num_heads):
            for count in range(1, g.num_heads - first + 1):
                heads_sl = slice(first, first + count)
                if heads is HeadOrder.IN_CHUNK:
                    got = _head_slice_range(off, g, chunks, chunk, slice(None), heads_sl)
                    start = chunk * chunk_elems + first * g.num_layers * head_elems
                    want = np.arange(start, start + count * g.num_layers * head_elems)
                    np.testing.assert_array_equal(got, want)
                    continue
                for layer in range(g.num_layers):
                    got = _head_slice_range(off, g, chunks, chunk, layer, heads_sl)
                    layer_start = chunk * chunk_elems + layer * g.num_heads * head_elems
                    start = layer_start + first * head_elems
                    np.testing.assert_array_equal(got, np.arange(start, start + count * head_elems))
    if chunks == 2:  # by hand: a chunk holds 2*2*4*4*3 = 192 elements
        if heads is HeadOrder.IN_CHUNK:
            # heads [1, 3) of chunk 1: one head of a chunk = 2 layers x 2 parts x 4 x 3 = 48
            got = _head_slice_range(off, g, 2, 1, slice(None), slice(1, 3))
            assert (int(got[0]), got.size) == (192 + 48, 96)
        else:
            # heads [2, 4) of layer 1 of chunk 1: one head of a layer = 2 parts x 4 x 3 = 24,
            # a layer = 4 heads x 24 = 96
            got = _head_slice_range(off, g, 2, 1, 1, slice(2, 4))
            assert (int(got[0]), got.size) == (192 + 96 + 2 * 24, 48)


@pytest.mark.parametrize(("heads", "parts_outer", "chunks"), _head_major_cases())
def test_head_major_rewrite_round_trip(heads, parts_outer, chunks):
    g = TP_GEOMETRY
    native = BlockArrangement.native(KVLayout.NHD, g.block_size, 4)  # 1 x 2 x NHD
    head_major = BlockArrangement(
        layout=KVLayout.NHD,
        num_chunks=chunks,
        sub_blocks_per_chunk=1,
        parts_outer=parts_outer,
        heads=heads,
    )
    gen = torch.Generator().manual_seed(7)
    units = torch.randint(0, 256, (4, g.unit_bytes), dtype=torch.uint8, generator=gen)
    original = units.clone()
    ids = np.array([3, 1])
    stats = rewrite_units(units, g, ids, native, head_major)
    assert stats.num_blocks == 2 and stats.bytes_moved == 2 * g.unit_bytes
    assert torch.equal(units[[0, 2]], original[[0, 2]])  # other rows untouched
    for row in ids:
        assert not torch.equal(units[row], original[row])
    # the rewritten rows read back, head-major, as the native rows did
    assert torch.equal(
        token_major(units[ids], g, head_major), token_major(original[ids], g, native)
    )
    rewrite_units(units, g, ids, head_major, native)
    assert torch.equal(units, original)


@pytest.mark.parametrize(("heads", "parts_outer", "chunks"), _head_major_cases())
def test_token_major_of_a_head_major_unit(heads, parts_outer, chunks):
    g = TP_GEOMETRY
    arr = BlockArrangement(
        layout=KVLayout.NHD,
        num_chunks=chunks,
        sub_blocks_per_chunk=2,
        parts_outer=parts_outer,
        heads=heads,
    )
    gen = torch.Generator().manual_seed(11)
    shape = (3, g.num_layers, g.num_kv_parts, g.block_size, g.num_heads, g.head_size)
    tm = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen)
    units = torch.zeros((3, g.unit_bytes), dtype=torch.uint8)
    elems = units.numpy().view(np.int16)
    elems[:, naive_head_major_offsets(g, arr).reshape(-1)] = tm.numpy().reshape(3, -1)
    assert torch.equal(token_major(units, g, arr), tm)
    # an INNER reading of the same bytes is a different tensor
    assert not torch.equal(token_major(units, g, replace(arr, heads=HeadOrder.INNER)), tm)


def test_head_order_names_and_str():
    assert [h.value for h in HeadOrder] == ["inner", "layer", "chunk", "outer"]
    assert BlockArrangement(layout=KVLayout.NHD).heads is HeadOrder.INNER
    assert HeadOrder.parse("Chunk") is HeadOrder.IN_CHUNK
    assert HeadOrder.parse(HeadOrder.IN_LAYER) is HeadOrder.IN_LAYER
    assert HeadOrder.parse("OUTER") is HeadOrder.OUTER
    with pytest.raises(LayoutError, match=r"unknown head order 'sideways'.*'outer'"):
        HeadOrder.parse("sideways")
    arr = BlockArrangement(layout=KVLayout.HND, num_chunks=2, sub_blocks_per_chunk=3)
    assert str(arr) == "2x3xHND"
    assert str(replace(arr, parts_outer=True, heads=HeadOrder.IN_LAYER)) == "2x3xHNDPN-Hlayer"
    assert str(replace(arr, heads=HeadOrder.IN_CHUNK)) == "2x3xHND-Hchunk"
    # one layer: heads outermost in the layer or in the chunk put every byte at the same place
    one_layer = replace(TP_GEOMETRY, num_layers=1)
    a = BlockArrangement(layout=KVLayout.NHD, heads=HeadOrder.IN_LAYER)
    assert same_bytes(one_layer, a, replace(a, heads=HeadOrder.IN_CHUNK))
    assert not same_bytes(TP_GEOMETRY, a, replace(a, heads=HeadOrder.IN_CHUNK))
