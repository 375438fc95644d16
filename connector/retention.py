"""What a prefill keeps for a remote decode, and for how long.

Which blocks. Prefill does not know the decode's block sizes; decode loads ``n_load =
floor(min(num_tokens, len(prompt) - 1) / L) * L`` tokens, ``L`` the lcm of both sides'
block sizes, so ``num_tokens - L <= n_load <= num_tokens - 1``. The producer keeps what
any ``n_load >= num_tokens - 1 - M`` needs, where the margin ``M`` is
``extra["max_peer_block_size"]`` (default 128): correct for every decode with
``L <= M + 1``. For a group of ``bs``-token blocks and ``N = num_tokens``::

    full / MLA        blocks covering [0, N)
    sliding window w  blocks covering [max(0, N - 1 - M - w), N)
    state             block k-1 (the state after k*bs tokens) for N-1-M < k*bs <= N-1

    e.g. N = 100, bs = 16, M = 16, w = 24:
    block        0   1   2   3   4   5   6
    full         K   K   K   K   K   K   K       K = kept for the decode
    window       f   f   f   K   K   K   K       f = freed at request_finished
    state        f   f   f   f   f   K   f

How long. Kept blocks are held under a lease (``lease_s`` on the scheduler's clock),
extended by decode heartbeats, ended by decode's Done, the lease running out, or an abort.
The :class:`LeaseBook` hands each block back exactly once.
"""

from __future__ import annotations

import heapq

from connector.lifecycle import SEND_TRANSITIONS, SendState, check_transition
from layouts.specs import KVCacheKind, KVCacheSpec

DEFAULT_MAX_PEER_BLOCK_SIZE = 128


def retained_block_range(spec: KVCacheSpec, num_tokens: int, margin: int) -> tuple[int, int]:
    """Logical blocks ``[first, stop)`` of one group that a remote decode may read."""
    bs = spec.block_size
    num_blocks = -(-num_tokens // bs)
    match spec.kind:
        case KVCacheKind.FULL_ATTENTION | KVCacheKind.MLA:
            return 0, num_blocks
        case KVCacheKind.SLIDING_WINDOW:
            low = max(0, num_tokens - 1 - margin - spec.sliding_window)
            return low // bs, num_blocks
        case KVCacheKind.STATE:
            k_low = max(1, (num_tokens - 1 - margin) // bs + 1)
            k_high = (num_tokens - 1) // bs
            return k_low - 1, max(k_high, k_low - 1)
    raise AssertionError(f"unhandled KVCacheKind {spec.kind}")


class SendRecord:
    """A finished prefill request whose blocks are kept for a remote reader.

    ``kept_block_ids`` may be read by the decode; ``free_block_ids`` may be freed by the
    engine now. A release (done, lease, abort) moves the kept blocks to the free side.
    """

    __slots__ = ("expiry", "free_block_ids", "kept_block_ids", "request_id", "state")

    def __init__(
        self, request_id: str, kept_block_ids: list[int], free_block_ids: list[int], expiry: float
    ) -> None:
        self.request_id = request_id
        self.state = SendState.PENDING
        self.kept_block_ids = kept_block_ids
        self.free_block_ids = free_block_ids
        self.expiry = expiry

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
            f"to_free={self.free_block_ids}, expiry={self.expiry})"
        )


class LeaseBook:
    """Held prefill requests, their leases (a heap; stale entries skipped), and the
    blocks the engine may free."""

    __slots__ = ("_heap", "_records", "lease_s")

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._records: dict[str, SendRecord] = {}
        self._heap: list[tuple[float, str]] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._records

    def live(self, request_id: str) -> SendRecord | None:
        record = self._records.get(request_id)
        return record if record is not None and record.is_live else None

    def state(self, request_id: str) -> SendState | None:
        record = self._records.get(request_id)
        return None if record is None else record.state

    def hold(self, request_id: str, kept: list[int], free: list[int], now: float) -> None:
        record = SendRecord(request_id, kept, free, now + self.lease_s)
        self._records[request_id] = record
        heapq.heappush(self._heap, (record.expiry, request_id))

    def extend(self, record: SendRecord, now: float) -> None:
        if now + self.lease_s > record.expiry:
            record.expiry = now + self.lease_s
            heapq.heappush(self._heap, (record.expiry, record.request_id))

    def expired(self, now: float) -> list[SendRecord]:
        """Live records whose lease ran out by ``now`` (the caller releases them)."""
        out, heap = [], self._heap
        while heap and heap[0][0] <= now:
            expiry, request_id = heapq.heappop(heap)
            record = self._records.get(request_id)
            if record is not None and record.is_live and record.expiry == expiry:
                out.append(record)
        return out

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
