"""KV-cache specs: derived sizes, dtype names, and errors that name the bad values."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.layouts.errors import KVBridgeError, LayoutError
from kvbridge.layouts.specs import (
    FullAttentionSpec,
    KVCacheKind,
    MLASpec,
    SlidingWindowSpec,
    StateSpec,
    dtype_name,
    parse_dtype,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8]


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.integers(1, 64),
    heads=st.integers(1, 8),
    head_size=st.integers(1, 256),
    dtype=st.sampled_from(DTYPES),
)
def test_attention_page_is_two_parts_of_tokens_heads_dims(block_size, heads, head_size, dtype):
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype
    )
    size = torch.empty(0, dtype=dtype).element_size()
    assert spec.token_bytes == heads * head_size * size
    assert spec.page_size_bytes == 2 * block_size * heads * head_size * size
    assert spec.kind is KVCacheKind.FULL_ATTENTION
    bigger = spec.with_block_size(block_size * 2)
    assert bigger.page_size_bytes == 2 * spec.page_size_bytes
    assert bigger.num_kv_heads == heads and spec.block_size == block_size


def test_mla_has_one_part_and_one_head():
    spec = MLASpec(block_size=16, head_size=576, dtype=torch.bfloat16)
    assert spec.num_kv_heads == 1 and spec.num_kv_parts == 1
    assert spec.page_size_bytes == 16 * 576 * 2
    assert spec.kind is KVCacheKind.MLA
    with pytest.raises(LayoutError, match="num_kv_heads=2 must be 1"):
        MLASpec(block_size=16, num_kv_heads=2, head_size=576, dtype=torch.bfloat16)


def test_sliding_window_keeps_the_attention_page():
    spec = SlidingWindowSpec(
        block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float16, sliding_window=128
    )
    full = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float16)
    assert spec.page_size_bytes == full.page_size_bytes == 2 * 16 * 4 * 64 * 2
    assert spec.kind is KVCacheKind.SLIDING_WINDOW
    with pytest.raises(LayoutError, match="sliding_window=0 must be a positive integer"):
        SlidingWindowSpec(
            block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float16, sliding_window=0
        )


def test_state_bytes_and_padding():
    spec = StateSpec(block_size=16, shapes=((4, 3), (2, 8)), dtypes=(torch.float32, torch.float16))
    assert spec.state_nbytes == (48, 32)
    assert spec.state_offsets == (0, 48)
    assert spec.state_bytes == spec.page_size_bytes == 80
    padded = dataclasses.replace(spec, page_size_padded=4096)
    assert padded.page_size_bytes == 4096 and padded.state_bytes == 80
    assert padded.kind is KVCacheKind.STATE
    assert spec.with_block_size(32).block_size == 32


def test_state_offsets_align_each_state_to_its_dtype():
    spec = StateSpec(
        block_size=4, shapes=((3,), (2,), (1,)), dtypes=(torch.int8, torch.float32, torch.float16)
    )
    assert spec.state_offsets == (0, 4, 12)
    assert spec.state_bytes == 14


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(block_size=0, num_kv_heads=1, head_size=1), "block_size=0 must be a positive"),
        (dict(block_size=4, num_kv_heads=-2, head_size=1), "num_kv_heads=-2 must be"),
        (dict(block_size=4, num_kv_heads=1, head_size=2.5), "head_size=2.5 must be"),
    ],
)
def test_bad_attention_specs(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        FullAttentionSpec(dtype=torch.float16, **kwargs)


def test_bad_state_specs():
    with pytest.raises(LayoutError, match="got 2 shapes and 1 dtypes"):
        StateSpec(block_size=4, shapes=((2,), (3,)), dtypes=(torch.float32,))
    with pytest.raises(LayoutError, match="got 0 shapes"):
        StateSpec(block_size=4, shapes=(), dtypes=())
    with pytest.raises(LayoutError, match=r"state shape \(2, 0\) must be positive"):
        StateSpec(block_size=4, shapes=((2, 0),), dtypes=(torch.float32,))
    with pytest.raises(LayoutError, match="page_size_padded=7 is smaller than the 8 bytes"):
        StateSpec(block_size=4, shapes=((2,),), dtypes=(torch.float32,), page_size_padded=7)
    with pytest.raises(LayoutError, match="block_size=-1"):
        StateSpec(block_size=-1, shapes=((2,),), dtypes=(torch.float32,))
    with pytest.raises(LayoutError, match="complex64 is not supported"):
        StateSpec(block_size=4, shapes=((2,),), dtypes=(torch.complex64,))


def test_specs_are_frozen_and_keyword_only():
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_size = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        FullAttentionSpec(4, 1, 8, torch.float16)  # type: ignore[misc]


@pytest.mark.parametrize(
    "name", ["float32", "float16", "bfloat16", "int8", "uint8", "float8_e4m3fn"]
)
def test_dtype_names_round_trip(name):
    dtype = parse_dtype(name)
    assert isinstance(dtype, torch.dtype)
    assert dtype_name(dtype) == name


def test_unknown_dtypes_raise_our_error():
    with pytest.raises(LayoutError, match=r"unknown dtype 'fp16'; expected one of \["):
        parse_dtype("fp16")
    with pytest.raises(KVBridgeError, match=r"dtype torch\.complex128 is not supported"):
        dtype_name(torch.complex128)
    with pytest.raises(LayoutError, match=r"torch\.complex64"):
        FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.complex64)


def test_error_hierarchy():
    from kvbridge.layouts.errors import BlockIdError, NonUniformPageError

    assert issubclass(LayoutError, KVBridgeError) and issubclass(LayoutError, ValueError)
    assert issubclass(NonUniformPageError, LayoutError)
    assert issubclass(BlockIdError, LayoutError) and issubclass(BlockIdError, IndexError)
