"""Hybrid prefix-hit search: the longest prompt prefix that every KV-cache group can serve.

Each KV-cache group pages the prompt in blocks of its own ``block_size`` (block ``i`` holds
tokens ``[i * bs, (i + 1) * bs)``) and says, per block, whether its local cache holds it.
A group can serve a prefix of ``n`` tokens (``n = 0`` always) when ``n % bs == 0`` and:

- full attention, MLA: blocks ``0 .. n/bs - 1`` are all cached;
- sliding window ``w``: every block holding a token of ``[max(0, n - w), n)`` is cached;
- state: block ``n/bs - 1`` is cached (the state after token ``n`` is kept at its end).

The hit must also be a multiple of the lcm of all block sizes and at most ``max_tokens``.

Why a fixed point. Full-attention hits are *downward closed*: a group that serves ``n``
serves every aligned ``n' < n``. Sliding-window and state hits are not: lowering the
candidate to suit one group can land another group on a hole, so one ``min`` over the
groups is not enough. Each pass asks every group for its largest servable ``n' <= candidate``
and takes the minimum, until no group lowers it (``x`` = cached)::

    block        0  1  2  3  4  5      24-token prompt, block_size 4 everywhere
    full         x  x  x  x  x  .      serves n <= 20          (downward closed)
    state        .  x  .  .  x  .      serves n in {8, 20}
    window 4     x  x  .  x  .  x      serves n in {4, 8, 16, 24}

    pass 1: candidate 24 -> full 20, state 20, window 24  -> 20
    pass 2: candidate 20 -> window 16                     -> 16
    pass 3: candidate 16 -> state 8                       -> 8
    pass 4: candidate 8  -> every group serves 8          -> hit of 8 tokens

The search only moves down, and only to hits of some group, so it ends within
``max_tokens / lcm + 1`` passes; the result is the largest ``n`` all groups serve.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.specs import KVCacheKind


class PrefixHitError(LayoutError):
    """A prefix-hit query (block size, window, cached flags, token limit) is malformed."""


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True, kw_only=True, eq=False)
class GroupHitQuery:
    """One KV-cache group's view of a prompt: which of its full blocks are cached locally.

    ``cached[i]`` is True when the group holds block ``i`` (tokens ``[i*bs, (i+1)*bs)``).
    ``sliding_window`` (tokens) is required for, and only for, ``SLIDING_WINDOW`` groups.
    Compared by identity (``eq=False``): it wraps a mutable numpy array.
    """

    kind: KVCacheKind
    block_size: int
    cached: np.ndarray
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, KVCacheKind):
            raise PrefixHitError(
                f"GroupHitQuery: kind={self.kind!r} must be a KVCacheKind, "
                f"one of {[k.name for k in KVCacheKind]}"
            )
        if not _is_int(self.block_size) or self.block_size <= 0:
            raise PrefixHitError(
                f"GroupHitQuery: block_size={self.block_size!r} must be a positive integer"
            )
        if self.kind is KVCacheKind.SLIDING_WINDOW:
            if not _is_int(self.sliding_window) or self.sliding_window <= 0:
                raise PrefixHitError(
                    f"GroupHitQuery: sliding_window={self.sliding_window!r} must be a positive "
                    "integer (tokens) for a SLIDING_WINDOW group"
                )
        elif self.sliding_window is not None:
            raise PrefixHitError(
                f"GroupHitQuery: sliding_window={self.sliding_window!r} is only meaningful for "
                f"SLIDING_WINDOW, not {self.kind.name}; pass None"
            )
        if not isinstance(self.cached, np.ndarray):
            raise PrefixHitError(
                f"GroupHitQuery: cached has type {type(self.cached).__name__}; "
                "pass a 1-D numpy bool array"
            )
        if self.cached.dtype != np.bool_:
            raise PrefixHitError(
                f"GroupHitQuery: cached.dtype={self.cached.dtype} must be bool "
                "(one flag per block); convert with cached.astype(bool)"
            )
        if self.cached.ndim != 1:
            raise PrefixHitError(
                f"GroupHitQuery: cached.ndim={self.cached.ndim} (shape {self.cached.shape}) "
                "must be 1, one flag per block"
            )

    @property
    def num_blocks(self) -> int:
        return int(self.cached.shape[0])

    @property
    def num_covered_tokens(self) -> int:
        """Tokens spanned by the flags: no hit can be longer than this."""
        return self.num_blocks * int(self.block_size)


@dataclass(frozen=True, kw_only=True)
class PrefixHit:
    """The longest prefix every group serves, and how many search passes found it."""

    num_tokens: int
    num_iterations: int
    num_blocks_per_group: tuple[int, ...]


def _servable_block_ends(query: GroupHitQuery) -> np.ndarray:
    """``ok[k]``: whether the group can serve ``k * block_size`` tokens, ``k = 0..num_blocks``."""
    cached = query.cached
    ok = np.ones(query.num_blocks + 1, dtype=bool)
    match query.kind:
        case KVCacheKind.FULL_ATTENTION | KVCacheKind.MLA:
            ok[1:] = np.logical_and.accumulate(cached)
        case KVCacheKind.STATE:
            ok[1:] = cached
        case KVCacheKind.SLIDING_WINDOW:
            assert query.sliding_window is not None
            block_size = int(query.block_size)
            # holes[j] = uncached blocks among 0..j-1; a window is whole if it spans no hole.
            holes = np.concatenate(([0], np.cumsum(~cached)))
            ends = np.arange(query.num_blocks + 1)
            starts = np.maximum(ends * block_size - int(query.sliding_window), 0) // block_size
            ok = holes[ends] == holes[starts]
        case _:
            raise AssertionError(f"unhandled KVCacheKind {query.kind}")
    return ok


def _best_aligned_hits(query: GroupHitQuery, lcm: int) -> np.ndarray:
    """``best[j] * lcm`` is the longest lcm-aligned prefix ``<= j * lcm`` the group serves."""
    aligned_ok = _servable_block_ends(query)[:: lcm // int(query.block_size)]
    positions = np.arange(aligned_ok.shape[0])
    # Largest servable position at or below each j: a running max of the servable positions.
    return np.maximum.accumulate(np.where(aligned_ok, positions, 0))


def servable(query: GroupHitQuery, num_tokens: int) -> bool:
    """Whether ``query``'s group can serve the first ``num_tokens`` tokens of the prompt."""
    if not _is_int(num_tokens) or num_tokens < 0:
        raise PrefixHitError(f"servable: num_tokens={num_tokens!r} must be a non-negative integer")
    num_blocks, remainder = divmod(int(num_tokens), int(query.block_size))
    if remainder or num_blocks > query.num_blocks:
        return num_tokens == 0
    return bool(_servable_block_ends(query)[num_blocks])


