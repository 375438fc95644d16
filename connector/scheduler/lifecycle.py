"""Request lifecycle on the scheduler side: one small state machine per role.

Decode (consumer) requests, by where their remote KV stands::

    MATCHED <--> FULL_HIT                  asked again while waiting for blocks
    MATCHED --alloc n>0--> ALLOCATED --meta--> LOADING --recv----> LOADED
                                                       --failed--> RECOMPUTED | FAILED
    MATCHED | FULL_HIT --alloc n=0--> RELEASING --meta--> RELEASED
    MATCHED | FULL_HIT --refused--> RELEASING --meta--> RECOMPUTED | FAILED   (see below)
    MATCHED | FULL_HIT | ALLOCATED --abort--> ABORTED        nothing in flight
    LOADING --abort--> ABORTING --recv | failed--> ABORTED   blocks free only now

Prefill (producer) requests, from ``request_finished`` to the release of their blocks;
only the workers end a hold (one clock: theirs), the scheduler follows their reports::

    PENDING --meta--> HELD --finished_sending (every rank)--> DONE
                      HELD --finished_sending, a lease ran out--> EXPIRED
                      HELD --request_aborted: the workers end the holds once no claim
                             they granted runs--> finished_sending --> ABORTED
    PENDING --request_aborted (no worker has it)--> ABORTED

Terminal states end the record (its id may come back only as a counted, ignored
notification). Engine calls that break the machine raise :class:`LifecycleError`; worker
reports that do not fit it are counted in :class:`Ignored`, never acted on twice. An
engine adapter that must not raise into its engine (vLLM's ``schedule()``) refuses the
load instead (``Loads.refuse``): prefill is told to free, nothing is read, and the load
ends failed, for the engine to recompute.
"""

from __future__ import annotations

import enum

from kvbridge.connector.common.metadata import LoadFailure
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.layouts.errors import KVBridgeError


class LifecycleError(KVBridgeError, RuntimeError):
    """The engine called the connector out of order for a request (an engine bug)."""


class LoadState(enum.Enum):
    MATCHED = enum.auto()  # remote KV to read; waiting for local blocks
    FULL_HIT = enum.auto()  # local prefix covers the loadable part; prefill must still free
    ALLOCATED = enum.auto()  # blocks allocated; the LoadSpec leaves with the next metadata
    RELEASING = enum.auto()  # nothing to read; the release leaves with the next metadata
    LOADING = enum.auto()  # LoadSpec sent; the worker may be writing into the blocks
    ABORTING = enum.auto()  # aborted while LOADING; blocks busy until the worker reports
    LOADED = enum.auto()
    RECOMPUTED = enum.auto()
    FAILED = enum.auto()
    RELEASED = enum.auto()
    ABORTED = enum.auto()


class SendState(enum.Enum):
    PENDING = enum.auto()  # blocks kept; the SendSpec leaves with the next metadata
    HELD = enum.auto()  # SendSpec sent; the workers hold the blocks under their lease
    DONE = enum.auto()  # decode reported it finished reading
    EXPIRED = enum.auto()  # a worker's lease ran out first
    ABORTED = enum.auto()  # the prefill engine dropped the request


class Ignored(enum.Enum):
    """Notifications and calls that matched no live request (unknown or already ended)."""

    FINISHED_SENDING = enum.auto()
    FINISHED_RECVING = enum.auto()
    FAILED_LOAD = enum.auto()
    ABORT = enum.auto()


_LS = LoadState
LOAD_TRANSITIONS: dict[LoadState, frozenset[LoadState]] = {
    _LS.MATCHED: frozenset({_LS.MATCHED, _LS.FULL_HIT, _LS.ALLOCATED, _LS.RELEASING, _LS.ABORTED}),
    _LS.FULL_HIT: frozenset({_LS.MATCHED, _LS.FULL_HIT, _LS.RELEASING, _LS.ABORTED}),
    _LS.ALLOCATED: frozenset({_LS.LOADING, _LS.ABORTED}),
    _LS.RELEASING: frozenset({_LS.RELEASED, _LS.RECOMPUTED, _LS.FAILED}),  # refused: failed
    _LS.LOADING: frozenset({_LS.LOADED, _LS.RECOMPUTED, _LS.FAILED, _LS.ABORTING}),
    # failed: the engine was told early, or a rank reported the load's own failure before
    # our abort went out to it (vLLM ends a failed request with an abort: loads.py)
    _LS.ABORTING: frozenset({_LS.ABORTED, _LS.FAILED}),
    _LS.LOADED: frozenset(),
    _LS.RECOMPUTED: frozenset(),
    _LS.FAILED: frozenset(),
    _LS.RELEASED: frozenset(),
    _LS.ABORTED: frozenset(),
}

_SS = SendState
SEND_TRANSITIONS: dict[SendState, frozenset[SendState]] = {
    _SS.PENDING: frozenset({_SS.HELD, _SS.ABORTED}),  # the worker never had it
    _SS.HELD: frozenset({_SS.DONE, _SS.EXPIRED, _SS.ABORTED}),
    _SS.DONE: frozenset(),
    _SS.EXPIRED: frozenset(),
    _SS.ABORTED: frozenset(),
}


def check_transition(request_id: str, table: dict, old: enum.Enum, new: enum.Enum) -> None:
    """Raise :class:`LifecycleError` unless ``table`` allows ``old -> new``."""
    if new not in table[old]:
        allowed = sorted(s.name for s in table[old]) or "none (terminal)"
        raise LifecycleError(
            f"request {request_id!r}: {old.name} -> {new.name} is not a valid transition; "
            f"from {old.name} the allowed next states are {allowed}"
        )


class LoadRecord:
    """A decode request whose KV lives (or lived) on a remote prefill."""

    __slots__ = (
        "failure",
        "last_heartbeat",
        "num_computed_tokens",
        "num_load_tokens",
        "params",
        "ranks_reported",
        "request_id",
        "state",
        "told",
    )

    def __init__(self, request_id: str, params: KVTransferParams) -> None:
        self.request_id = request_id
        self.params = params
        self.state = LoadState.MATCHED
        self.ranks_reported = 0  # worker ranks whose load of it ended (tensor parallelism)
        self.failure: LoadFailure | None = None  # the first rank's failure, if any
        self.told = False  # the engine heard it failed while transfers of it still ran
        self.num_computed_tokens = 0  # the engine's local prefix hit
        self.num_load_tokens = 0  # tokens valid after the load (lcm-aligned)
        self.last_heartbeat = float("-inf")

    def advance(self, new: LoadState) -> None:
        check_transition(self.request_id, LOAD_TRANSITIONS, self.state, new)
        self.state = new

    def __repr__(self) -> str:
        return (
            f"LoadRecord({self.request_id!r}, {self.state.name}, "
            f"tokens [{self.num_computed_tokens}, {self.num_load_tokens}))"
        )
