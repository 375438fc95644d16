"""Decode side of push mode: ask prefill to write a load, round by round.

::

    round 0  Push(our block ids, rewrites, staged=[first pages -> slots we leased])
             prefill WRITEs every group we do not stage into our blocks, and the named
             pages into our staging slots          <-- Pushed(round 0, bytes)
             the engine splits the staged pages into our blocks; the slots go back
    round k  Push(round k, staged=[next pages -> free slots])  <-- Pushed(round k) ...
             no slot free: the source waits (STAGING) for another load to give some back

Without staged groups (``GroupPlan.split_from``) a load is round 0 alone. Prefill answers
every round that names slots exactly once: written, refused, or cancelled by our
``Done(ok=False)``. A load that ends before that answer (abort, failure, deadline) leaves
the round's slots *held*: lent to no other load until the answer comes, or until prefill
can no longer be writing (it starts no write later than the round's ``timeout_s`` after it
got the Push, cancels what still runs then, and we wait ``PUSH_MARGIN_S`` more).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvbridge.connector.common.notifications import (
    GroupRewrite,
    NotificationError,
    Push,
    Pushed,
    StagedPages,
    encode_notification,
)
from kvbridge.connector.worker.decode.load_records import Load, LoadState, PushEndpoint, Source
from kvbridge.connector.worker.peers import Peer
from kvbridge.connector.worker.staging.staged_reads import StageBatch, StagedReads
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.errors import KVBridgeError

logger = logging.getLogger(__name__)

PUSH_MARGIN_S = 1.0  # decode keeps a push's blocks and slots this long after prefill's last start
MAX_PAGES_PER_ROUND = 1024  # keeps a round's Push far below the 64 KiB notification limit


@dataclass
class _Held:
    batch: StageBatch
    until: float  # prefill surely wrote nothing more into the slots after this


class PushRounds:
    """The Push rounds of one decode worker, and the slots of rounds left unanswered."""

    def __init__(
        self,
        staged: StagedReads,
        buffers: KVCacheBuffers,
        endpoint: PushEndpoint,
        send: Callable[[Peer, object], bool],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._staged = staged
        self._buffers = buffers
        self._endpoint = endpoint
        self._send = send
        self._clock = clock
        self._held: dict[tuple[str, str, int], _Held] = {}  # (agent, request, round)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def ask(self, load: Load, src: Source, peer: Peer, rewrites: list[GroupRewrite]) -> None:
        """Send round 0. Raises :class:`KVBridgeError` naming why prefill could not be
        asked (the load fails)."""
        assert peer.plan is not None
        try:
            for g in peer.plan.groups:  # the blocks that will receive data (and checks)
                found = load.rows(g, self._buffers.config.groups[g.group_id].spec)
                if found.staged is not None:
                    src.staged.append(found.staged)
                elif found.touched is not None:
                    load.touch(g.group_id, found.touched)
        except KVBridgeError as exc:
            raise KVBridgeError(f"could not plan the push: {exc}") from None
        spec = load.spec
        src.push = Push(
            request_id=spec.params.remote_request_id,
            reader_engine_id=self._endpoint.engine_id,
            reader_rank=self._endpoint.rank,
            reader_host=self._endpoint.host,
            reader_port=self._endpoint.port,
            block_ids=[list(ids) for ids in spec.local_block_ids],
            start_token=spec.start_token,
            end_token=spec.end_token,
            rewrites=rewrites,
            plan_digest=peer.plan.digest,
            timeout_s=1.0,  # each round sets its own
        )
        try:
            encode_notification(src.push)  # too many blocks for one notification: this load
        except NotificationError as exc:
            raise KVBridgeError(f"cannot ask {peer.key} to push: {exc}") from None
        src.round = 0
        self.next_round(load, src, peer)

    def next_round(self, load: Load, src: Source, peer: Peer | None) -> None:
        """Ask round ``src.round`` with as many staged pages as slots are free; a later
        round with none free waits (STAGING) and is asked again by the receiver's step."""
        assert src.push is not None
        if peer is None:
            raise KVBridgeError(f"peer {src.key} went away between two push rounds")
        batch = self._staged.lease_round(src.staged, MAX_PAGES_PER_ROUND) if src.staged else None
        if batch is None and src.round > 0:
            src.state = LoadState.STAGING
            return
        now = self._clock()
        # prefill starts no write after this; we keep the blocks PUSH_MARGIN_S longer
        timeout = max(load.deadline - now - PUSH_MARGIN_S, 0.001)
        pages = []
        if batch is not None:
            pages = [
                StagedPages(
                    group_id=batch.staged.group.group_id,
                    blocks=batch.remote_blocks.tolist(),
                    slots=batch.slots.tolist(),
                )
            ]
        msg = msgspec.structs.replace(src.push, round=src.round, staged=pages, timeout_s=timeout)
        if not self._send(peer, msg):
            if batch is not None:
                self._staged.cancel(batch)  # never asked for: the slots are free
            raise KVBridgeError(f"prefill {peer.key} unreachable for Push")
        src.batch, src.state = batch, LoadState.PUSHED
        src.round_agent, src.round_expires = peer.agent, now + timeout + PUSH_MARGIN_S

    def answered(self, load: Load, src: Source, msg: Pushed, peer: Peer | None) -> None:
        """Prefill answered the round in flight: split its pages, then ask the next round
        or mark the source DONE. Raises :class:`KVBridgeError` when the load fails."""
        batch, src.batch = src.batch, None
        if not msg.ok:
            if batch is not None:
                self._staged.cancel(batch)  # prefill released its writes before answering
            raise KVBridgeError(f"prefill {src.key} could not push the blocks: {msg.reason}")
        load.num_bytes += msg.num_bytes
        if batch is not None:
            self._staged.split(batch)
        src.round += 1
        if src.staged:
            self.next_round(load, src, peer)
        else:
            src.state = LoadState.DONE

    def hold(self, load: Load, src: Source) -> None:
        """The load ends while a round that names slots is unanswered: keep those slots
        until prefill answers it or cannot be writing any more."""
        if src.batch is None:
            return
        key = (src.round_agent, load.spec.params.remote_request_id, src.round)
        self._held[key] = _Held(batch=src.batch, until=src.round_expires)
        src.batch = None

    def late(self, msg: Pushed, agent: str) -> bool:
        """A Pushed for a round whose load ended: its slots go back. False: not one."""
        held = self._held.pop((agent, msg.request_id, msg.round), None)
        if held is None:
            return False
        self._staged.cancel(held.batch)
        return True

    def expire(self) -> None:
        """Give back the held slots of rounds prefill can no longer be writing."""
        now = self._clock()
        for key, held in list(self._held.items()):
            if now > held.until:
                del self._held[key]
                self._staged.cancel(held.batch)
                logger.warning(
                    "push round %d of %s never answered by %s; its staging slots are free again",
                    key[2],
                    key[1],
                    key[0],
                )

    def close(self) -> None:
        for held in self._held.values():
            self._staged.cancel(held.batch)
        self._held.clear()
