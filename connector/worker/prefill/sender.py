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

One clock decides when a hold ends: this one. The scheduler frees kept blocks only when
this sender reports the request finished (``finished_sending``), never on a clock of its
own. A claim (``Prepare``) belongs to its reader, the (decode agent, rank) that sent it:
it extends the hold to at least ``max(lease_s, hold_s)`` from now and answers how long it
lasts (``Prepared.held_s``). The hold then ends no sooner for *any* reason (the readers'
``Done``, an engine abort) unless that reader's own ``Done`` names the claim: the same
params may reach two decodes (a router retrying or hedging, a client replaying them), and
the first one's ``Done`` must not free blocks the second was promised. A push writing from
the blocks *pins* them (:meth:`Sender.pin`): the hold does not end, whatever ends it,
until the push's WRITEs ended::

    kept --(Done from the last reader | lease ran out | abort)--> ending: no new reader
         is granted a claim; wait for every granted claim (its reader's Done, or its time
         ran out) and the pushes' WRITEs --> restored, reported finished

The readers a hold waits for are counted by their ``Done`` (``Done.readers``: decode ranks
that each read some of this rank's heads), one per (agent, rank).

A ``Done`` may arrive before the request does: an engine hands its worker the finished
request with its next step, and an idle engine takes none, while decode (which needs no
``Prepare`` when no rewrite is due) has already read the blocks. Such a ``Done`` is kept
for ``EARLY_DONE_TTL_S`` and ends the request as soon as it is added. A ``Prepare`` may
arrive that early too (a rewrite, or a decode claiming the blocks near the lease end): it
is answered when the request is added, or refused once ``early_wait_s`` passed (the
worker passes its lease: the engine hands over a finished request with its next step,
which under load may be seconds away, and a request it still owns is finishing, not
gone); one for a request that already ended here, or that the engine freed before
handing it over, is refused at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvbridge.connector.common.metadata import SendSpec
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import (
    NOTIF_PROTOCOL_VERSION,
    Done,
    GroupDigest,
    Heartbeat,
    Prepare,
    Prepared,
)
from kvbridge.connector.worker.device_order import DeviceOrder
from kvbridge.connector.worker.prefill.block_lending import BlockLending
from kvbridge.connector.worker.prefill.gather_arena import GatherArena
from kvbridge.connector.worker.prefill.reader_digests import ReaderDigests
from kvbridge.connector.worker.staging.host_stage import HostStage
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.arrangement import BlockArrangement
from kvbridge.layouts.errors import KVBridgeError

logger = logging.getLogger(__name__)

EARLY_DONE_TTL_S = 120.0  # how long a Done for a request not added yet is kept
# how long a Prepare (or Push) waits for its request to be added, unless the worker says
# otherwise (it passes its lease): the engine may take several seconds to hand over a
# request it finished (a long step under load); 5 s lost pushes under 8 concurrent loads
EARLY_PREPARE_TTL_S = 30.0
MAX_HOLD_S = 600.0  # the longest hold one claim may ask for (Prepare.hold_s)


Reader = tuple[str, int]  # (decode's NIXL agent, its rank): who claims and says Done


@dataclass
class _Claim:
    """What one reader was granted: the hold lasts for it until ``until`` unless its own
    ``Done`` names one of ``numbers`` first."""

    numbers: set[int]
    until: float
    ended: bool = False  # its reader's Done named it


@dataclass
class _Pending:
    spec: SendSpec
    deadline: float
    rewritten: dict[int, tuple[BlockArrangement, BlockArrangement]] = field(default_factory=dict)
    done_by: set[Reader] = field(default_factory=set)  # readers that said Done
    readers: int = 1  # readers the hold waits for (the last Done's ``readers``)
    eager: bool = False  # rewritten on add, in the last reader's format; no reader asked yet
    claims: dict[Reader, _Claim] = field(default_factory=dict)  # granted, by reader
    pins: int = 0  # pushes whose WRITEs may still read the blocks
    native: set[int] = field(default_factory=set)  # groups a reader claimed as they are
    ending: str = ""  # why the hold ends, once it may not end yet (pinned, claimed)

    def claimed_until(self, now: float) -> float:
        """When the last granted claim still running runs out (0.0: none runs)."""
        live = [c.until for c in self.claims.values() if not c.ended and c.until > now]
        return max(live, default=0.0)


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
    ) -> None:
        """``early_wait_s``: how long a ``Prepare`` or ``Push`` for a request not handed
        over yet waits for it (the worker passes its lease). ``stage``: the host mirror
        NIXL moves instead of ``buffers`` (host staging); kept blocks are copied there once
        they are in the format their reader gets. ``order``: fences the rewrite kernels
        before NIXL may read the blocks. ``digests``: answers verified claims
        (``Prepare.verify``) with the digests of what their reader reads. ``gather``: packs
        the rows of claims that ask (``Prepare.packed``)."""
        self._digests = digests
        self._gather = gather
        self._buffers = buffers
        self._order = order or DeviceOrder(buffers.device)
        self._stage = stage
        self._rewrite_on_save = rewrite_on_save and rewrites_in_place
        self._rewrites_in_place = rewrites_in_place
        self._metrics = metrics
        self._clock = clock
        self.early_wait_s = early_wait_s
        self._pending: dict[str, _Pending] = {}
        self._lending = BlockLending(buffers, metrics, self._order)
        self._finished: set[str] = set()
        self._expired: set[str] = set()
        # request -> (expiry, [(reader's agent, Done)]): Dones that came before the request
        self._early: dict[str, tuple[float, list[tuple[str, Done]]]] = {}
        # request -> (expiry, [(requester agent, Prepare)]) waiting for the request
        self._early_prepares: dict[str, tuple[float, list[tuple[str, Prepare]]]] = {}
        self._replies: list[tuple[str, Prepared]] = []  # deferred answers to send
        self._ended: dict[str, float] = {}  # request -> when it ended here (recent ones)
        # the rewrites the last reader asked for: applied on add (permute after save)
        self._learned: dict[int, tuple[BlockArrangement, BlockArrangement]] = {}

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def add(self, spec: SendSpec) -> None:
        if spec.request_id in self._pending:
            return
        pending = _Pending(spec=spec, deadline=self._clock() + spec.lease_s)
        self._pending[spec.request_id] = pending
        if self._learned and self._rewrite_on_save:
            self._rewrite_eagerly(pending)
        self._stage_out(pending)
        _, prepares = self._early_prepares.pop(spec.request_id, (0.0, []))
        for agent, prepare in prepares:
            reply = self.on_prepare(prepare, agent)
            assert reply is not None  # the request is pending now
            self._replies.append((agent, reply))
        _, early = self._early.pop(spec.request_id, (0.0, []))
        for agent, msg in early:
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
        if pending is not None and not pending.ending and self._clock() > pending.deadline:
            self.expire()  # its lease ran out before this step's expire(): so it ended
            pending = self._pending.get(msg.request_id)
        if pending is not None and pending.ending and not self._extends(pending, reader):
            return _unknown(msg.request_id, msg.claim)  # its hold is ending: no new reader
        if pending is None:
            if msg.request_id in self._ended or len(self._early_prepares) >= 4096:
                return _unknown(msg.request_id, msg.claim)
            _, waiting = self._early_prepares.setdefault(
                msg.request_id, (self._clock() + self.early_wait_s, [])
            )
            # a claim sent again replaces the reader's earlier one: answered once (and
            # digested once), from the latest send, which decode counts its hold from
            waiting[:] = [(a, p) for a, p in waiting if (a, p.reader_rank) != reader]
            waiting.append((agent, msg))
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
        pending.deadline = max(pending.deadline, now + hold)
        claim = pending.claims.get(reader)
        if claim is None or claim.ended:
            claim = pending.claims[reader] = _Claim(numbers=set(), until=0.0)
        claim.numbers.add(msg.claim)
        claim.until = max(claim.until, pending.deadline)  # what the answer promises
        digests, why = self._digests_for(pending.spec, agent, msg) if msg.verify else ([], "")
        packed_at, packed_bytes, unpacked = -1, 0, ""
        if msg.packed and self._gather is not None:
            packed_at, packed_bytes, unpacked = self._gather.pack(pending.spec, agent, msg)
            if unpacked:
                logger.debug("claim on %s by %s: %s", msg.request_id, agent or "?", unpacked)
        return Prepared(
            request_id=msg.request_id,
            ok=True,
            held_s=pending.deadline - now,
            claim=msg.claim,
            digests=digests,
            reason=why,
            packed_at=packed_at,
            packed_bytes=packed_bytes,
        )

    def _digests_for(
        self, spec: SendSpec, agent: str, msg: Prepare
    ) -> tuple[list[GroupDigest], str]:
        """A verified claim: the digests of what it reads, as NIXL will read it (after
        this claim's rewrites, from the host mirror when staged); or none and why (the
        claim still stands: decode fails the load and says Done)."""
        if self._digests is None:
            return [], "this prefill gives no digests"
        try:
            digests = self._digests.for_claim(
                spec, agent, msg.plan_digest, msg.start_token, msg.end_token
            )
        except (KVBridgeError, RuntimeError) as exc:  # RuntimeError: torch (out of memory)
            logger.warning("no digests for %s to %s: %s", msg.request_id, agent or "?", exc)
            return [], f"no digests: {exc}"
        self._metrics.digests_sent += 1
        return digests, ""

    def _stage_out(self, pending: _Pending) -> None:
        """Host staging: the mirror gets the request's blocks as the device holds them."""
        if self._stage is None:
            return
        for group_id, ids in enumerate(pending.spec.block_ids):
            if ids:
                self._stage.to_host(group_id, np.asarray(ids, dtype=np.int64))

    def _rewrite_eagerly(self, pending: _Pending) -> None:
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

    def _extends(self, pending: _Pending, reader: Reader) -> bool:
        """``reader`` holds a claim that still runs: it may extend it while the hold is
        ending (its READs outlast half the hold); a reader without one may not start."""
        claim = pending.claims.get(reader)
        return claim is not None and not claim.ended and claim.until > self._clock()

    def on_done(self, msg: Done, agent: str = "") -> bool:
        """A reader is done: its claim ends (the claims ``msg`` names, and only the
        reader's own); the hold ends once ``readers`` readers said Done and no claim
        granted to another still runs. False: unknown or a repeat."""
        pending = self._pending.get(msg.request_id)
        if pending is None:
            if msg.request_id in self._ended or len(self._early) >= 4096:
                return False  # ended here already (a late Done), or too many waiting
            _, early = self._early.setdefault(
                msg.request_id, (self._clock() + EARLY_DONE_TTL_S, [])
            )
            early.append((agent, msg))
            return True
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
        if pending is None or (pending.ending and not (reader and self._extends(pending, reader))):
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
        return bool(pending.ending) and not (reader and self._extends(pending, reader))

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
        _, waiting = self._early_prepares.pop(request_id, (0.0, []))
        self._replies += [(agent, _unknown(request_id, p.claim)) for agent, p in waiting]
        self._early.pop(request_id, None)
        if pending is not None:
            self._end(pending, "aborted", report=report)

    def _end(self, pending: _Pending, why: str, *, report: bool = True) -> None:
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
        for rid, (expiry, _) in list(self._early.items()):
            if now > expiry:
                _, msgs = self._early.pop(rid)
                self._metrics.bad_notifications += len(msgs)
                logger.warning("Done for %s arrived but the request never did; dropped", rid)
        for rid, (expiry, waiting) in list(self._early_prepares.items()):
            if now > expiry:
                del self._early_prepares[rid]
                self._replies += [(agent, _unknown(rid, p.claim)) for agent, p in waiting]
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
