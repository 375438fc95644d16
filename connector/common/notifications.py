"""Small typed messages that travel as NIXL notifications between paired workers.

::

    decode                                  prefill
      Prepare(req, rewrites, hold_s) -->    claim: keep the blocks >= hold_s from now;
                                            rewrite them after save (sender transform)
                               <------      Prepared(req, ok, reason, held_s)
      NIXL READ ... (posted with the claim when no rewrite is due; it counts only if it
                     ended within held_s of the claim being sent)
      Done(req, ok, readers)   ------>      restore blocks, free them after the last reader
      Heartbeat([req, ...])    ------>      extend leases of requests still queued

    push mode (kvbridge.handshake.modes): decode names its blocks, prefill writes into them
      Push(req, blocks, rewrites) ------>   rewrite after save, NIXL WRITE into decode
                               <------      Pushed(req, ok, reason, bytes)
      Done(req, ok, readers)   ------>      restore blocks, free them after the last reader

    push mode through decode's staging slots (prefill's engine-packed pages larger than
    decode's blocks, or not dividing them), one Push per round of free slots
      Push(round 0, staged=[pages -> slots]) -->  WRITE unstaged groups into decode's
                                                  blocks, the named pages into its slots
                               <------      Pushed(round 0)    decode splits, frees slots
      Push(round 1, staged=[...]) ------>   WRITE only the named pages
                               <------      Pushed(round 1) ... until no page is left
      Done(req, ok=False)      ------>      a round still unanswered is cancelled and,
                                            once its WRITEs ended,
                               <------      answered Pushed(ok=False): its blocks and
                                            slots are free

Every Push round is answered exactly once, and only after NIXL reported each WRITE it
posted ended: decode gives the blocks a round names back to its engine only then.

Durations, never wall clocks: ``hold_s`` and ``held_s`` are measured by the side that
holds the blocks, from the moment it answers. Decode counts ``held_s`` from when it sent
the claim (earlier than the answer), so it never assumes a hold longer than the holder's.

Encoded with msgspec (MessagePack), tagged, one decoder built once. Keep them small
(NIXL notifications are meant for <= 64 KiB).

Schema evolution: a new field goes last with a default (old decoders ignore it, new ones
fill in the default); anything else is a new ``NOTIF_PROTOCOL_VERSION``.

Protocol history:
    1 - Prepare, Prepared, Done, Heartbeat; Push and Pushed (push mode);
        Push.round and Push.staged, Pushed.round (defaults 0 / []): pushes through
        decode's staging slots. An older prefill never sees them: it refuses to push
        pages decode stages at the handshake (its plan refuses the pair).
        Prepare.claim and Prepared.claim (default 0): numbered claims, so that a claim
        can be sent again and each answer still counts from its own claim's send time.
        A prefill that echoes them says so in its description
        (``WorkerDescription.numbered_claims``); decode sends a claim again only to such
        a prefill.
    2 - Readers in the protocol. Prepare.reader_rank: a claim belongs to its reader, the
        (decode agent, rank) that sent it; Done.claims: the claim numbers the Done ends
        (0: the claim prefill made for a Push it served). A hold ends only when every
        granted claim has its own Done or ran out: one reader's Done no longer ends what
        another was granted. A version-1 decode's Done names no claim, so the two
        refuse each other (``Prepare.version`` here, ``PROTOCOL_VERSION`` 3 at the
        handshake).
        Verified loads (``extra.verify``): Prepare.verify with the load's token range and
        plan digest, Push.verify; Prepared.digests and Pushed.digests: one
        ``GroupDigest`` per group of the rows the reader moves (``kvbridge.layouts.digest``).
        Packed reads (``extra.gather_mib``): Prepare.packed asks prefill to copy the rows
        the reader reads into its gather arena, in the plan's order
        (``kvbridge.connector.worker.packed_rows``); Prepared.packed_at / packed_bytes say
        where (-1: not packed, read the rows as they are). An older prefill ignores the
        question and answers -1. Push.packed_at / packed_bytes: write the rows, packed, into
        decode's gather arena there; Pushed.packed says they went there (an older prefill
        writes them into the blocks and says nothing: not packed).
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec

from kvbridge.layouts.arrangement import BlockArrangement, HeadOrder
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.layout import KVLayout

NOTIF_PROTOCOL_VERSION = 2


class NotificationError(KVBridgeError):
    """A notification that is not one of ours or cannot be decoded."""


class WireArrangement(msgspec.Struct, frozen=True, array_like=True):
    layout: str
    num_chunks: int
    sub_blocks_per_chunk: int
    parts_outer: bool
    heads: str = HeadOrder.INNER.value  # head-major wire chunks (tensor parallelism)

    @classmethod
    def of(cls, arr: BlockArrangement) -> WireArrangement:
        return cls(
            arr.layout.value,
            arr.num_chunks,
            arr.sub_blocks_per_chunk,
            arr.parts_outer,
            arr.heads.value,
        )

    def to_arrangement(self) -> BlockArrangement:
        return BlockArrangement(
            layout=KVLayout.parse(self.layout),
            num_chunks=self.num_chunks,
            sub_blocks_per_chunk=self.sub_blocks_per_chunk,
            parts_outer=self.parts_outer,
            heads=HeadOrder.parse(self.heads),
        )


class GroupRewrite(msgspec.Struct, frozen=True, array_like=True):
    group_id: int
    src: WireArrangement
    dst: WireArrangement


class GroupDigest(msgspec.Struct, frozen=True, array_like=True):
    """The digest (``kvbridge.layouts.digest.fold``) of the ``num_rows`` rows of one group
    a reader moves, in the order the plan moves them, as the holder's memory has them."""

    group_id: int
    digest: int
    num_rows: int


