"""What the scheduler side tells the worker side each step, and what comes back.

::

    scheduler side --ConnectorMetadata--> worker side   (once per engine step)
    scheduler side <----WorkerOutput----- worker side   (get_finished, once per step)

Block ids are per KV-cache group; ``first_block[g]`` is the logical index of
``block_ids[g][0]`` (sliding-window and state groups send only their tail).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.connector.common.params import KVTransferParams


@dataclass(frozen=True, kw_only=True)
class LoadSpec:
    """Decode: read tokens ``[start_token, end_token)`` of a request into local blocks."""

    request_id: str
    params: KVTransferParams
    local_block_ids: tuple[tuple[int, ...], ...]  # per group, logical blocks 0..
    start_token: int  # tokens already computed locally (prefix hit)
    end_token: int  # tokens that will be valid after the load


@dataclass(frozen=True, kw_only=True)
class SendSpec:
    """Prefill: blocks a finished request keeps for a remote reader until Done or lease."""

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]  # per group, as sent in the params
    first_block: tuple[int, ...]
    lease_s: float


@dataclass(frozen=True, kw_only=True)
class ConnectorMetadata:
    reqs_to_load: tuple[LoadSpec, ...] = ()
    reqs_to_send: tuple[SendSpec, ...] = ()
    # decode: requests given up before or while loading (prefill must free)
    reqs_to_abort: tuple[tuple[str, KVTransferParams], ...] = ()
    # decode: requests still queued for allocation (heartbeats keep prefill's lease alive)
    reqs_waiting: tuple[tuple[str, KVTransferParams], ...] = ()
    # decode: full local prefix hits, nothing to read, but prefill must still free
    reqs_to_release: tuple[tuple[str, KVTransferParams], ...] = ()
    # prefill: sends aborted before any worker had them (their blocks are free): refuse
    # their readers; never reported in finished_sending
    reqs_freed: tuple[str, ...] = ()
    # prefill: held sends the engine aborted: end the hold (no sooner than the claims
    # granted for it, after the pushes writing from it), then report it finished_sending
    sends_to_end: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class LoadFailure:
    """A load that did not complete: which local blocks hold no valid data, and why."""

    request_id: str
    reason: str
    invalid_block_ids: tuple[tuple[int, ...], ...]  # per group
    num_valid_tokens: int  # tokens that can be kept (recompute from here)


@dataclass(frozen=True, kw_only=True)
class WorkerOutput:
    finished_sending: frozenset[str] = frozenset()  # prefill: blocks may be freed
    finished_recving: frozenset[str] = frozenset()  # decode: KV loaded, request may run
    failed_loads: tuple[LoadFailure, ...] = ()
    # decode, ``failure_policy: fail``: loads that failed while transfers of theirs may
    # still land in their blocks: the engine may end the request now, but keeps its blocks
    # until the same load's ``failed_loads`` report (every transfer ended)
    failing_loads: tuple[LoadFailure, ...] = ()
    expired_leases: frozenset[str] = frozenset()  # prefill: subset of finished_sending
    notes: dict[str, str] = field(default_factory=dict)  # request id -> why (logs, metrics)
