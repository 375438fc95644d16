"""Prefill side: keep finished requests' blocks for their reader, rewrite them on demand.

Decode picks the prefill's request up only after prefill finished it, so the sender
learns the reader's format from the reader: ``Prepare`` names, per group, the rewrite
the plan wants (e.g. NHD 64-token blocks -> 4 x HND 16-token chunks). The sender applies
it in place on the request's blocks ("permute after save"), answers ``Prepared``, and
undoes it when the reader says ``Done`` (or the lease expires), so the blocks are exact
again for prefill's own prefix cache.

A block shared by two requests (prefix caching) is rewritten once and restored when its
last reader is done; a conflicting rewrite of a block in use is refused, not applied.

Under tensor parallelism several decode ranks may read one prefill rank's heads of a
request: each sends ``Done`` naming itself and how many readers there are, and the blocks
stay until the last of them (or the lease) ends it.

Permute after save, really after save: the sender remembers the rewrites its last reader
asked for and applies them as soon as the next request is added (the engine hands it over
right after the forward pass saved it), so by the time that request's ``Prepare`` (or
``Push``) comes the blocks are usually in the reader's format already and the answer is
immediate. A reader that wants another format gets the blocks restored and rewritten its
way (a miss: two extra passes, counted in ``eager_misses``). Only where rewrites are
allowed at all (``rewrites_in_place``) and asked for (``rewrite_on_save``, which the
handshake advertises: a reader that needs no rewrite then claims the blocks with an empty
``Prepare`` before reading, so a guess never reaches it).

How long a request's blocks stay, and for whom, is its hold (``prefill.holds``); messages
that come before their request wait for it (``prefill.early``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from kvbridge.connector.common.metadata import SendSpec
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import (
    NOTIF_PROTOCOL_VERSION,
    Done,
    Heartbeat,
    Prepare,
    Prepared,
    asked_key,
)
from kvbridge.connector.worker.boundary import Boundary
from kvbridge.connector.worker.device_order import DeviceOrder
from kvbridge.connector.worker.prefill.block_lending import BlockLending
from kvbridge.connector.worker.prefill.early import EARLY_DONE_TTL_S, EARLY_PREPARE_TTL_S, Early
from kvbridge.connector.worker.prefill.gather_arena import GatherArena
from kvbridge.connector.worker.prefill.holds import MAX_READERS, Claim, Kept, Reader
from kvbridge.connector.worker.prefill.reader_digests import ReaderDigests, claim_digests
from kvbridge.connector.worker.staging.host_stage import HostStage
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.arrangement import BlockArrangement
from kvbridge.layouts.errors import KVBridgeError

logger = logging.getLogger(__name__)

MAX_HOLD_S = 600.0  # the longest hold one claim may ask for (Prepare.hold_s)


class Sender:
    """Requests whose blocks wait for a remote reader, with leases."""

    def __init__(
        self,
        buffers: KVCacheBuffers,
        metrics: ConnectorMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        rewrites_in_place: bool = True,
        rewrite_on_save: bool = False,
        stage: HostStage | None = None,
        order: DeviceOrder | None = None,
        early_wait_s: float = EARLY_PREPARE_TTL_S,
        digests: ReaderDigests | None = None,
        gather: GatherArena | None = None,
        boundary: Boundary | None = None,
    ) -> None:
        """``early_wait_s``: how long a ``Prepare`` or ``Push`` for a request not handed
        over yet waits for it (the worker passes its lease). ``stage``: the host mirror
        NIXL moves instead of ``buffers`` (host staging); kept blocks are copied there once
        they are in the format their reader gets. ``order``: fences the rewrite kernels
        before NIXL may read the blocks. ``digests``: answers verified claims
        (``Prepare.verify``) with the digests of what their reader reads. ``gather``: packs
        the rows of claims that ask (``Prepare.packed``)."""
        self._boundary = boundary or Boundary(metrics)
        self._digests = digests
        self._gather = gather
        self._buffers = buffers
        self._order = order or DeviceOrder(buffers.device)
        self._stage = stage
        self._rewrite_on_save = rewrite_on_save and rewrites_in_place
        self._rewrites_in_place = rewrites_in_place
        self._metrics = metrics
        self._clock = clock
        self._early = Early(metrics, wait_s=early_wait_s, clock=clock)
        self._pending: dict[str, Kept] = {}
        self._lending = BlockLending(buffers, metrics, self._order)
        self._finished: set[str] = set()
        self._expired: set[str] = set()
        self._replies: list[tuple[str, Prepared]] = []  # deferred answers to send
        self._ended: dict[str, float] = {}  # request -> when it ended here (recent ones)
        # the rewrites the last reader asked for: applied on add (permute after save)
        self._learned: dict[int, tuple[BlockArrangement, BlockArrangement]] = {}

    @property
    def early_wait_s(self) -> float:
        """How long a ``Prepare`` or ``Push`` waits for its request to be handed over."""
        return self._early.wait_s

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def add(self, spec: SendSpec) -> None:
        if spec.request_id in self._pending:
            return
        now = self._clock()
        pending = Kept(
            spec=spec, deadline=now + spec.lease_s, limit=now + spec.lease_s + MAX_HOLD_S
        )
        self._pending[spec.request_id] = pending
        if self._learned and self._rewrite_on_save:
            self._rewrite_eagerly(pending)
        self._stage_out(pending)
        prepares, dones = self._early.take(spec.request_id)
        for agent, prepare in prepares:  # each claim its own failure boundary, as in the inbox
            reply = self._boundary.run(
                "Prepare", lambda p=prepare, a=agent: self.on_prepare(p, a), peer=agent
            )
            if reply is None:
                reason = "prefill could not handle the claim (see its log)"
                reply = Prepared(
                    request_id=prepare.request_id, ok=False, reason=reason, claim=prepare.claim
                )
            self._replies.append((agent, reply))
        for agent, msg in dones:
            self.on_done(msg, agent)

    def on_prepare(self, msg: Prepare, agent: str = "") -> Prepared | None:
        """The answer to send ``agent``, or None: the request is not here yet, and the
        answer comes from :meth:`take_replies` once it is (or it waited too long)."""
        if msg.version != NOTIF_PROTOCOL_VERSION:
            return Prepared(
                request_id=msg.request_id,
                ok=False,
                reason=f"Prepare version {msg.version}, this prefill speaks "
                f"{NOTIF_PROTOCOL_VERSION} (readers in the protocol): upgrade decode",
                claim=msg.claim,
            )
        reader = (agent, msg.reader_rank)
        pending = self._pending.get(msg.request_id)
        if (
            pending is not None
            and reader not in pending.claims
            and len(pending.claims) >= MAX_READERS
        ):
            return Prepared(
                request_id=msg.request_id,
                ok=False,
                reason=f"{MAX_READERS} readers claim this request already",
                claim=msg.claim,
            )
        if pending is not None and not pending.ending and self._clock() > pending.deadline:
            self.expire()  # its lease ran out before this step's expire(): so it ended
            pending = self._pending.get(msg.request_id)
        if pending is not None and pending.ending and not pending.extends(reader, self._clock()):
            return _unknown(msg.request_id, msg.claim)  # its hold is ending: no new reader
        if pending is None:
            if msg.request_id in self._ended or not self._early.keep_prepare(msg, agent):
                return _unknown(msg.request_id, msg.claim)
            return None
        if msg.rewrites and not self._rewrites_in_place:
            return Prepared(
                request_id=msg.request_id,
                ok=False,
                reason="this prefill does not rewrite blocks in place (its engine may read "
                "them meanwhile); read them in their native arrangement",
                claim=msg.claim,
            )
        wanted = {
            rw.group_id: (rw.src.to_arrangement(), rw.dst.to_arrangement()) for rw in msg.rewrites
        }
        # a pipeline stage's reader reads nothing of these groups: it neither claims their
        # blocks nor minds how another stage's reader has them
        skipped = set(msg.skipped_groups) - set(wanted)
        before = dict(pending.rewritten)
        if pending.eager:
            pending.eager = False  # a reader claims the format from now on
            if {g: a for g, a in pending.rewritten.items() if g not in skipped} != wanted:
                self._metrics.eager_misses += 1
                self._lending.restore(pending)  # a guess no reader has read
            else:
                self._metrics.eager_hits += 1
        kept = set(pending.rewritten)  # what earlier readers were promised stays as is
        try:
            self._lending.check_native(pending, set(wanted) | skipped)
            for group_id, (src, dst) in wanted.items():
                self._lending.rewrite(pending, group_id, src, dst)
        except KVBridgeError as exc:
            self._lending.restore(pending, set(pending.rewritten) - kept)  # only what this did
            if pending.rewritten != before:  # the device holds other bytes again
                self._stage_out(pending)
            return Prepared(request_id=msg.request_id, ok=False, reason=str(exc), claim=msg.claim)
        if wanted:
            self._learned = wanted
        self._lending.claim_native(
            pending, set(range(len(pending.spec.block_ids))) - set(wanted) - skipped
        )
        if pending.rewritten != before:
            self._stage_out(pending)
        now = self._clock()
        hold = max(pending.spec.lease_s, min(max(msg.hold_s, 0.0), MAX_HOLD_S))
        pending.deadline = max(pending.deadline, min(now + hold, pending.limit))
        claim = pending.claims.get(reader)
        if claim is None or claim.ended:
            claim = pending.claims[reader] = Claim(numbers=set(), until=0.0)
        claim.numbers.add(msg.claim)
        claim.until = max(claim.until, pending.deadline)  # what the answer promises
        digests, why = claim_digests(self._digests, self._metrics, pending.spec, agent, msg)
        packed_at, packed_bytes, unpacked = -1, 0, ""
        if msg.packed and self._gather is not None:
            packed_at, packed_bytes, unpacked = self._gather.pack(pending.spec, agent, msg)
            if unpacked:
                logger.debug("claim on %s by %s: %s", msg.request_id, agent or "?", unpacked)
        return Prepared(
            request_id=msg.request_id,
            ok=True,
            asked=asked_key(msg),
            held_s=max(pending.deadline - now, 0.0),
            claim=msg.claim,
            digests=digests,
            reason=why,
            packed_at=packed_at,
            packed_bytes=packed_bytes,
        )

    def _stage_out(self, pending: Kept) -> None:
        """Host staging: the mirror gets the request's blocks as the device holds them."""
        if self._stage is None:
            return
        for group_id, ids in enumerate(pending.spec.block_ids):
            if ids:
                self._stage.to_host(group_id, np.asarray(ids, dtype=np.int64))

    def _rewrite_eagerly(self, pending: Kept) -> None:
        """Rewrite a request just added into the last reader's format (a guess: undone
        when its reader wants another one; skipped when a block is lent another way)."""
        try:
            for group_id, (src, dst) in self._learned.items():
                self._lending.rewrite(pending, group_id, src, dst)
        except KVBridgeError as exc:
            logger.debug("no rewrite on save for %s: %s", pending.spec.request_id, exc)
            self._lending.restore(pending)
            return
        pending.eager = True

    def on_done(self, msg: Done, agent: str = "") -> bool:
        """A reader is done: its claim ends (the claims ``msg`` names, and only the
        reader's own); the hold ends once ``readers`` readers said Done and no claim
        granted to another still runs. False: unknown or a repeat."""
        pending = self._pending.get(msg.request_id)
        if pending is None:
            # False: ended here already (a late Done), or too many waiting
            return msg.request_id not in self._ended and self._early.keep_done(msg, agent)
        reader = (agent, msg.reader_rank)
        claim = pending.claims.get(reader)
        if claim is not None and not claim.ended and claim.numbers & set(msg.claims):
            claim.ended = True  # also a reader's second load (a replay), Done before
        elif reader in pending.done_by:
            return False
        elif claim is not None and not claim.ended:
            logger.warning(
                "Done for %s from %s rank %d names claims %s, not the claim it was granted "
                "(%s): that claim runs until its time is up",
                msg.request_id,
                agent or "?",
                msg.reader_rank,
                msg.claims,
                sorted(claim.numbers),
            )
        pending.done_by.add(reader)
        pending.readers = max(1, msg.readers)
        if pending.ending:
            self._end(pending, pending.ending)  # maybe the claim it waited for
        elif len(pending.done_by) >= pending.readers:
            self._end(pending, "done")
        return True

    def kept(self, request_id: str, reader: Reader | None = None) -> SendSpec | None:
        """The spec of a request whose blocks are kept here (None: not, not yet, or its
        hold is ending, unless ``reader`` holds a claim on it that still runs: a push's
        later rounds go on for it)."""
        pending = self._pending.get(request_id)
        if pending is None or (
            pending.ending and not (reader and pending.extends(reader, self._clock()))
        ):
            return None
        return pending.spec

    def pin(self, request_id: str) -> None:
        """A push starts WRITEs from the request's blocks: its hold does not end (nor its
        rewrites get undone) until :meth:`unpin`."""
        self._pending[request_id].pins += 1

    def unpin(self, request_id: str) -> None:
        """The push's WRITEs ended; a hold that ended meanwhile ends now."""
        pending = self._pending.get(request_id)
        if pending is None:
            return
        pending.pins -= 1
        if pending.ending:
            self._end(pending, pending.ending)

    def has_ended(self, request_id: str, reader: Reader | None = None) -> bool:
        """The request was kept here and its hold ended or is ending (Done, lease,
        abort): never again (for ``reader``: unless it holds a claim that still runs)."""
        pending = self._pending.get(request_id)
        if pending is None:
            return request_id in self._ended
        return bool(pending.ending) and not (reader and pending.extends(reader, self._clock()))

    def readers_done(self, request_id: str) -> tuple[int, ...] | None:
        """Reader ranks that said Done for a held request (None: not held)."""
        pending = self._pending.get(request_id)
        return None if pending is None else tuple(sorted({r for _, r in pending.done_by}))

    def on_heartbeat(self, msg: Heartbeat) -> None:
        now = self._clock()
        for rid in msg.request_ids:
            pending = self._pending.get(rid)
            if pending is not None and not pending.ending:
                pending.deadline = max(pending.deadline, now + pending.spec.lease_s)

    def abort(self, request_id: str, *, report: bool = True) -> None:
        """The engine drops a kept request: its hold ends (blocks restored, reported
        finished when ``report``) once no claim granted for it runs and no push writes
        from it. ``report=False``: the scheduler freed it before this worker got it."""
        pending = self._pending.get(request_id)
        if pending is None:
            self._ended.setdefault(request_id, self._clock())  # also when it never got here
        waiting = self._early.drop(request_id)
        self._replies += [(agent, _unknown(request_id, p.claim)) for agent, p in waiting]
        if pending is not None:
            self._end(pending, "aborted", report=report)

    def drop(self, request_id: str) -> None:
        """Adding the request raised (the boundary logged why): its hold ends as an abort
        does (restored, no new reader, after the claims granted while it was added), and
        the engine hears it finished, so its blocks are freed, also when it never got
        into the table."""
        if request_id in self._pending:
            self.abort(request_id)
        else:
            self.abort(request_id, report=False)
            self._finished.add(request_id)

    def _end(self, pending: Kept, why: str, *, report: bool = True) -> None:
        """End the hold now, or mark it ending when a push still writes from the blocks
        or a claim granted to a reader still runs (that reader has not said Done);
        :meth:`expire`, :meth:`unpin` or that reader's :meth:`on_done` end it later."""
        now = self._clock()
        rid = pending.spec.request_id
        claimed_until = pending.claimed_until(now)
        if pending.pins or claimed_until:
            if not pending.ending:
                logger.info(
                    "hold of %s ends (%s) once %s",
                    rid,
                    why,
                    "its pushes' WRITEs ended"
                    if pending.pins
                    else f"the claims granted to readers that have not said Done ran out "
                    f"({claimed_until - now:.1f} s at most) or they said Done",
                )
            pending.ending = why
            return
        del self._pending[rid]
        if self._gather is not None:
            self._gather.give_back(rid)
        self._lending.restore(pending)
        self._lending.claim_native(pending, set(), release=True)
        self._ended[rid] = now
        if report:
            self._finished.add(rid)
        if why == "expired":
            self._expired.add(rid)

    def expire(self) -> None:
        now = self._clock()
        refused = self._early.expire()
        self._replies += [(agent, _unknown(p.request_id, p.claim)) for agent, p in refused]
        for rid, ended in list(self._ended.items()):
            if now - ended > EARLY_DONE_TTL_S:
                del self._ended[rid]
        for rid, pending in list(self._pending.items()):
            if pending.ending:
                self._end(pending, pending.ending)  # pinned or claimed: maybe over now
            elif now > pending.deadline:
                self._metrics.leases_expired += 1
                logger.warning("lease of %s expired; freeing its blocks", rid)
                self._end(pending, "expired")

    def take_replies(self) -> list[tuple[str, Prepared]]:
        """Deferred ``Prepared`` answers and the agents to send them to."""
        out, self._replies = self._replies, []
        return out

    def take_results(self) -> tuple[set[str], set[str]]:
        """(finished, expired): each request once, the moment its hold ended here."""
        out = (self._finished, self._expired)
        self._finished, self._expired = set(), set()
        return out

    def close(self) -> None:
        """Shutdown: the memory goes with the process (the pushes were closed first)."""
        for pending in list(self._pending.values()):
            pending.pins = 0
            pending.claims.clear()
            self._end(pending, "aborted")


def _unknown(request_id: str, claim: int) -> Prepared:
    return Prepared(
        request_id=request_id,
        ok=False,
        reason=f"unknown request {request_id!r} on this prefill (never kept, already done, "
        f"or its lease expired)",
        claim=claim,
    )
