"""KV-cache groups and configs: uniform pages, state padding, and the errors that name
the page sizes involved."""

from __future__ import annotations

import pytest
import torch

from kvbridge.layouts.errors import LayoutError, NonUniformPageError
from kvbridge.layouts.groups import KVCacheConfig, KVCacheGroup
from kvbridge.layouts.specs import FullAttentionSpec, MLASpec, SlidingWindowSpec, StateSpec


def _full(block_size=16, heads=4, dim=8, dtype=torch.float16):
    return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=dim, dtype=dtype)


def _state(*shapes, dtype=torch.float32):
    return StateSpec(block_size=16, shapes=shapes, dtypes=(dtype,) * len(shapes))


def _group(gid, names, spec):
    return KVCacheGroup(group_id=gid, layer_names=tuple(names), spec=spec)


def test_uniform_pads_state_pages_to_the_attention_page():
    full = _full()  # 2 * 16 * 4 * 8 * 2 = 2048 bytes
    window = SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=8, dtype=torch.float16, sliding_window=64
    )
    config = KVCacheConfig.uniform(
        [
            _group(0, ["a0", "a1"], full),
            _group(1, ["w0"], window),
            _group(2, ["m0", "m1"], _state((10, 12), (5,))),  # 480 + 20 bytes
        ],
        num_blocks=7,
    )
    assert config.page_size_bytes == 2048
    state = config.groups[2].spec
    assert state.page_size_padded == 2048 and state.state_bytes == 500
    assert config.groups[0].spec == full  # attention specs are kept as they are
    assert config.layer_names == ("a0", "a1", "w0", "m0", "m1")
    assert config.num_layers == 5
    assert [config.group_layer_offset(g) for g in range(3)] == [0, 2, 3]
    assert config.group_of("w0").group_id == 1
    assert config.groups[2].is_attention is False and config.groups[1].is_attention
    assert config.groups[1].num_layers == 1


def test_state_only_configs_round_the_page_up_to_keep_states_aligned():
    state = StateSpec(block_size=4, shapes=((3,), (2,)), dtypes=(torch.int8, torch.float32))
    config = KVCacheConfig.uniform([_group(0, ["s"], state)], num_blocks=2)
    assert state.state_bytes == 12  # 3 int8 bytes, pad to 4, then 8
    assert config.page_size_bytes == 12
    odd = StateSpec(block_size=4, shapes=((1,), (1,)), dtypes=(torch.float32, torch.int8))
    config = KVCacheConfig.uniform([_group(0, ["s"], odd)], num_blocks=2)
    assert config.page_size_bytes == 8  # 5 bytes rounded up to the float32 boundary


def test_state_larger_than_the_attention_page_names_the_bytes():
    full = _full(block_size=4, heads=1, dim=8)  # 2 * 4 * 8 * 2 = 128 bytes
    with pytest.raises(
        NonUniformPageError,
        match=r"group 1: state needs 400 bytes per page but the attention page is 128 bytes; "
        r"raise the attention block size to at least 13 tokens",
    ):
        KVCacheConfig.uniform([_group(0, ["a"], full), _group(1, ["s"], _state((100,)))], 3)


def test_misaligned_state_page_is_rejected():
    mla = MLASpec(block_size=3, head_size=2, dtype=torch.int8)  # a 6-byte page
    with pytest.raises(NonUniformPageError, match="6-byte page is not a multiple of the 4-byte"):
        KVCacheConfig.uniform([_group(0, ["a"], mla), _group(1, ["s"], _state((1,)))], 3)


def test_attention_pages_that_differ_name_both_sizes():
    with pytest.raises(
        NonUniformPageError, match=r"attention page sizes differ \(group 0=2048, group 1=1024\)"
    ):
        KVCacheConfig.uniform(
            [_group(0, ["a"], _full()), _group(1, ["b"], _full(block_size=8))], num_blocks=4
        )


def test_plain_constructor_demands_uniform_pages():
    with pytest.raises(NonUniformPageError, match=r"group 0=2048, group 1=400\).*uniform"):
        KVCacheConfig(
            groups=(_group(0, ["a"], _full()), _group(1, ["s"], _state((100,)))), num_blocks=4
        )


def test_config_validation_errors():
    full = _full()
    with pytest.raises(LayoutError, match="num_blocks=0 must be positive"):
        KVCacheConfig(groups=(_group(0, ["a"], full),), num_blocks=0)
    with pytest.raises(LayoutError, match="at least one group"):
        KVCacheConfig(groups=(), num_blocks=4)
    with pytest.raises(LayoutError, match="at least one group"):
        KVCacheConfig.uniform([], num_blocks=4)
    with pytest.raises(LayoutError, match=r"group ids must be 0..1 in order, got \[1, 0\]"):
        KVCacheConfig(groups=(_group(1, ["a"], full), _group(0, ["b"], full)), num_blocks=4)
    with pytest.raises(LayoutError, match="a layer belongs to more than one group"):
        KVCacheConfig(groups=(_group(0, ["a"], full), _group(1, ["a"], full)), num_blocks=4)
    with pytest.raises(LayoutError, match="KV-cache group 0 has no layers"):
        _group(0, [], full)
    config = KVCacheConfig(groups=(_group(0, ["a"], full),), num_blocks=4)
    with pytest.raises(LayoutError, match=r"unknown layer 'zz'; known: \['a'\]"):
        config.group_of("zz")
