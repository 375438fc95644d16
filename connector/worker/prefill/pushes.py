"""Prefill side of push mode: write a kept request's KV into decode's blocks.

Decode sends ``Push`` (its block ids, the token range, the rewrites its plan wants). For
each one::

    WAITING --(request kept here, decode described)--> WRITING --(all DONE)--> Pushed(ok)
       |                                                   |
       `-- request ended / decode unreachable or           `-- TransferError / deadline /
           incompatible / plans differ / rewrite refused /     decode's Done(ok=False)
           deadline                                                |
                                        --> Pushed(ok=False)   ENDING: until NIXL reports
                                                               every WRITE ended
                                                                   `--> Pushed(ok=False)

Releasing a handle does not stop a WRITE already posted (NIXL's UCX backend cannot cancel
an RMA operation), so a push that fails or is cancelled while WRITEs run is answered only
once each of them ended: decode keeps the blocks and slots the round names out of its
engine's hands until that answer. Every Push round is answered exactly once; a round of
one WRITE by that WRITE's completion notification (``answers.carried_answer``). While a push
writes, the request's blocks are pinned in the :class:`Sender` (its hold does not end, its
rewrites are not undone, whatever ends the lease).

Prefill looks decode up with its own handshake (``PeerDirectory(writer=True)``), so it
plans exactly as decode did: the same pure ``negotiate`` on the same two descriptions,
checked by ``TransferPlan.digest``. The rows come from ``kvbridge.connector.worker.rows``,
the very function decode uses to READ; here they become WRITEs from this worker's blocks
(rewritten after save, as for a ``Prepare``) into decode's
(``kvbridge.connector.worker.prefill.push_writes``). The blocks stay kept until decode's
``Done``, which restores and frees them as in pull mode. A ``Done(ok=False)`` from decode
(it gave up) cancels the push: no WRITE starts any more, and the answer follows once the
ones posted ended.

Engine-packed pages decode must stage (``GroupPlan.split_from``) go whole into the slots of
decode's staging arena (advertised in its description, addressed by slot id), one ``Push``
per round of slots decode leased (``Push.staged``): round 0 also writes every other group,
a later round only its pages (``kvbridge.connector.worker.rows.staged_rows``). Each round is
answered with one ``Pushed`` naming it, also when decode's ``Done`` cancels it: decode lends those
slots to no other load before that answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import (
    NOTIF_PROTOCOL_VERSION,
    Prepare,
    Push,
    Pushed,
    asked_key,
)
from kvbridge.connector.transfer.errors import PeerDisconnectedError, TransferError
from kvbridge.connector.transfer.transport import (
    TransferEngine,
    XferHandle,
    XferState,
    release_if_ended,
)
from kvbridge.connector.worker.boundary import Boundary
from kvbridge.connector.worker.peers import Peer, PeerDirectory, PeerState
from kvbridge.connector.worker.prefill.answers import Answers
from kvbridge.connector.worker.prefill.gather_arena import GatherArena
from kvbridge.connector.worker.prefill.push_writes import PushRound, PushState, RoundWrites
from kvbridge.connector.worker.prefill.reader_digests import ReaderDigests
from kvbridge.connector.worker.prefill.sender import Sender

logger = logging.getLogger(__name__)

MAX_PUSHES = 4096  # pushes waiting or writing at once; more are refused by name
# how long the progress thread's round polls the WRITEs it posted before it ends: over
# TCP a WRITE completes a round trip (decode's acknowledgement) after its post
POSTED_WAIT_S = 0.0002


class Pusher:
    """The pushes a prefill worker owes its decode workers."""

    def __init__(
        self,
        engine: TransferEngine,
        targets: PeerDirectory,
        sender: Sender,
        metrics: ConnectorMetrics,
        reply: Callable[[str, Pushed], bool],
        *,
        clock: Callable[[], float] = time.monotonic,
        digests: ReaderDigests | None = None,
        gather: GatherArena | None = None,
        boundary: Boundary | None = None,
    ) -> None:
        """``digests``: answers a verified Push (``Push.verify``) with the digests of
        the rows it wrote (refused by name without it). ``gather``: packs a Push's rows
        into one WRITE when decode asks (``Push.packed_at``). ``boundary``: each round's
        step is its own failure boundary (whatever it raises fails that round alone)."""
        self._boundary = boundary or Boundary(metrics)
        self._gather = gather
        self._writes = RoundWrites(engine, targets, digests=digests, gather=gather)
        self._engine = engine
        self._targets = targets
        self._sender = sender
        self._metrics = metrics
        self._answers = Answers(targets, reply, gone=engine.peer_gone)
        self._clock = clock
        # (request id, decode's agent) -> push: two decodes may push the same params (a
        # retried or hedged request); each is its own reader, cancelled only by its own Done
        self._pushes: dict[tuple[str, str], PushRound] = {}
        self._posted: list[PushRound] = []  # started in this round: polled again at its end

    @property
    def num_inflight(self) -> int:
        return len(self._pushes)

    def runs(self, request_id: str, agent: str, round_: int) -> bool:
        """Round ``round_`` of decode ``agent``'s push of ``request_id`` is still owed an
        answer here (waiting, writing, or ending)."""
        push = self._pushes.get((request_id, agent))
        if push is not None and push.msg.round == round_:
            return True
        return self._answers.owes(request_id, agent, round_)  # forgotten, answer not out yet

    def fail_round(self, msg: Push, agent: str, reason: str) -> None:
        """Handling ``msg`` raised: its round fails (answered once any WRITE it posted
        ended), or is refused when it never started here."""
        push = self._pushes.get((msg.request_id, agent))
        if push is not None and push.msg is msg:
            if push.state is not PushState.ENDING:
                self._fail(push, reason)
            return
        self._refuse(agent, msg, reason)

    def on_push(self, msg: Push, agent: str) -> None:
        rid, where = msg.request_id, (msg.request_id, agent)
        if msg.version != NOTIF_PROTOCOL_VERSION:
            self._refuse(
                agent,
                msg,
                f"Push version {msg.version}, this prefill speaks {NOTIF_PROTOCOL_VERSION}",
            )
            return
        if where in self._pushes:
            self._refuse(agent, msg, f"a push of {rid!r} from this decode is in flight")
            return
        if self._sender.has_ended(rid, (agent, msg.reader_rank)) or len(self._pushes) >= MAX_PUSHES:
            self._refuse(
                agent,
                msg,
                f"unknown request {rid!r} on this prefill (never kept, "
                f"already done, or its lease expired)",
            )
            return
        if not msg.reader_host or not 0 < msg.reader_port < 65536 or msg.timeout_s <= 0:
            self._refuse(
                agent,
                msg,
                f"Push names no usable side channel "
                f"({msg.reader_host!r}:{msg.reader_port}) or timeout ({msg.timeout_s})",
            )
            return
        now = self._clock()
        key = (msg.reader_engine_id, msg.reader_rank)
        known = self._targets.get(key)
        if known is not None and known.agent and known.agent != agent:
            # decode restarted under the same engine id and rank: a new process (a new
            # NIXL agent, new registrations) asks; writing to the old one would fail
            logger.warning(
                "decode %s restarted (Push from agent %s, we knew %s): handshaking again",
                key,
                agent,
                known.agent,
            )
            self._targets.drop(key, f"restarted: Push from agent {agent}, we knew {known.agent}")
        self._targets.ensure(key, msg.reader_host, msg.reader_port, for_read=True)
        self._pushes[where] = PushRound(
            msg=msg,
            agent=agent,
            key=key,
            deadline=now + msg.timeout_s,
            wait_until=now + min(msg.timeout_s, self._sender.early_wait_s),
        )

    def cancel(self, request_id: str, agent: str) -> None:
        """Decode ``agent`` gave up on its push (``Done(ok=False)``): start no WRITE any
        more; the round is answered once the WRITEs posted ended (decode holds the blocks
        till then). Another decode's push of the same request goes on."""
        push = self._pushes.get((request_id, agent))
        if push is not None and push.state is not PushState.ENDING:
            self._fail(push, "cancelled: decode gave the load up")

    def step(self) -> None:
        """Start pushes whose request and decode are ready; finish the written ones."""
        self._targets.poll()
        now = self._clock()
        for where, push in list(self._pushes.items()):
            if self._pushes.get(where) is push:
                self._boundary.run(
                    "push round",
                    lambda p=push: self._advance(p, now),  # type: ignore[misc]
                    lambda reason, p=push: self._fail_unless_ending(p, reason),  # type: ignore[misc]
                )
        self._answers.flush()

    def _advance(self, push: PushRound, now: float) -> None:
        if push.state is PushState.WAITING:
            self._try_start(push, now)
        elif push.state is PushState.WRITING:
            self._poll(push, now)
        else:
            self._settle(push, now)

    def _fail_unless_ending(self, push: PushRound, reason: str) -> None:
        if self._pushes.get((push.msg.request_id, push.agent)) is push:
            if push.state is PushState.ENDING:
                push.reason = push.reason or reason  # answered once its WRITEs ended
            else:
                self._fail(push, reason)

    def poll_posted(self, wait_s: float = 0.0) -> None:
        """At the end of a progress round: poll the WRITEs this round posted once more,
        and answer the rounds they finished. The rest of the round gave UCX time to
        complete them (the PUT, the flush decode acknowledged); this poll lets UCX send
        the completion (a carried answer) and answers a finished round now rather than a
        round later. ``wait_s`` > 0 (the progress thread's rounds, never the engine's
        step): the ones still writing are polled again, the GIL let go between polls,
        for at most that long: over TCP a WRITE completes on decode's acknowledgement,
        a round trip after the post, and the next round would come only after the busy
        interval, the share cap and a wake-up of the thread (see ``docs/performance.md``,
        the handover's tax)."""
        if not self._posted:
            return
        posted, self._posted = self._posted, []
        until = time.perf_counter() + wait_s
        while posted := [p for p in posted if self._writing(p)]:
            now = self._clock()
            for push in posted:
                self._boundary.run(
                    "push round",
                    lambda p=push, t=now: self._poll(p, t),  # type: ignore[misc]
                    lambda reason, p=push: self._fail_unless_ending(p, reason),  # type: ignore[misc]
                )
            self._answers.flush()
            if time.perf_counter() >= until:
                return
            time.sleep(0)  # let the engine's thread have the GIL between polls

    def _writing(self, push: PushRound) -> bool:
        """``push`` is still this worker's round, its WRITEs still running."""
        current = self._pushes.get((push.msg.request_id, push.agent)) is push
        return current and push.state is PushState.WRITING

    def close(self) -> None:
        """Shutdown: answer the pushes none of whose WRITEs can still run; the others
        stay unanswered (their WRITEs may land until the engine is gone), and decode,
        which probes the prefills that owe it rounds, ends them once this process is."""
        for push in list(self._pushes.values()):
            push.handles[:] = [h for h in push.handles if not self._ended(h, push)]
            if push.handles:
                self._release(push)
                self._pushes.pop((push.msg.request_id, push.agent), None)
                continue
            if push.delivered:
                self._forget(push)
                continue
            self._answer(push, ok=False, reason=push.reason or "prefill connector shut down")

    # -- internals ----------------------------------------------------------------------

    def _try_start(self, push: PushRound, now: float) -> None:
        peer = self._targets.get(push.key)
        if peer is None or peer.state in (PeerState.FAILED, PeerState.INCOMPATIBLE):
            reason = peer.reason if peer is not None else "forgotten"
            self._fail(push, f"cannot push to decode {push.key}: {reason}")
            return
        reader = (push.agent, push.msg.reader_rank)
        spec = self._sender.kept(push.msg.request_id, reader)
        if spec is None and self._sender.has_ended(push.msg.request_id, reader):
            # freed by the engine before it reached this worker (abort), or its hold ended
            self._fail(push, f"request {push.msg.request_id!r} ended here before the push")
            return
        if now > push.deadline or (spec is None and now > push.wait_until):
            waited = "the request to be kept here" if spec is None else "decode's description"
            self._fail(push, f"timed out waiting for {waited}")
            return
        if spec is None or peer.state is not PeerState.READY:
            return
        if peer.agent != push.agent:
            # decode restarted under the same engine id and address since it asked: its
            # blocks (and gather arena) are another process's now, which never asked
            self._fail(
                push,
                f"decode {push.key} restarted since it asked (agent {push.agent}, now "
                f"{peer.agent}): nothing written",
            )
            return
        self._start(push, peer)

    def _start(self, push: PushRound, peer: Peer) -> None:
        msg = push.msg
        if peer.plan is None or peer.layout is None:
            self._fail(push, f"decode {push.key} reads none of this rank's heads")
            return
        if peer.plan.digest != msg.plan_digest:
            self._fail(
                push,
                f"prefill planned {peer.plan.digest}, decode {msg.plan_digest}: the two sides "
                f"see different descriptions (restarted or reconfigured?); plan here:\n"
                f"{peer.plan}",
            )
            return
        prepared = self._sender.on_prepare(
            # the push claims the blocks for its reader (claim 0: decode's Done names it)
            Prepare(
                request_id=msg.request_id,
                rewrites=msg.rewrites,
                reader_rank=msg.reader_rank,
                skipped_groups=msg.skipped_groups,
            ),
            push.agent,
        )
        if prepared is None or not prepared.ok:
            self._fail(push, prepared.reason if prepared else "request not kept here")
            return
        spec = self._sender.kept(msg.request_id, (push.agent, msg.reader_rank))
        assert spec is not None  # on_prepare just found it
        push.state = PushState.WRITING
        self._sender.pin(msg.request_id)
        push.pinned = True
        try:
            self._writes.post(push, peer, spec)
        except PeerDisconnectedError as exc:  # decode is gone: nothing it holds matters
            self._fail(push, f"write to decode {push.key} failed: {exc}")
            self._targets.drop(push.key, f"transfer failed: {exc}")
            return
        except Exception as exc:  # this round only (the WRITEs posted so far end first)
            self._fail(push, f"could not post the writes: {type(exc).__name__}: {exc}")
            return
        self._metrics.descriptors_posted += push.num_descs
        self._posted.append(push)

    def _poll(self, push: PushRound, now: float) -> None:
        try:
            pending = [h for h in push.handles if self._engine.poll(h) is XferState.PENDING]
        except PeerDisconnectedError as exc:
            self._fail(push, f"write to decode {push.key} failed: {exc}")
            self._targets.drop(push.key, f"transfer failed: {exc}")
            return
        except TransferError as exc:  # one WRITE failed: this push fails once all ended
            self._fail(push, f"write to decode {push.key} failed: {exc}")
            return
        if pending:
            if now > push.deadline:
                self._fail(push, f"writes not complete within {push.msg.timeout_s:.1f} s")
            return
        if len(push.handles) != push.num_planned:  # ok only on evidence: every WRITE ended
            self._fail(
                push, f"{len(push.handles)} of the round's {push.num_planned} WRITEs were posted"
            )
            return
        self._release(push)
        self._metrics.pushes_written += 1
        self._metrics.bytes_written += push.num_bytes
        if push.carrier is not None:  # its completion notification was the answer
            self._metrics.notifications_sent += 1
            self._forget(push)
            return
        self._answer(push, ok=True)

    def _fail(self, push: PushRound, reason: str) -> None:
        """The push fails: answered at once when no WRITE of it can still run, else once
        NIXL reported each ended (ENDING)."""
        self._metrics.push_failures += 1
        logger.warning(
            "push of %s (round %d) failed: %s", push.msg.request_id, push.msg.round, reason
        )
        push.state, push.reason = PushState.ENDING, reason
        self._settle(push, self._clock())

    def _settle(self, push: PushRound, now: float) -> None:
        """ENDING: drop the WRITEs that ended; answer once none is left."""
        push.handles[:] = [h for h in push.handles if not self._ended(h, push)]
        if not push.handles:
            if push.delivered:  # its WRITE completed after all: decode has its answer
                self._forget(push)
            else:
                self._answer(push, ok=False, reason=push.reason)
        elif not push.overdue and now > push.deadline + push.msg.timeout_s:
            push.overdue = True
            self._metrics.held_overdue += 1
            logger.warning(
                "push of %s (round %d) failed (%s) and %d WRITE(s) to %s still run: decode "
                "keeps those blocks until NIXL reports them ended (a frozen or unreachable "
                "decode)",
                push.msg.request_id,
                push.msg.round,
                push.reason,
                len(push.handles),
                push.key,
            )

    def _ended(self, handle: XferHandle, push: PushRound | None = None) -> bool:
        """A WRITE that cannot touch decode's blocks any more. ``push``'s carrier that
        completed (not failed) delivered the round's answer. One NIXL failed, or released
        (a post that failed midway: ``PostFailedError``), may still run: NIXL reports a
        handle failed once one of its UCX requests did, and ``release`` does not stop an
        issued PUT (``nixlUcxBackendReqH::status`` / ``release``,
        src/plugins/ucx/ucx_backend.cpp); it counts as running until its decode is
        confirmed gone (``peer_gone``) or is no longer known here at all.

        That last case (decode forgotten: it restarted under a new agent, ``on_push``)
        counts as ended because the hold here must not wait for a peer never polled
        again. For prefill it is safe: a WRITE never writes our memory, so giving our
        blocks or gather pages back costs only the bytes it carries. For the old decode
        it is not settled: the round is then answered failed to the old agent, and a
        ``PushStatus`` from it too (``runs``); an old decode still alive (two processes
        with one engine id, or a Push naming a wrong ``reader_rank``) would give its
        blocks back while the WRITE may land in them."""
        if push is not None and handle is push.carrier and not handle.released:
            try:
                if self._engine.poll(handle) is XferState.PENDING:
                    return False
                push.delivered = True
            except TransferError:  # failed: the answer is ours to send, once it ended
                self._engine.release(handle)
                return self._released_ended(handle)
            self._engine.release(handle)
            return True
        if handle.released:
            return self._released_ended(handle)
        return release_if_ended(self._engine, handle)

    def _released_ended(self, handle: XferHandle) -> bool:
        """A released WRITE (see :meth:`_ended`) ended: its decode is confirmed gone, or
        forgotten here."""
        return self._engine.peer_gone(handle.peer) or self._targets.with_agent(handle.peer) is None

    def _forget(self, push: PushRound) -> None:
        """The round is over here (no WRITE of it runs any more): unpin the blocks."""
        self._pushes.pop((push.msg.request_id, push.agent), None)
        if push.pages is not None and self._gather is not None:
            self._gather.give_back_pages(push.pages)
            push.pages = None
        if push.pinned:
            push.pinned = False
            self._sender.unpin(push.msg.request_id)

    def _answer(self, push: PushRound, *, ok: bool, reason: str = "") -> None:
        """The one answer of a round (no WRITE of it runs any more); unpins the blocks."""
        self._forget(push)
        answer = Pushed(
            request_id=push.msg.request_id,
            ok=ok,
            reason=reason,
            num_bytes=push.num_bytes if ok else 0,
            num_descs=push.num_descs if ok else 0,
            round=push.msg.round,
            digests=push.digests if ok else [],
            packed=ok and push.packed,
            asked=asked_key(push.msg) if ok else "",
        )
        self._answers.send(push.msg, push.agent, answer)

    def _refuse(self, agent: str, msg: Push, reason: str) -> None:
        self._metrics.push_failures += 1
        logger.warning("push of %s (round %d) refused: %s", msg.request_id, msg.round, reason)
        answer = Pushed(request_id=msg.request_id, ok=False, reason=reason, round=msg.round)
        self._answers.send(msg, agent, answer)

    def _release(self, push: PushRound) -> None:
        for h in push.handles:
            self._engine.release(h)
        push.handles.clear()