def longest_prefix_hit(queries: Sequence[GroupHitQuery], max_tokens: int) -> PrefixHit:
    """The longest prefix, lcm-aligned and ``<= max_tokens``, that every group can serve.

    Raises :class:`PrefixHitError` when ``queries`` is empty or ``max_tokens`` is negative.
    """
    if not _is_int(max_tokens) or max_tokens < 0:
        raise PrefixHitError(
            f"longest_prefix_hit: max_tokens={max_tokens!r} must be a non-negative integer"
        )
    if len(queries) == 0:
        raise PrefixHitError("longest_prefix_hit: queries is empty; pass one per KV-cache group")
    lcm = math.lcm(*(int(q.block_size) for q in queries))
    best_tables = [_best_aligned_hits(q, lcm) for q in queries]
    # The candidate is counted in units of lcm tokens.
    candidate = min(int(max_tokens), *(q.num_covered_tokens for q in queries)) // lcm
    num_iterations = 0
    while True:
        num_iterations += 1
        lowered = min(int(best[candidate]) for best in best_tables)
        if lowered == candidate or lowered == 0:  # a fixed point; 0 is served by every group
            break
        candidate = lowered
    num_tokens = lowered * lcm
    return PrefixHit(
        num_tokens=num_tokens,
        num_iterations=num_iterations,
        num_blocks_per_group=tuple(num_tokens // int(q.block_size) for q in queries),
    )
