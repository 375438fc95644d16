"""NHD/HND shapes, packings and element offsets against a naive torch.arange tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.layout import (
    KVLayout,
    KVPacking,
    block_shape,
    contiguous_strides,
    element_offsets,
    layer_cache_shape,
)


def test_shapes_hand_examples():
    assert block_shape(KVLayout.NHD, 16, 8, 128) == (16, 8, 128)
    assert block_shape(KVLayout.HND, 16, 8, 128) == (8, 16, 128)
    common = dict(num_blocks=10, block_size=16, num_heads=8, head_size=128)
    assert layer_cache_shape(KVPacking.KV_SPLIT, KVLayout.NHD, **common) == (2, 10, 16, 8, 128)
    assert layer_cache_shape(KVPacking.BLOCKS_FIRST, KVLayout.HND, **common) == (10, 2, 8, 16, 128)
    assert layer_cache_shape(KVPacking.KV_SPLIT, KVLayout.NHD, num_kv_parts=1, **common) == (
        1,
        10,
        16,
        8,
        128,
    )
    assert contiguous_strides((2, 3, 4)) == (12, 4, 1)
    assert contiguous_strides((5,)) == (1,)


@settings(max_examples=100, deadline=None)
@given(
    packing=st.sampled_from(list(KVPacking)),
    layout=st.sampled_from(list(KVLayout)),
    num_blocks=st.integers(1, 5),
    block_size=st.integers(1, 6),
    heads=st.integers(1, 4),
    head_size=st.integers(1, 5),
    parts=st.integers(1, 2),
    data=st.data(),
)
def test_element_offsets_match_a_contiguous_tensor(
    packing, layout, num_blocks, block_size, heads, head_size, parts, data
):
    shape = layer_cache_shape(
        packing,
        layout,
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=heads,
        head_size=head_size,
        num_kv_parts=parts,
    )
    cache = torch.arange(int(np.prod(shape))).reshape(shape)  # value == element offset
    kv = data.draw(st.lists(st.integers(0, parts - 1), min_size=1, max_size=8))
    n = len(kv)
    blk = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=n, max_size=n))
    tok = data.draw(st.lists(st.integers(0, block_size - 1), min_size=n, max_size=n))
    hd = data.draw(st.lists(st.integers(0, heads - 1), min_size=n, max_size=n))
    got = element_offsets(
        packing,
        layout,
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=heads,
        head_size=head_size,
        kv_part=np.array(kv),
        block_id=np.array(blk),
        token=np.array(tok),
        head=np.array(hd),
        num_kv_parts=parts,
    )
    for i in range(n):
        part_block = (kv[i], blk[i]) if packing is KVPacking.KV_SPLIT else (blk[i], kv[i])
        inner = (tok[i], hd[i]) if layout is KVLayout.NHD else (hd[i], tok[i])
        assert got[i] == int(cache[(*part_block, *inner, 0)])


def test_element_offsets_broadcast():
    got = element_offsets(
        KVPacking.BLOCKS_FIRST,
        KVLayout.HND,
        num_blocks=3,
        block_size=4,
        num_heads=2,
        head_size=5,
        kv_part=1,
        block_id=np.array([[0], [2]]),
        token=np.arange(4),
        head=0,
    )
    # (blocks, 2, heads, tokens, dim): block*80 + part*40 + head*20 + token*5
    np.testing.assert_array_equal(got, [[40, 45, 50, 55], [200, 205, 210, 215]])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_id", 3, r"block ids must lie in \[0, 3\)"),
        ("token", -1, r"token slots must lie in \[0, 4\)"),
        ("head", 2, r"heads must lie in \[0, 2\)"),
        ("kv_part", 2, r"kv parts must lie in \[0, 2\)"),
    ],
)
def test_element_offsets_out_of_range(field, value, message):
    args = dict(kv_part=0, block_id=0, token=0, head=0)
    args[field] = value
    with pytest.raises(LayoutError, match=message):
        element_offsets(
            KVPacking.KV_SPLIT,
            KVLayout.NHD,
            num_blocks=3,
            block_size=4,
            num_heads=2,
            head_size=5,
            **args,
        )


def test_parse_accepts_enums_and_any_case():
    assert KVLayout.parse("hnd") is KVLayout.HND
    assert KVLayout.parse(KVLayout.NHD) is KVLayout.NHD
    assert KVPacking.parse("BLOCKS_FIRST") is KVPacking.BLOCKS_FIRST
    assert KVPacking.parse(KVPacking.KV_SPLIT) is KVPacking.KV_SPLIT


def test_unknown_layout_strings_raise_our_error():
    with pytest.raises(LayoutError, match=r"unknown KV layout 'NDH'; expected 'NHD' or 'HND'"):
        KVLayout.parse("NDH")
    with pytest.raises(LayoutError, match=r"unknown KV packing 'kv'; expected 'kv_split'"):
        KVPacking.parse("kv")
