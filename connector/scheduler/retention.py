"""What a prefill keeps for a remote decode, and for how long.

Which blocks. Decode computes the last prompt token itself (its logits give the first
output token), so it loads the KV of every token before it: the *resume point* ``E`` is
``N - 1`` for an ``N``-token prompt, whatever the two block sizes are (partial blocks
move too). A state group needs the state after exactly ``E`` tokens. The engine keeps
that state in an extra *resume block* when ``E`` is not a block boundary (it passes it to
``request_finished``); without one the resume point falls back to the last state boundary
``E = floor((N - 1) / bs) * bs`` and decode computes the tokens after it. Per group of
``bs``-token blocks::

    full / MLA        blocks covering [0, E)
    sliding window w  blocks covering [max(0, E - w + 1), E): token E, which decode
                      computes first, attends to itself and the w - 1 before it (vLLM's
                      ``get_num_skipped_tokens``; later tokens need only later ones)
    state             the resume block (state after E), else block E/bs - 1

    e.g. N = 101, E = 100, bs = 16, w = 24, a resume block R:
    block        0   1   2   3   4   5   6
    full         K   K   K   K   K   K   K       K = kept for the decode
    window       f   f   f   f   K   K   K       f = freed at request_finished
    state        f   f   f   f   f   f   f   + R (state after token 100)

vLLM itself frees a sliding-window group's blocks wholly before token ``n - w + 1`` when
a request of ``n`` computed tokens finishes, before the connector sees them; its prefill
therefore computes ``N - 1`` tokens (``kvbridge.connector.vllm.scheduler_side``), so the
block of token ``E - w + 1 = N - w`` is still there.

How long. One clock decides, the prefill worker's (``kvbridge.connector.worker.prefill
.sender``): a hold ends when its last reader said Done, when its lease ran out (extended
by decode's heartbeats and claims), or, after an engine abort, once no claim the worker
granted runs and no push writes from the blocks. The scheduler keeps no lease clock: it
frees kept blocks only when every worker rank reported the request in
``finished_sending``. The :class:`LeaseBook` hands each block back exactly once.
"""

from __future__ import annotations

from kvbridge.connector.scheduler.lifecycle import SEND_TRANSITIONS, SendState, check_transition
from kvbridge.layouts.specs import KVCacheKind, KVCacheSpec, SlidingWindowSpec


def resume_point(num_tokens: int, block_size: int, *, resume_state: bool) -> int:
    """``E``: the prompt tokens whose KV (and state) a decode of ``num_tokens`` loads."""
    end = max(0, num_tokens - 1)
    return end if resume_state else end // block_size * block_size


def retained_block_range(spec: KVCacheSpec, end: int) -> tuple[int, int]:
    """Logical blocks ``[first, stop)`` of one group a decode resuming at ``end`` reads
    (state groups: the boundary block of ``end``; empty when ``end`` is no boundary)."""
    bs = spec.block_size
    stop = -(-end // bs)
    match spec.kind:
        case KVCacheKind.FULL_ATTENTION | KVCacheKind.MLA:
            return 0, stop
        case KVCacheKind.SLIDING_WINDOW:
            assert isinstance(spec, SlidingWindowSpec)
            start = spec.window_start(end)
            return (start // bs if start < end else stop), stop
        case KVCacheKind.STATE:
            if end == 0 or end % bs:
                return stop, stop
            return stop - 1, stop
    raise AssertionError(f"unhandled KVCacheKind {spec.kind}")


class SendRecord:
    """A finished prefill request whose blocks are kept for a remote reader.

    ``kept_block_ids`` may be read by the decode; ``free_block_ids`` may be freed by the
    engine now. A release (done, lease, abort) moves the kept blocks to the free side.
    """

    __slots__ = (
        "abort_queued",
        "expired",
        "free_block_ids",
        "kept_block_ids",
        "ranks_reported",
        "request_id",
        "state",
    )

    def __init__(
        self, request_id: str, kept_block_ids: list[int], free_block_ids: list[int]
    ) -> None:
        self.request_id = request_id
        self.state = SendState.PENDING
        self.kept_block_ids = kept_block_ids
        self.free_block_ids = free_block_ids
        self.ranks_reported = 0  # worker ranks whose hold ended (finished_sending)
        self.expired = False  # a rank's hold ended by its lease
        self.abort_queued = False  # the engine aborted it; the workers end their holds

    @property
    def is_live(self) -> bool:
        """Still holding its kept blocks for the reader."""
        return self.state in (SendState.PENDING, SendState.HELD)

    def advance(self, new: SendState) -> None:
        check_transition(self.request_id, SEND_TRANSITIONS, self.state, new)
        self.state = new

    def __repr__(self) -> str:
        return (
            f"SendRecord({self.request_id!r}, {self.state.name}, kept={self.kept_block_ids}, "
            f"to_free={self.free_block_ids}, ranks_reported={self.ranks_reported})"
        )


class LeaseBook:
    """Held prefill requests and the blocks the engine may free (no clock: the workers
    say when a hold ended)."""

    __slots__ = ("_records",)

    def __init__(self) -> None:
        self._records: dict[str, SendRecord] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._records

    def live(self, request_id: str) -> SendRecord | None:
        record = self._records.get(request_id)
        return record if record is not None and record.is_live else None

    def state(self, request_id: str) -> SendState | None:
        record = self._records.get(request_id)
        return None if record is None else record.state

    def hold(self, request_id: str, kept: list[int], free: list[int]) -> None:
        self._records[request_id] = SendRecord(request_id, kept, free)

    @staticmethod
    def release(record: SendRecord, why: SendState) -> None:
        """End the hold: the kept blocks may be freed from now on."""
        record.advance(why)
        record.free_block_ids.extend(record.kept_block_ids)
        record.kept_block_ids = []

    def take(self, request_id: str) -> tuple[int, ...]:
        """The blocks freeable now, each handed out once; drained records are dropped."""
        record = self._records.get(request_id)
        if record is None:
            return ()
        out = tuple(record.free_block_ids)
        record.free_block_ids = []
        if not record.is_live:
            del self._records[request_id]
        return out

    @property
    def num_live(self) -> int:
        return sum(1 for record in self._records.values() if record.is_live)

    @property
    def num_kept_blocks(self) -> int:
        return sum(len(r.kept_block_ids) for r in self._records.values() if r.is_live)