class Prepare(msgspec.Struct, frozen=True, tag=True):
    """A claim on a kept request's blocks (and the rewrites the reader's plan wants)."""

    request_id: str
    rewrites: list[GroupRewrite]
    version: int = NOTIF_PROTOCOL_VERSION
    hold_s: float = 0.0  # keep the blocks at least this long from now (capped by prefill)
    # the claim's number on decode, echoed in the answer: which claim a Prepared answers
    # (a claim may be sent again); 0: unnumbered (a decode older than numbered claims)
    claim: int = 0
    # the decode rank claiming (with the sending NIXL agent: the reader the claim is for)
    reader_rank: int = 0
    # a verified load: answer with the digests of the rows it reads, tokens
    # [start_token, end_token) on the plan with this digest (decode's description came
    # with its handshake request)
    verify: bool = False
    plan_digest: str = ""
    start_token: int = 0
    end_token: int = 0
    # pipeline stages: groups the reader moves nothing of (another stage holds their
    # layers); prefill neither claims nor checks their blocks for this reader
    skipped_groups: list[int] = msgspec.field(default_factory=list)
    # a packed read: copy the rows the reader reads (tokens [start_token, end_token) on
    # the plan plan_digest) into the gather arena and say where (Prepared.packed_at)
    packed: bool = False


