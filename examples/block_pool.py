"""The example engine's block pool: allocation, refcounts, prefix caching, leak checks.

All KV-cache groups draw block ids ``0 .. num_blocks - 1`` from one pool. A block is *in
use* while its refcount is positive (requests sharing a cached prefix each hold a
reference) and *free* otherwise. Free blocks wait in LRU order::

    free queue:  [ 7 | 3 | 12 | 5 ... ]      allocate() takes from the left,
                   ^ least recently freed      free() appends on the right

A full block of group ``g`` may carry a prefix hash, chained over the prompt so that it
names every token up to the block's end::

    h_0 = H(ROOT, tokens[0:bs])     h_i = H(h_{i-1}, tokens[i*bs:(i+1)*bs])

A freed block keeps its hash and stays findable (``lookup`` / ``ref`` revive it) until
``allocate`` hands it out again, which evicts the hash. Errors are typed and name the ids:
freeing a block twice or an id outside the pool never corrupts the counts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.groups import KVCacheConfig
from kvbridge.layouts.prefix_hit import GroupHitQuery, PrefixHit, longest_prefix_hit
from kvbridge.layouts.specs import KVCacheKind

BlockHash = bytes
_ROOT_HASH: BlockHash = b"kvbridge-prefix-root"


class BlockPoolError(KVBridgeError):
    """Misuse of the block pool; the message names the block ids involved."""


class PoolExhaustedError(BlockPoolError):
    """More blocks asked for than are free."""


class DoubleFreeError(BlockPoolError):
    """A block freed more times than it was referenced."""


class ForeignBlockError(BlockPoolError, IndexError):
    """A block id that does not belong to this pool."""


class BlockLeakError(BlockPoolError):
    """Blocks still referenced when the pool should be empty."""


def block_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    hashes, parent = [], _ROOT_HASH
    for i in range(tokens.size // block_size):
        chunk = tokens[i * block_size : (i + 1) * block_size].tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        hashes.append(parent)
    return hashes


def _preview(ids: Iterable[int], limit: int = 16) -> str:
    ids = list(ids)
    more = f" ... (+{len(ids) - limit})" if len(ids) > limit else ""
    return f"{ids[:limit]}{more}"


class BlockPool:
    """Refcounted block ids with a prefix cache; one pool shared by all KV-cache groups."""

    __slots__ = ("_cached", "_free", "_hash_of", "_refcounts", "num_blocks")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise BlockPoolError(f"num_blocks={num_blocks} must be positive")
        self.num_blocks = num_blocks
        self._refcounts = np.zeros(num_blocks, dtype=np.int64)
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))  # ordered: LRU first
        self._cached: dict[tuple[int, BlockHash], int] = {}  # (group, hash) -> block
        self._hash_of: dict[int, tuple[int, BlockHash]] = {}  # block -> (group, hash)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def refcount(self, block_id: int) -> int:
        return int(self._refcounts[self._checked([block_id])[0]])

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` fresh blocks (refcount 1), evicting their old prefix hashes."""
        if num_blocks < 0:
            raise BlockPoolError(f"allocate: num_blocks={num_blocks} must be non-negative")
        if num_blocks > len(self._free):
            raise PoolExhaustedError(
                f"allocate({num_blocks}): only {len(self._free)} of {self.num_blocks} "
                f"blocks are free"
            )
        ids = []
        for _ in range(num_blocks):
            block_id = next(iter(self._free))
            del self._free[block_id]
            self._evict(block_id)
            ids.append(block_id)
        self._refcounts[ids] = 1
        return ids

    def ref(self, block_ids: Iterable[int]) -> None:
        """Share blocks: one more reference each; a free block must hold a cached prefix."""
        ids = self._checked(block_ids)
        idle = [b for b in ids.tolist() if self._refcounts[b] == 0 and b not in self._hash_of]
        if idle:
            raise BlockPoolError(
                f"ref: blocks {_preview(idle)} are free and hold no cached prefix; "
                f"allocate them instead"
            )
        for block_id in ids.tolist():
            if self._refcounts[block_id] == 0:
                del self._free[block_id]
            self._refcounts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per listed id; all-or-nothing on error."""
        ids = self._checked(block_ids)
        if ids.size == 0:
            return
        unique, counts = np.unique(ids, return_counts=True)
        over = counts > self._refcounts[unique]
        if over.any():
            bad = unique[over]
            raise DoubleFreeError(
                f"free: blocks {_preview(bad.tolist())} freed more often than referenced "
                f"(refcounts {_preview(self._refcounts[bad].tolist())}, "
                f"frees {_preview(counts[over].tolist())})"
            )
        self._refcounts[unique] -= counts
        # Append in reverse so a prompt's tail blocks are evicted before its head.
        for block_id in reversed(ids.tolist()):
            if self._refcounts[block_id] == 0 and block_id not in self._free:
                self._free[block_id] = None

    def cache(self, group_id: int, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        """Name in-use full blocks of ``group_id`` by their prefix hashes (first wins)."""
        if len(hashes) != len(block_ids):
            raise BlockPoolError(f"cache: {len(hashes)} hashes for {len(block_ids)} blocks")
        ids = self._checked(block_ids).tolist()
        unused = [b for b in ids if self._refcounts[b] == 0]
        if unused:
            raise BlockPoolError(f"cache: blocks {_preview(unused)} are not in use")
        for block_hash, block_id in zip(hashes, ids, strict=True):
            key = (group_id, block_hash)
            if key in self._cached or block_id in self._hash_of:
                continue  # the prefix is cached already, or the block names another one
            self._cached[key] = block_id
            self._hash_of[block_id] = key

    def lookup(self, group_id: int, hashes: Sequence[BlockHash]) -> np.ndarray:
        """``cached[i]``: whether block ``i`` of the prompt is cached for ``group_id``."""
        return np.fromiter(
            ((group_id, h) in self._cached for h in hashes), dtype=bool, count=len(hashes)
        )

    def cached_block_ids(self, group_id: int, hashes: Sequence[BlockHash]) -> list[int | None]:
        """The cached block of each hash, or None."""
        return [self._cached.get((group_id, h)) for h in hashes]

    def used_block_ids(self) -> np.ndarray:
        return np.flatnonzero(self._refcounts)

    def assert_all_free(self) -> None:
        """Raise :class:`BlockLeakError` naming every block still referenced."""
        used = self.used_block_ids()
        if used.size:
            raise BlockLeakError(
                f"{used.size} of {self.num_blocks} blocks still referenced: ids "
                f"{_preview(used.tolist(), 64)}, refcounts "
                f"{_preview(self._refcounts[used].tolist(), 64)}"
            )

    def _checked(self, block_ids: Iterable[int]) -> np.ndarray:
        if not isinstance(block_ids, np.ndarray):
            block_ids = list(block_ids)
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids >= self.num_blocks)]
        if bad.size:
            raise ForeignBlockError(
                f"block ids {_preview(bad.tolist())} are outside this pool of "
                f"{self.num_blocks} blocks (valid ids 0..{self.num_blocks - 1})"
            )
        return ids

    def _evict(self, block_id: int) -> None:
        key = self._hash_of.pop(block_id, None)
        if key is not None:
            del self._cached[key]

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, free={len(self._free)}, "
            f"cached={len(self._cached)})"
        )


def local_prefix_hit(
    pool: BlockPool, kv_cache_config: KVCacheConfig, token_ids: Sequence[int]
) -> PrefixHit:
    """The engine's local prefix hit for a prompt: the longest prefix every group's cache
    serves (``kvbridge.layouts.prefix_hit``), leaving at least the last token to compute."""
    queries = []
    for group in kv_cache_config.groups:
        spec = group.spec
        hashes = block_hashes(token_ids, spec.block_size)
        queries.append(
            GroupHitQuery(
                kind=spec.kind,
                block_size=spec.block_size,
                cached=pool.lookup(group.group_id, hashes),
                sliding_window=(
                    spec.sliding_window if spec.kind is KVCacheKind.SLIDING_WINDOW else None
                ),
            )
        )
    return longest_prefix_hit(queries, max(0, len(token_ids) - 1))
