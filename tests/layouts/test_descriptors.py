"""Descriptor arrays address exactly the bytes of the intended blocks (and pieces), checked
by marking every described byte in a mirror of the buffers and comparing with the naive
reference's set; prepared tables + piece indices pick the same rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_reference import Arr, NaiveLayout, attention_cases, build_side, divisors

from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
from kvbridge.layouts.descriptors import (
    block_descriptors,
    descriptor_table,
    piece_indices,
    piece_offsets,
)
from kvbridge.layouts.errors import BlockIdError, LayoutError
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.region import KVRegion, MemoryKind
from kvbridge.layouts.specs import FullAttentionSpec, StateSpec


def _mark(buffers: KVCacheBuffers, descs: np.ndarray) -> list[np.ndarray]:
    """Per tensor, how many descriptors cover each byte (addresses relative to data_ptr)."""
    counts = [np.zeros(t.numel() * t.element_size(), dtype=np.int64) for t in buffers.tensors]
    for addr, length, _device in descs.tolist():
        ti, lo = _locate(buffers, addr)
        assert lo + length <= counts[ti].size, "descriptor runs past its buffer"
        counts[ti][lo : lo + length] += 1
    return counts


def _locate(buffers: KVCacheBuffers, addr: int) -> tuple[int, int]:
    """(tensor index, byte offset in it) of an address."""
    hits = [
        i
        for i, t in enumerate(buffers.tensors)
        if t.data_ptr() <= addr < t.data_ptr() + t.numel() * t.element_size()
    ]
    assert len(hits) == 1, f"address {addr:#x} is in no buffer"
    return hits[0], addr - buffers.tensors[hits[0]].data_ptr()


def _expected_chunk_bytes(buffers, ids, arr: Arr, chunks) -> list[np.ndarray]:
    """Bytes of the tokens of ``chunks`` of blocks ``ids`` under ``arr`` (naive)."""
    isz = buffers.config.groups[0].spec.itemsize
    tensor, byte = NaiveLayout.element_bytes(buffers.config, buffers.format, 0, ids, arr)
    per_chunk = buffers.config.groups[0].spec.block_size // arr.num_chunks
    tokens = np.concatenate([np.arange(c * per_chunk, (c + 1) * per_chunk) for c in chunks])
    tensor, byte = tensor[:, :, tokens], byte[:, :, tokens]
    masks = [np.zeros(t.numel(), dtype=bool) for t in buffers.tensors]
    for ti, mask in enumerate(masks):
        sel = byte[tensor == ti]
        for k in range(isz):
            mask[sel + k] = True
    return masks


@st.composite
def descriptor_cases(draw):
    case = draw(attention_cases(max_blocks=8))
    case["sub"] = draw(st.sampled_from(divisors(case["block_size"])))
    case["sub_kernel"] = draw(st.sampled_from(divisors(case["sub"])))
    num_chunks = case["block_size"] // case["sub"]
    case["pieces"] = draw(
        st.lists(st.integers(0, num_chunks - 1), min_size=1, max_size=num_chunks, unique=True)
    )
    return case


@settings(max_examples=120, deadline=None)
@given(case=descriptor_cases())
def test_whole_block_descriptors_cover_exactly_the_blocks(case):
    buffers = build_side(case)
    ids = np.array(case["block_ids"])
    descs = np.concatenate([block_descriptors(s.region, ids) for s in buffers.unit_slots(0)])
    assert descs.dtype == np.int64 and descs.shape[1] == 3
    assert (descs[:, 2] == 0).all()
    counts = _mark(buffers, descs)
    native = Arr(1, case["kernel"], case["layout"].value)
    expected = NaiveLayout.touched(buffers, 0, ids, native)
    for got, want in zip(counts, expected, strict=True):
        assert got.max() <= 1, "two descriptors overlap"
        np.testing.assert_array_equal(got.astype(bool), want)


@settings(max_examples=120, deadline=None)
@given(case=descriptor_cases())
def test_piece_descriptors_cover_exactly_the_chunks_of_a_split_block(case):
    buffers = build_side(case)
    ids = np.array(case["block_ids"])
    num_chunks = case["block_size"] // case["sub"]
    pieces = np.array(case["pieces"])
    rows = []
    for slot in buffers.unit_slots(0):
        offsets = piece_offsets(slot.region, num_chunks)
        length = slot.region.block_bytes // num_chunks
        descs = block_descriptors(slot.region, ids, offsets=offsets[pieces], length=length)
        assert (descs[:, 1] == length).all()
        assert descs.shape == (ids.size * pieces.size, 3)
        # block-major: row i*len(pieces) + j is piece pieces[j] of block ids[i]
        base = slot.region.base_addr + ids * slot.region.block_stride_bytes
        np.testing.assert_array_equal(
            descs[:, 0].reshape(ids.size, pieces.size), base[:, None] + pieces[None, :] * length
        )
        table = descriptor_table(slot.region, offsets=offsets, length=length)
        assert table.shape == (slot.region.num_blocks * num_chunks, 3)
        index = piece_indices(ids, num_chunks, pieces)
        assert index.dtype == np.int32
        np.testing.assert_array_equal(table[index], descs)
        rows.append(descs)
    counts = _mark(buffers, np.concatenate(rows))
    arr = Arr(num_chunks, case["sub_kernel"], case["layout"].value)
    expected = _expected_chunk_bytes(buffers, ids, arr, case["pieces"])
    for got, want in zip(counts, expected, strict=True):
        assert got.max() <= 1, "two descriptors overlap"
        np.testing.assert_array_equal(got.astype(bool), want)


def test_piece_indices_default_to_every_piece():
    np.testing.assert_array_equal(piece_indices(np.array([2, 0]), 3), [6, 7, 8, 0, 1, 2])
    np.testing.assert_array_equal(piece_indices(np.array([1]), 4, np.array([3, 1])), [7, 5])


def _state_buffers(cross: bool) -> KVCacheBuffers:
    full = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16)
    state = StateSpec(block_size=4, shapes=((2, 3), (5,)), dtypes=(torch.float32, torch.int8))
    config = KVCacheConfig.uniform(
        [
            KVCacheGroup(group_id=0, layer_names=("a0", "a1"), spec=full),
            KVCacheGroup(group_id=1, layer_names=("s0", "s1", "s2"), spec=state),
        ],
        num_blocks=6,
    )
    return KVCacheBuffers(config, CacheFormat(cross_layer=cross))


@pytest.mark.parametrize("cross", [True, False])
def test_state_descriptors_cover_exactly_the_state_bytes(cross):
    buffers = _state_buffers(cross)
    spec = buffers.config.groups[1].spec
    assert spec.state_bytes == 24 + 5 < spec.page_size_bytes == 256
    ids = np.array([5, 1, 2])
    slots = buffers.unit_slots(1)
    per_layer_offsets = np.arange(3) * buffers.config.page_size_bytes if cross else np.zeros(1)
    descs = np.concatenate(
        [
            block_descriptors(s.region, ids, offsets=per_layer_offsets, length=spec.state_bytes)
            for s in slots
        ]
    )
    counts = _mark(buffers, descs)
    expected = [np.zeros(c.size, dtype=bool) for c in counts]
    for name in ("s0", "s1", "s2"):
        for view in buffers.state_views(name):
            for b in ids:
                ti, lo = _locate(buffers, view[b].data_ptr())
                expected[ti][lo : lo + view[b].numel() * view.element_size()] = True
    for got, want in zip(counts, expected, strict=True):
        assert got.max() <= 1
        # states are back to back with no gaps here (24 bytes of float32, then 5 of int8)
        np.testing.assert_array_equal(got.astype(bool), want)


def _region(**kw) -> KVRegion:
    fields = dict(
        name="r",
        base_addr=4096,
        block_bytes=96,
        block_stride_bytes=128,
        num_blocks=5,
        memory_kind=MemoryKind.DRAM,
    )
    fields.update(kw)
    return KVRegion(**fields)


def test_descriptor_table_rows_follow_the_region_formula():
    region = _region(device_id=3)
    table = descriptor_table(region, offsets=np.array([0, 32, 64]), length=32)
    b, j = np.divmod(np.arange(15), 3)
    np.testing.assert_array_equal(table[:, 0], 4096 + b * 128 + j * 32)
    assert (table[:, 1] == 32).all() and (table[:, 2] == 3).all()
    whole = descriptor_table(region)
    np.testing.assert_array_equal(whole, [[4096 + 128 * i, 96, 3] for i in range(5)])
    assert region.span_bytes == 4 * 128 + 96
    assert region.block_addr(4) == 4096 + 512


def test_descriptor_errors_name_the_values():
    region = _region()
    with pytest.raises(BlockIdError, match=r"block ids \[5, -1\] outside \[0, 5\)"):
        block_descriptors(region, np.array([0, 5, -1]))
    with pytest.raises(LayoutError, match="96 bytes per block cannot be cut into 5 equal"):
        piece_offsets(region, 5)
    with pytest.raises(LayoutError, match="cannot be cut into 0"):
        piece_offsets(region, 0)
    with pytest.raises(LayoutError, match="offsets up to 80 of 32 bytes overrun the 96-byte"):
        block_descriptors(region, np.array([0]), offsets=np.array([0, 80]), length=32)
    with pytest.raises(LayoutError, match="positive length"):
        block_descriptors(region, np.array([0]), length=0)
    with pytest.raises(BlockIdError, match=r"block id 5 outside \[0, 5\)"):
        region.block_addr(5)
    with pytest.raises(LayoutError, match="block_stride_bytes=64 is smaller than block_bytes=96"):
        _region(block_stride_bytes=64)
    with pytest.raises(LayoutError, match="num_blocks=0"):
        _region(num_blocks=0)


def test_memory_kind_of_cpu_tensor_is_dram():
    assert MemoryKind.of(torch.zeros(1)) is MemoryKind.DRAM
