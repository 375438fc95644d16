"""Hybrid prefix-hit search: hand cases, invalid input, and a brute-force property check."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.prefix_hit import (
    GroupHitQuery,
    PrefixHitError,
    longest_prefix_hit,
    servable,
)
from kvbridge.layouts.specs import KVCacheKind

FULL = KVCacheKind.FULL_ATTENTION
SW = KVCacheKind.SLIDING_WINDOW
MLA = KVCacheKind.MLA
STATE = KVCacheKind.STATE


def _flags(pattern: str) -> np.ndarray:
    """``"xx.x"`` -> ``[True, True, False, True]``."""
    return np.array([c == "x" for c in pattern], dtype=bool)


def _query(kind: KVCacheKind, block_size: int, pattern: str, window: int | None = None):
    return GroupHitQuery(
        kind=kind, block_size=block_size, cached=_flags(pattern), sliding_window=window
    )


# ---------------------------------------------------------------- brute-force reference


def _reference_servable(query: GroupHitQuery, n: int) -> bool:
    """Straight from the definition, one token count at a time."""
    if n == 0:
        return True
    bs = query.block_size
    if n % bs or n // bs > len(query.cached):
        return False
    cached = [bool(c) for c in query.cached]
    last = n // bs  # blocks 0 .. last-1 hold the prefix
    if query.kind in (FULL, MLA):
        return all(cached[:last])
    if query.kind is STATE:
        return cached[last - 1]
    first = max(0, n - query.sliding_window) // bs
    return all(cached[first:last])


def _reference_hit(queries: list[GroupHitQuery], max_tokens: int) -> int:
    lcm = math.lcm(*(q.block_size for q in queries))
    return max(
        n for n in range(0, max_tokens + 1, lcm) if all(_reference_servable(q, n) for q in queries)
    )


@st.composite
def _cached_flags(draw: st.DrawFn, num_blocks: int) -> np.ndarray:
    style = draw(st.sampled_from(["random", "holes", "prefix"]))
    if style == "random":
        flags = draw(st.lists(st.booleans(), min_size=num_blocks, max_size=num_blocks))
        return np.array(flags, dtype=bool).reshape(num_blocks)
    cached = np.ones(num_blocks, dtype=bool)
    if style == "prefix":  # a cached prefix, then nothing
        cached[draw(st.integers(0, num_blocks)) :] = False
    if num_blocks:  # a few holes in a mostly cached run
        holes = draw(st.lists(st.integers(0, num_blocks - 1), max_size=3))
        cached[holes] = False
    return cached


@st.composite
def _group(draw: st.DrawFn, prompt_len: int) -> GroupHitQuery:
    kind = draw(st.sampled_from(list(KVCacheKind)))
    block_size = draw(st.sampled_from([4, 8, 16, 32]))
    window = draw(st.integers(4, 64)) if kind is SW else None
    cached = draw(_cached_flags(prompt_len // block_size))
    return GroupHitQuery(kind=kind, block_size=block_size, cached=cached, sliding_window=window)


@st.composite
def _problem(draw: st.DrawFn) -> tuple[list[GroupHitQuery], int]:
    prompt_len = draw(st.integers(0, 320))
    queries = draw(st.lists(_group(prompt_len), min_size=2, max_size=4))
    max_tokens = draw(st.integers(0, prompt_len + 40))
    return queries, max_tokens


@settings(max_examples=200, deadline=None)
@given(_problem())
def test_matches_brute_force(problem: tuple[list[GroupHitQuery], int]) -> None:
    queries, max_tokens = problem
    hit = longest_prefix_hit(queries, max_tokens)

    assert hit.num_tokens == _reference_hit(queries, max_tokens)
    assert hit.num_blocks_per_group == tuple(hit.num_tokens // q.block_size for q in queries)
    lcm = math.lcm(*(q.block_size for q in queries))
    assert 1 <= hit.num_iterations <= max_tokens // lcm + 1


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 200).flatmap(_group), st.integers(0, 240))
def test_servable_matches_definition(query: GroupHitQuery, n: int) -> None:
    assert servable(query, n) == _reference_servable(query, n)


# ---------------------------------------------------------------- hand-written cases


def test_empty_cache_gives_no_hit() -> None:
    queries = [
        _query(FULL, 16, "...."),
        _query(SW, 16, "....", window=32),
        _query(STATE, 16, "...."),
    ]
    hit = longest_prefix_hit(queries, max_tokens=63)
    assert (hit.num_tokens, hit.num_blocks_per_group) == (0, (0, 0, 0))


def test_zero_length_arrays_give_no_hit() -> None:
    queries = [_query(FULL, 16, ""), _query(MLA, 16, "xxxx")]
    assert longest_prefix_hit(queries, max_tokens=100).num_tokens == 0


def test_all_cached_gives_max_tokens_aligned_down_to_lcm() -> None:
    # 130-token prompt: lcm(16, 32, 8) = 32; max_tokens = 129 -> 128.
    queries = [
        _query(FULL, 16, "x" * 8),
        _query(STATE, 32, "x" * 4),
        _query(SW, 8, "x" * 16, window=24),
        _query(MLA, 16, "x" * 8),
    ]
    hit = longest_prefix_hit(queries, max_tokens=129)
    assert hit.num_tokens == 128
    assert hit.num_blocks_per_group == (8, 4, 16, 8)
    assert hit.num_iterations == 1
    assert longest_prefix_hit(queries, max_tokens=100).num_tokens == 96


def test_sliding_window_hole_behind_the_window_does_not_matter() -> None:
    # Block 2 (tokens 8..11) is missing; a 16-token window ending at 60 needs blocks 11..14.
    pattern = "xx.xxxxxxxxxxxxx"
    window_hit = longest_prefix_hit(
        [_query(SW, 4, pattern, window=16), _query(FULL, 4, "x" * 16)], max_tokens=63
    )
    assert window_hit.num_tokens == 60
    # The same hole stops a full-attention group at the hole.
    full_hit = longest_prefix_hit(
        [_query(FULL, 4, pattern), _query(FULL, 4, "x" * 16)], max_tokens=63
    )
    assert full_hit.num_tokens == 8


def test_sliding_window_needs_the_block_holding_token_n_minus_w() -> None:
    # n = 16: a window of 8 reads tokens 8..15 (blocks 2, 3); a window of 9 also token 7.
    assert servable(_query(SW, 4, "x.xx", window=8), 16)
    assert not servable(_query(SW, 4, "x.xx", window=9), 16)
    assert longest_prefix_hit([_query(SW, 4, "x.xx", window=9)], max_tokens=16).num_tokens == 4


def test_state_hits_only_where_a_state_was_kept() -> None:
    # States kept at the ends of blocks 1 and 5: n = 16 and n = 48.
    state = _query(STATE, 8, ".x...x......")
    full = _query(FULL, 8, "x" * 12)
    assert longest_prefix_hit([full, state], max_tokens=95).num_tokens == 48
    assert longest_prefix_hit([full, state], max_tokens=47).num_tokens == 16
    assert longest_prefix_hit([full, state], max_tokens=15).num_tokens == 0


def test_state_hit_must_be_lcm_aligned() -> None:
    # The state at n = 24 is not a multiple of lcm(8, 16) = 16; the one at n = 16 is.
    full = _query(FULL, 16, "xxxx")
    assert longest_prefix_hit([_query(STATE, 8, "..x.....")], max_tokens=63).num_tokens == 24
    assert longest_prefix_hit([full, _query(STATE, 8, "..x.....")], 63).num_tokens == 0
    assert longest_prefix_hit([full, _query(STATE, 8, ".xx.....")], 63).num_tokens == 16


def test_docstring_example_needs_four_passes() -> None:
    queries = [
        _query(FULL, 4, "xxxxx."),
        _query(STATE, 4, ".x..x."),
        _query(SW, 4, "xx.x.x", window=4),
    ]
    hit = longest_prefix_hit(queries, max_tokens=24)
    assert hit.num_tokens == 8
    assert hit.num_iterations == 4  # 24 -> 20 -> 16 -> 8, then 8 is confirmed
    assert hit.num_blocks_per_group == (2, 2, 2)


def test_interleaved_groups_with_different_block_sizes_and_windows() -> None:
    # [SW, FULL, STATE, SW], lcm 16: the state lowers 80 -> 64, then the window-24 group,
    # which serves 80 but not 64 or 48, lowers 64 -> 32, which every group serves.
    queries = [
        _query(SW, 8, "xxxxx.xxxx", window=8),  # serves all but 48
        _query(FULL, 16, "xxxxx"),
        _query(STATE, 4, "...x...x...x...x...."),  # serves 16, 32, 48, 64
        _query(SW, 16, "xx.xx", window=24),  # serves 16, 32, 80
    ]
    hit = longest_prefix_hit(queries, max_tokens=80)
    assert hit.num_tokens == 32
    assert hit.num_blocks_per_group == (4, 2, 8, 2)
    assert hit.num_iterations == 3


# ---------------------------------------------------------------- invalid input


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"kind": FULL, "block_size": 0}, "block_size=0"),
        ({"kind": FULL, "block_size": -16}, "block_size=-16"),
        ({"kind": SW, "block_size": 16}, "sliding_window=None"),
        ({"kind": SW, "block_size": 16, "sliding_window": 0}, "sliding_window=0"),
        ({"kind": STATE, "block_size": 16, "sliding_window": 64}, "sliding_window=64"),
        ({"kind": FULL, "block_size": 16, "cached": np.ones(4, dtype=np.int64)}, "int64"),
        ({"kind": FULL, "block_size": 16, "cached": np.ones((2, 2), dtype=bool)}, "ndim=2"),
        ({"kind": FULL, "block_size": 16, "cached": [True, True]}, "list"),
        ({"kind": "full_attention", "block_size": 16}, "'full_attention'"),
    ],
)
def test_invalid_query_names_the_field_and_value(kwargs: dict, needle: str) -> None:
    kwargs = {"cached": np.ones(4, dtype=bool), **kwargs}
    with pytest.raises(PrefixHitError, match=needle) as info:
        GroupHitQuery(**kwargs)
    assert isinstance(info.value, LayoutError)


def test_negative_max_tokens_is_rejected() -> None:
    with pytest.raises(PrefixHitError, match="max_tokens=-1"):
        longest_prefix_hit([_query(FULL, 16, "xx")], max_tokens=-1)


def test_no_groups_is_rejected() -> None:
    with pytest.raises(PrefixHitError, match="queries is empty"):
        longest_prefix_hit([], max_tokens=16)


def test_servable_rejects_negative_token_count() -> None:
    with pytest.raises(PrefixHitError, match="num_tokens=-4"):
        servable(_query(FULL, 4, "xx"), -4)
