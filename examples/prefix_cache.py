"""The engine's local prefix cache: which cached blocks a new request reuses, and naming
the blocks a forward or a load filled so later requests can.

A block is named (``BlockPool.cache``) by the chained hash of every token up to its end
(``block_pool.block_hashes``), per KV-cache group. What a group may name after a load
depends on its kind::

    full attention    every loaded block
    sliding window    only blocks inside the window of the last loaded token
    state             only the block at the last boundary (states live per boundary)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvbridge.examples.block_pool import BlockPool, block_hashes
from kvbridge.examples.request import Request
from kvbridge.layouts.prefix_hit import GroupHitQuery, longest_prefix_hit
from kvbridge.layouts.specs import KVCacheKind, KVCacheSpec


class PrefixCache:
    """Prefix hits and registrations over one :class:`BlockPool` (``enabled=False``: no
    hits, nothing named). ``exclusive_blocks``: a hit only takes cached blocks no live
    request holds (a producer whose connector may rewrite held blocks for a reader)."""

    def __init__(
        self,
        pool: BlockPool,
        group_specs: Sequence[KVCacheSpec],
        block_size: int,
        *,
        enabled: bool = True,
        exclusive_blocks: bool = False,
    ) -> None:
        self.pool = pool
        self.group_specs = tuple(group_specs)
        self.block_size = block_size
        self.enabled = enabled
        self.exclusive_blocks = exclusive_blocks

    def hit(self, req: Request) -> tuple[int, list[list[int | None]]]:
        """Tokens served by the local cache and, per group, the cached block of each of
        the hit's blocks (None: no valid block there; a fresh one is allocated)."""
        num_groups = len(self.group_specs)
        if not self.enabled:
            return 0, [[] for _ in range(num_groups)]
        hashes = block_hashes(req.prompt_token_ids, self.block_size)
        cached_ids = [self.pool.cached_block_ids(g, hashes) for g in range(num_groups)]
        if self.exclusive_blocks:
            cached_ids = [
                [b if b is not None and self.pool.refcount(b) == 0 else None for b in ids]
                for ids in cached_ids
            ]
        queries = [
            GroupHitQuery(
                kind=spec.kind,
                block_size=spec.block_size,
                cached=np.array([b is not None for b in ids], dtype=bool),
                sliding_window=getattr(spec, "sliding_window", None)
                if spec.kind is KVCacheKind.SLIDING_WINDOW
                else None,
            )
            for spec, ids in zip(self.group_specs, cached_ids, strict=True)
        ]
        hit = longest_prefix_hit(queries, len(req.prompt_token_ids) - 1).num_tokens
        n = hit // self.block_size
        return hit, [ids[:n] for ids in cached_ids]

    def register_computed(self, req: Request) -> None:
        """Name every block the forward filled (valid in all groups) by its hash."""
        full = req.num_computed_tokens // self.block_size
        if not self.enabled or full <= req.num_registered_blocks:
            return
        hashes = block_hashes(req.all_token_ids[: full * self.block_size], self.block_size)
        first = req.num_registered_blocks
        for g, ids in enumerate(req.block_ids):
            self.pool.cache(g, hashes[first:full], ids[first:full])
        req.num_registered_blocks = full

    def register_loaded(self, req: Request) -> None:
        """Name the blocks a load filled (see the module doc for what each kind names)."""
        if not self.enabled:
            return
        bs = self.block_size
        first, stop = req.num_cached_tokens // bs, req.num_computed_tokens // bs
        hashes = block_hashes(req.prompt_token_ids[: stop * bs], bs)
        for g, spec in enumerate(self.group_specs):
            lo = first
            if spec.kind is KVCacheKind.SLIDING_WINDOW:
                lo = max(first, math.ceil((stop * bs - spec.sliding_window) / bs))
            elif spec.kind is KVCacheKind.STATE:
                # only a boundary state names a block; a load ending mid-block left the
                # state in the entry of that (unnamed, partial) block
                lo = max(first, stop - 1) if req.num_computed_tokens % bs == 0 else stop
            self.pool.cache(g, hashes[lo:stop], req.block_ids[g][lo:stop])
        req.num_registered_blocks = stop
