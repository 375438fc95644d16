"""Decode side: which prompt tokens a load fills, and which of the request's blocks get them.

Pure functions of the group specs and the params (the scheduler keeps the state)::

    tokens [num_computed, end)   end = prefill's resume point (every prompt token but the
                                 last), 0 when the load cannot be served (with the
                                 reason): a prompt shorter than prefill's with a state
                                 group, or a sliding window reaching below the first
                                 block prefill kept (token end attends to the
                                 window - 1 tokens before it)
    blocks per group             the first ceil(end / block_size) allocated ids (the block
                                 of the last loaded token too; for a state group the
                                 block that holds the state after it)
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.scheduler.lifecycle import LifecycleError
from kvbridge.layouts.specs import KVCacheKind, KVCacheSpec, SlidingWindowSpec


def load_end(
    specs: Sequence[KVCacheSpec],
    params: KVTransferParams,
    num_prompt_tokens: int,
    num_computed_tokens: int,
) -> tuple[int, str]:
    """Tokens ``[0, end)`` the load fills: prefill's resume point, any block sizes; 0 when
    decode must compute the request itself, with why the params cannot serve the load
    ('' when they can, or when nothing is left to load)."""
    end = params.resume_tokens
    last = num_prompt_tokens - 1
    if end > last:
        # a prompt shorter than prefill's: attention KV is a prefix of it, a state is not
        if any(s.kind is KVCacheKind.STATE for s in specs):
            return 0, (
                f"the prompt has {num_prompt_tokens} tokens, prefill's state is the one "
                f"after {end}: a state of a longer prompt"
            )
        end = max(0, last)
    why = uncovered_window(specs, params, end, num_computed_tokens)
    return (0, why) if why else (end, "")


def uncovered_window(
    specs: Sequence[KVCacheSpec], params: KVTransferParams, end: int, start: int
) -> str:
    """Why prefill did not keep every block a sliding-window group needs to load
    ``[start, end)`` ('' when it did; it sends such groups from their first kept block)."""
    if not params.remote_first_block or end <= start:
        return ""
    bs = params.remote_block_size
    for g, (spec, first) in enumerate(zip(specs, params.remote_first_block, strict=True)):
        if not isinstance(spec, SlidingWindowSpec):
            continue
        lo = max(start, spec.window_start(end))
        if lo < end and lo // bs < first:
            return (
                f"group {g} (sliding window {spec.sliding_window}): tokens [{lo}, {end}) "
                f"for token {end} need prefill's block {lo // bs} of {bs} tokens, but "
                f"prefill kept the window from block {first}"
            )
    return ""


def load_block_ids(
    specs: Sequence[KVCacheSpec],
    request_id: str,
    block_ids_per_group: Sequence[Sequence[int]],
    num_load_tokens: int,
    num_computed_tokens: int = 0,
) -> tuple[tuple[int, ...], ...]:
    """The allocated blocks of a load of tokens ``[num_computed_tokens, num_load_tokens)``,
    per group, from block 0 (placeholders, -1, stand where the engine gave a group no
    block: vLLM's sliding-window blocks before the window). Raises
    :class:`LifecycleError` when the engine allocated too few, or a placeholder where the
    load writes."""
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
        written = ids[_first_written(spec, num_computed_tokens, num_load_tokens) : need]
        if any(b < 0 for b in written):
            raise LifecycleError(
                f"request {request_id!r}, group {g}: the load of tokens "
                f"[{num_computed_tokens}, {num_load_tokens}) writes blocks {list(written)} "
                f"of {spec.block_size} tokens; the engine gave no block (-1) for some"
            )
        out.append(tuple(map(int, ids[:need])))
    return tuple(out)


def _first_written(spec: KVCacheSpec, start: int, end: int) -> int:
    """The first logical block a load of tokens ``[start, end)`` writes in ``spec``'s group."""
    if spec.kind is KVCacheKind.STATE:
        return max(0, end - 1) // spec.block_size
    if isinstance(spec, SlidingWindowSpec):
        start = max(start, spec.window_start(end))
    return start // spec.block_size
