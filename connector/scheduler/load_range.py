"""Decode side: which prompt tokens a load fills, and which of the request's blocks get them.

Pure functions of the group specs and the params (the scheduler keeps the state)::

    tokens [num_computed, end)   end = prefill's resume point (every prompt token but the
                                 last), 0 when the load cannot be used: a prompt shorter
                                 than prefill's with a state group, or a sliding window
                                 reaching below the first block prefill kept
    blocks per group             the first ceil(end / block_size) allocated ids (the block
                                 of the last loaded token too; for a state group the
                                 block that holds the state after it)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.scheduler.lifecycle import LifecycleError
from kvbridge.layouts.specs import KVCacheKind, KVCacheSpec, SlidingWindowSpec

logger = logging.getLogger(__name__)


def load_end(
    specs: Sequence[KVCacheSpec],
    params: KVTransferParams,
    num_prompt_tokens: int,
    num_computed_tokens: int,
    request_id: str = "",
) -> int:
    """Tokens ``[0, end)`` the load fills: prefill's resume point, any block sizes; 0 when
    decode must compute the request itself."""
    end = params.resume_tokens
    last = num_prompt_tokens - 1
    if end > last:
        # a prompt shorter than prefill's: attention KV is a prefix of it, a state is not
        has_state = any(s.kind is KVCacheKind.STATE for s in specs)
        end = 0 if has_state else max(0, last)
    if not windows_covered(specs, params, end, num_computed_tokens):
        logger.info(
            "request %s: the sliding window ending at token %d starts before prefill's "
            "first kept block; computing it locally",
            request_id,
            end,
        )
        return 0
    return end


def windows_covered(
    specs: Sequence[KVCacheSpec], params: KVTransferParams, end: int, start: int
) -> bool:
    """Whether prefill kept every block a sliding-window group needs to load
    ``[start, end)`` (it sends such groups from their first in-window block)."""
    if not params.remote_first_block or end <= start:
        return True
    for spec, first in zip(specs, params.remote_first_block, strict=True):
        if isinstance(spec, SlidingWindowSpec):
            lo = max(start, end - spec.sliding_window)
            if lo // params.remote_block_size < first:
                return False
    return True


def load_block_ids(
    specs: Sequence[KVCacheSpec],
    request_id: str,
    block_ids_per_group: Sequence[Sequence[int]],
    num_load_tokens: int,
) -> tuple[tuple[int, ...], ...]:
    """The allocated blocks a load of ``num_load_tokens`` writes, per group; raises
    :class:`LifecycleError` when the engine allocated too few."""
    if len(block_ids_per_group) != len(specs):
        raise LifecycleError(
            f"request {request_id!r}: {len(block_ids_per_group)} block lists for "
            f"{len(specs)} KV-cache groups"
        )
    out = []
    for g, (spec, ids) in enumerate(zip(specs, block_ids_per_group, strict=True)):
        need = -(-num_load_tokens // spec.block_size)
        if len(ids) < need:
            raise LifecycleError(
                f"request {request_id!r}, group {g}: {len(ids)} blocks allocated, the load of "
                f"{num_load_tokens} tokens needs {need} of {spec.block_size} tokens"
            )
        out.append(tuple(map(int, ids[:need])))
    return tuple(out)
