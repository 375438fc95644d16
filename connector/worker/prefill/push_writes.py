"""One Push round on prefill: its state, and the WRITEs that carry it into decode.

A round WRITEs what decode's ``Push`` asks (``RoundWrites.post``): round 0 every group
decode does not stage, straight into its blocks, by the rows ``kvbridge.connector.worker.rows``
computes exactly as decode would READ them; every round the staged pages it names into
decode's staging slots. A round of one WRITE carries its answer as that WRITE's completion
notification (``answers.carried_answer``). When decode names a landing
(``Push.packed_at``, ``extra.gather_mib``), the rows are first copied into a run of the
gather arena's pages and go as one WRITE into that landing (the pages are lent to the
WRITE until NIXL says it ended). Raises :class:`KVBridgeError` for a Push that does not fit
the plan (that push fails, never the peer).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbridge.connector.common.metadata import SendSpec
from kvbridge.connector.common.notifications import GroupDigest, Push
from kvbridge.connector.transfer.transport import PostFailedError, TransferEngine, XferHandle
from kvbridge.connector.worker.digests import PlanSide
from kvbridge.connector.worker.packed_rows import packed_rows
from kvbridge.connector.worker.peers import Peer, PeerDirectory, PeerKey
from kvbridge.connector.worker.plan_lists import GATHER_LIST
from kvbridge.connector.worker.prefill.answers import carried_answer
from kvbridge.connector.worker.prefill.gather_arena import PAGE_BYTES, GatherArena
from kvbridge.connector.worker.prefill.reader_digests import ReaderDigests
from kvbridge.connector.worker.rows import GroupRows, group_rows, staged_rows
from kvbridge.handshake.plan_model import GroupPlan
from kvbridge.layouts.errors import KVBridgeError

logger = logging.getLogger(__name__)


class PushState(enum.Enum):
    WAITING = "waiting"  # for the request to be kept here and for decode's description
    WRITING = "writing"
    ENDING = "ending"  # failed or cancelled: answered once every WRITE posted ended


@dataclass
class PushRound:
    """One Push round this prefill owes a decode, from its ``Push`` to its answer."""

    msg: Push
    agent: str  # decode's NIXL agent: where Pushed goes
    key: PeerKey
    deadline: float  # no write starts after this; writes still running then are cancelled
    wait_until: float  # the request must be kept here by then
    state: PushState = PushState.WAITING
    handles: list[XferHandle] = field(default_factory=list)
    num_bytes: int = 0
    num_descs: int = 0
    # the WRITEs the round's plan requires, counted before the first is posted: the round
    # is answered ok only when exactly these many were posted and all ended
    num_planned: int = -1
    pinned: bool = False  # the request's blocks are pinned in the Sender
    reason: str = ""  # ENDING: why it failed
    overdue: bool = False  # ENDING longer than its timeout: logged once
    digests: list[GroupDigest] = field(default_factory=list)  # Push.verify: what it wrote
    # the round's only WRITE, whose completion notification is the answer (answers.py)
    carrier: XferHandle | None = None
    delivered: bool = False  # the carrier completed: decode has the answer
    # a packed push: the gather arena's pages its one WRITE reads (lent until it ended)
    pages: np.ndarray | None = None
    packed: bool = False  # the rows went packed (Pushed.packed)


class RoundWrites:
    """Posts the WRITEs of Push rounds from this worker's blocks (and gather arena)."""

    def __init__(
        self,
        engine: TransferEngine,
        targets: PeerDirectory,
        *,
        digests: ReaderDigests | None = None,
        gather: GatherArena | None = None,
    ) -> None:
        """``digests``: a verified Push (``Push.verify``) gets the digests of the rows it
        wrote (refused by name without it). ``gather``: packs a round's rows when decode
        asks (``Push.packed_at``)."""
        self._engine = engine
        self._targets = targets
        self._digests = digests
        self._gather = gather

    def post(self, push: PushRound, peer: Peer, spec: SendSpec) -> None:
        """WRITE what the Push asks: round 0 every group decode does not stage, straight
        into its blocks; every round the staged pages it names into decode's slots."""
        msg, plan, layout = push.msg, peer.plan, peer.layout
        assert plan is not None and layout is not None
        if len(msg.block_ids) != len(plan.groups):
            raise KVBridgeError(
                f"Push names {len(msg.block_ids)} groups, the plan has {len(plan.groups)}"
            )
        pages = {p.group_id: p for p in msg.staged}
        if len(pages) != len(msg.staged) or not pages.keys() <= {g.group_id for g in plan.groups}:
            raise KVBridgeError(
                f"Push names staging pages of groups {[p.group_id for p in msg.staged]}; the "
                f"plan has groups 0..{len(plan.groups) - 1}, each at most once a round"
            )
        if msg.verify and msg.round == 0:
            if self._digests is None:
                raise KVBridgeError("this prefill gives no digests of what it writes")
            # the rows it is about to write, as they are (pinned and rewritten)
            try:
                push.digests = self._digests.for_plan(
                    plan, layout, spec, msg.start_token, msg.end_token
                )
            except RuntimeError as exc:  # torch (out of memory): this push only
                raise KVBridgeError(f"could not digest the rows: {exc}") from None
        writes: list[tuple[GroupPlan, Sequence[tuple[int, np.ndarray, np.ndarray]]]] = []
        found_by_group: dict[int, GroupRows] = {}
        for g in plan.groups:
            first = spec.first_block[g.group_id] if spec.first_block else 0
            mine = np.asarray(spec.block_ids[g.group_id], dtype=np.int64)
            staged = pages.get(g.group_id)
            if g.split_from:
                if staged is not None:
                    assert layout.staging is not None  # negotiation refuses a push without
                    num_slots = layout.staging.block_bytes // g.staging_bytes
                    rows = staged_rows(g, staged.blocks, staged.slots, mine, first, num_slots)
                    writes.append((g, rows))
            elif staged is not None:
                raise KVBridgeError(f"group {g.group_id} is not staged, yet the Push names slots")
            elif msg.round == 0:  # decode's blocks of unstaged groups: with round 0 only
                found = group_rows(
                    g,
                    layout.config.groups[g.group_id].spec,
                    np.asarray(msg.block_ids[g.group_id], dtype=np.int64),
                    mine,
                    first,
                    msg.start_token,
                    msg.end_token,
                )
                writes.append((g, found.rows))
                found_by_group[g.group_id] = found
        if msg.packed_at >= 0 and self._packed(push, peer, found_by_group):
            return
        push.num_planned = sum(len(rows) for _, rows in writes)
        notif = b""
        # only a round that is the whole load: decode asks a staged load's next round
        # once it has an answer, and this round's poll may not have seen its WRITE done
        streams = [(g, row) for g, rows in writes for row in rows]
        if len(streams) == 1 and peer.agent == push.agent and not msg.staged:
            g, (i, reader_rows, _) = streams[0]
            notif = carried_answer(
                msg,
                num_bytes=int(reader_rows.size) * g.streams[i].length,
                num_rows=int(reader_rows.size),
                digests=push.digests,
            )
        for g, rows in writes:
            self._write(push, peer, g, rows, notif)

    def _packed(self, push: PushRound, peer: Peer, found: dict[int, GroupRows]) -> bool:
        """Decode asked for the rows packed: copy them into a run of our gather arena's
        pages and WRITE that run into decode's (one descriptor; the round's only WRITE
        carries its answer). False: not packed (no arena, a staged group, no room); the
        rows go into decode's blocks as they are. Raises :class:`KVBridgeError` for a
        request that does not fit what we computed."""
        msg, plan = push.msg, peer.plan
        theirs = peer.remote_lists.get(GATHER_LIST)
        if self._gather is None or theirs is None or plan is None or msg.staged:
            return False
        packed = packed_rows(plan, PlanSide.WRITER, lambda g: found.get(g.group_id, GroupRows()))
        if packed is None:
            return False
        first, rest = divmod(msg.packed_at, PAGE_BYTES)
        pages_asked = -(-msg.packed_bytes // PAGE_BYTES)
        if packed.num_bytes != msg.packed_bytes or rest or first + pages_asked > theirs.num_descs:
            raise KVBridgeError(
                f"decode asked for {msg.packed_bytes} B packed at {msg.packed_at} of its "
                f"{theirs.num_descs} pages; its rows here are {packed.num_bytes} B"
            )
        pages, why = self._gather.fill(packed)
        if not pages.size:
            logger.debug("push of %s not packed: %s", msg.request_id, why)
            return False
        push.pages, push.packed = pages, True
        notif = b""
        if peer.agent == push.agent:
            notif = carried_answer(
                msg,
                num_bytes=packed.num_bytes,
                num_rows=packed.num_rows,
                digests=push.digests,
                packed=True,
            )
        remote_idx = np.arange(first, first + pages.size)
        push.num_planned = 1
        try:
            handle = self._engine.write(self._gather.local_list(), pages, theirs, remote_idx, notif)
        except PostFailedError as exc:  # part of it may run: the round ends after it
            push.handles.append(exc.handle)
            raise
        push.handles.append(handle)
        if notif:
            push.carrier = handle
        push.num_descs += handle.num_descs
        push.num_bytes += packed.num_bytes
        return True

    def _write(
        self,
        push: PushRound,
        peer: Peer,
        g: GroupPlan,
        rows: Sequence[tuple[int, np.ndarray, np.ndarray]],
        notif: bytes = b"",
    ) -> None:
        """``notif``: the round's answer, carried by its only WRITE."""
        for i, reader_rows, writer_rows in rows:
            stream = g.streams[i]
            mine = self._targets.local_list(g, stream)
            theirs = peer.remote_lists[(g.group_id, i)]
            try:
                handle = self._engine.write(mine, writer_rows, theirs, reader_rows, notif)
            except PostFailedError as exc:  # part of it may run: the round ends after it
                push.handles.append(exc.handle)
                raise
            push.handles.append(handle)
            if notif:
                push.carrier = handle
            push.num_descs += handle.num_descs  # a merged run counts once
            push.num_bytes += int(reader_rows.size) * stream.length