class Prepared(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    ok: bool
    reason: str = ""
    # ok: the blocks stay this request's for at least this long from this answer, on the
    # holder's clock (an abort or lease end waits for it; only the readers' Done is sooner)
    held_s: float = 0.0
    claim: int = 0  # Prepare.claim of the claim this answers (0: unnumbered)
    digests: list[GroupDigest] = msgspec.field(default_factory=list)  # Prepare.verify
    # Prepare.packed: the byte offset in the gather arena where the rows lie, packed, and
    # their bytes; -1: not packed (no room, or no arena), the reader reads the rows
    packed_at: int = -1
    packed_bytes: int = 0


class Done(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    ok: bool = True  # False: decode gave up (abort, failure); prefill frees all the same
    # decode ranks that each send this prefill rank a Done for the request (tensor
    # parallelism: every decode rank reading its heads); prefill frees after the last
    readers: int = 1
    reader_rank: int = 0
    # the claims this Done ends: numbers of the reader's own Prepares (0: the claim a
    # prefill made for the reader's Push). Empty: the reader claimed nothing (it ends no
    # claim, another reader's least of all; it still counts as a reader done)
    claims: list[int] = msgspec.field(default_factory=list)


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    request_ids: list[str]


class StagedPages(msgspec.Struct, frozen=True, array_like=True):
    """Whole prefill pages of a staged group (``GroupPlan.split_from``) for decode's
    staging slots: logical block ``blocks[i]`` of the request goes to slot ``slots[i]``
    (slots of ``GroupPlan.staging_bytes`` in decode's advertised arena)."""

    group_id: int
    blocks: list[int]
    slots: list[int]


class Push(msgspec.Struct, frozen=True, tag=True):
    """Decode asks prefill to WRITE tokens ``[start_token, end_token)`` of a kept request
    into decode's blocks. Prefill looks decode up at ``reader_host:reader_port`` (its own
    handshake), plans as decode planned (``plan_digest`` must match), applies ``rewrites``
    as for a ``Prepare``, writes, then answers ``Pushed``. It must not start writing later
    than ``timeout_s`` after it got this: decode gives the blocks to others after that."""

    request_id: str  # prefill's request id
    reader_engine_id: str
    reader_rank: int
    reader_host: str
    reader_port: int
    block_ids: list[list[int]]  # decode's block ids per group, by logical block
    start_token: int
    end_token: int
    rewrites: list[GroupRewrite]
    plan_digest: str
    timeout_s: float
    version: int = NOTIF_PROTOCOL_VERSION
    # rounds through decode's staging slots: round 0 also writes every group decode does
    # not stage; a later round writes only ``staged``
    round: int = 0
    staged: list[StagedPages] = msgspec.field(default_factory=list)
    verify: bool = False  # answer round 0 with the digests of the rows written
    skipped_groups: list[int] = msgspec.field(default_factory=list)  # as Prepare's
    # a packed push (round 0 only): WRITE the rows, packed, as one range at this byte
    # offset of decode's gather arena (advertised in its description); -1: into the blocks
    packed_at: int = -1
    packed_bytes: int = 0


class Pushed(msgspec.Struct, frozen=True, tag=True):
    """Prefill's answer to ``Push``: the data is in decode's blocks (``ok``), or why not.
    Every Push round gets exactly one (written, refused, or cancelled by decode's
    ``Done``), sent only once every WRITE it posted ended: decode gives the round's
    blocks and slots back only then. A round of one WRITE carries it as that WRITE's
    completion notification (``kvbridge.connector.worker.prefill.answers``)."""

    request_id: str
    ok: bool
    reason: str = ""
    num_bytes: int = 0
    num_descs: int = 0
    round: int = 0  # the Push.round answered
    digests: list[GroupDigest] = msgspec.field(default_factory=list)  # Push.verify, ok
    # ok: the rows went packed into decode's gather arena (Push.packed_at), not its blocks
    packed: bool = False


Notification: TypeAlias = Prepare | Prepared | Done | Heartbeat | Push | Pushed

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Notification)
MAX_NOTIFICATION_BYTES = 64 * 1024


def encode_notification(msg: Notification) -> bytes:
    data = _ENCODER.encode(msg)
    if len(data) > MAX_NOTIFICATION_BYTES:
        raise NotificationError(f"notification of {len(data)} bytes exceeds 64 KiB")
    return data


def decode_notification(data: bytes) -> Notification:
    if len(data) > MAX_NOTIFICATION_BYTES:
        raise NotificationError(f"notification of {len(data)} bytes exceeds 64 KiB")
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise NotificationError(f"undecodable notification ({len(data)} bytes): {exc}") from None
