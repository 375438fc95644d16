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
        Bounds on every field (block ids, tokens, rounds below 2**31; holds and timeouts
        finite, 0..86,400 s; strings and lists capped): a message outside them is refused
        whole at decode time. PushStatus: decode asks about a round whose answer never
        came; an older prefill cannot decode it and drops it (its rounds then stay held on
        decode until it is found gone, as before).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal, TypeAlias

import msgspec

from kvbridge.layouts.arrangement import BlockArrangement, HeadOrder
from kvbridge.layouts.errors import KVBridgeError
from kvbridge.layouts.layout import KVLayout

NOTIF_PROTOCOL_VERSION = 2

# Bounds checked by the decoder, so that no value a peer sends reaches numpy or torch
# out of range (a block id of 2**63, a token range of 2**62, a NaN hold): such a
# message is refused as a whole (NotificationError) before anything acts on it. The
# checks against the plan (block ids inside the peer's pool, tokens inside the request)
# follow where the plan is known (kvbridge.connector.worker.rows).
MAX_INDEX = 2**31 - 1  # block ids, slots, tokens, rounds, counts of rows
MAX_BYTES = 2**53  # byte counts and offsets
MAX_SECONDS = 86_400.0  # holds, timeouts
MAX_GROUPS = 256
MAX_RANKS = 65_536
MAX_ID_CHARS = 1_024  # request and engine ids, hosts, plan digests
MAX_REASON_CHARS = 32_768

Index = Annotated[int, msgspec.Meta(ge=0, le=MAX_INDEX)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)]
ClaimNumber = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
GroupId = Annotated[int, msgspec.Meta(ge=0, lt=MAX_GROUPS)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_SECONDS)]  # NaN and inf refused too
Version = Annotated[int, msgspec.Meta(ge=0, le=2**16)]
Ident = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
# a request id is the engine's (vLLM may take it from a client's header): only the
# notification's own size limit bounds it
RequestId = Annotated[str, msgspec.Meta(min_length=1)]
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)]
# the values of kvbridge.layouts.layout.KVLayout and arrangement.HeadOrder (a test pins it)
LayoutName = Literal["NHD", "HND"]
HeadsName = Literal["inner", "layer", "chunk", "outer"]
Indices = Annotated[list[Index], msgspec.Meta(max_length=MAX_INDEX)]
BlockIds = Annotated[  # a block id, or -1: a placeholder (no block at that logical block)
    list[Annotated[int, msgspec.Meta(ge=-1, le=MAX_INDEX)]], msgspec.Meta(max_length=MAX_INDEX)
]
GroupIds = Annotated[list[GroupId], msgspec.Meta(max_length=MAX_GROUPS)]
ClaimNumbers = Annotated[list[ClaimNumber], msgspec.Meta(max_length=1_024)]


class NotificationError(KVBridgeError):
    """A notification that is not one of ours or cannot be decoded."""


class WireArrangement(msgspec.Struct, frozen=True, array_like=True):
    layout: LayoutName
    num_chunks: Annotated[int, msgspec.Meta(ge=1, le=MAX_INDEX)]
    sub_blocks_per_chunk: Annotated[int, msgspec.Meta(ge=1, le=MAX_INDEX)]
    parts_outer: bool
    heads: HeadsName = HeadOrder.INNER.value  # head-major wire chunks (tensor parallelism)

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
    group_id: GroupId
    src: WireArrangement
    dst: WireArrangement


class GroupDigest(msgspec.Struct, frozen=True, array_like=True):
    """The digest (``kvbridge.layouts.digest.fold``) of the ``num_rows`` rows of one group
    a reader moves, in the order the plan moves them, as the holder's memory has them."""

    group_id: GroupId
    digest: int  # any int64/uint64 (msgspec refuses wider ones)
    num_rows: Count


Digests = Annotated[list[GroupDigest], msgspec.Meta(max_length=MAX_GROUPS)]


class Prepare(msgspec.Struct, frozen=True, tag=True):
    """A claim on a kept request's blocks (and the rewrites the reader's plan wants)."""

    request_id: RequestId
    rewrites: Annotated[list[GroupRewrite], msgspec.Meta(max_length=MAX_GROUPS)]
    version: Version = NOTIF_PROTOCOL_VERSION
    hold_s: Seconds = 0.0  # keep the blocks at least this long from now (capped by prefill)
    # the claim's number on decode, echoed in the answer: which claim a Prepared answers
    # (a claim may be sent again); 0: unnumbered (a decode older than numbered claims)
    claim: ClaimNumber = 0
    # the decode rank claiming (with the sending NIXL agent: the reader the claim is for)
    reader_rank: Rank = 0
    # a verified load: answer with the digests of the rows it reads, tokens
    # [start_token, end_token) on the plan with this digest (decode's description came
    # with its handshake request)
    verify: bool = False
    plan_digest: Ident = ""
    start_token: Index = 0
    end_token: Index = 0
    # pipeline stages: groups the reader moves nothing of (another stage holds their
    # layers); prefill neither claims nor checks their blocks for this reader
    skipped_groups: GroupIds = msgspec.field(default_factory=list)
    # a packed read: copy the rows the reader reads (tokens [start_token, end_token) on
    # the plan plan_digest) into the gather arena and say where (Prepared.packed_at)
    packed: bool = False


class Prepared(msgspec.Struct, frozen=True, tag=True):
    request_id: RequestId
    ok: bool
    reason: Reason = ""
    # ok: the blocks stay this request's for at least this long from this answer, on the
    # holder's clock (an abort or lease end waits for it; only the readers' Done is sooner)
    held_s: Seconds = 0.0
    claim: ClaimNumber = 0  # Prepare.claim of the claim this answers (0: unnumbered)
    digests: Digests = msgspec.field(default_factory=list)  # Prepare.verify
    # Prepare.packed: the byte offset in the gather arena where the rows lie, packed, and
    # their bytes; -1: not packed (no room, or no arena), the reader reads the rows
    packed_at: Annotated[int, msgspec.Meta(ge=-1, le=MAX_BYTES)] = -1
    packed_bytes: Count = 0
    # ok: asked_key of the Prepare this answers, as prefill read it; decode compares it
    # with the claim it sent ("": an older prefill, not compared)
    asked: Ident = ""


class Done(msgspec.Struct, frozen=True, tag=True):
    request_id: RequestId
    ok: bool = True  # False: decode gave up (abort, failure); prefill frees all the same
    # decode ranks that each send this prefill rank a Done for the request (tensor
    # parallelism: every decode rank reading its heads); prefill frees after the last
    readers: Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)] = 1
    reader_rank: Rank = 0
    # the claims this Done ends: numbers of the reader's own Prepares (0: the claim a
    # prefill made for the reader's Push). Empty: the reader claimed nothing (it ends no
    # claim, another reader's least of all; it still counts as a reader done)
    claims: ClaimNumbers = msgspec.field(default_factory=list)


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    request_ids: Annotated[list[RequestId], msgspec.Meta(max_length=16_384)]


class StagedPages(msgspec.Struct, frozen=True, array_like=True):
    """Whole prefill pages of a staged group (``GroupPlan.split_from``) for decode's
    staging slots: logical block ``blocks[i]`` of the request goes to slot ``slots[i]``
    (slots of ``GroupPlan.staging_bytes`` in decode's advertised arena)."""

    group_id: GroupId
    blocks: Indices
    slots: Indices


StagedList = Annotated[list[StagedPages], msgspec.Meta(max_length=MAX_GROUPS)]


class Push(msgspec.Struct, frozen=True, tag=True):
    """Decode asks prefill to WRITE tokens ``[start_token, end_token)`` of a kept request
    into decode's blocks. Prefill looks decode up at ``reader_host:reader_port`` (its own
    handshake), plans as decode planned (``plan_digest`` must match), applies ``rewrites``
    as for a ``Prepare``, writes, then answers ``Pushed``. It must not start writing later
    than ``timeout_s`` after it got this: decode gives the blocks to others after that."""

    request_id: RequestId  # prefill's request id
    reader_engine_id: Ident
    reader_rank: Rank
    reader_host: Ident
    reader_port: Annotated[int, msgspec.Meta(ge=0, le=65_535)]
    # decode's block ids per group, by logical block (-1: a placeholder, no block there:
    # a sliding window's blocks before the window)
    block_ids: Annotated[list[BlockIds], msgspec.Meta(max_length=MAX_GROUPS)]
    start_token: Index
    end_token: Index
    rewrites: Annotated[list[GroupRewrite], msgspec.Meta(max_length=MAX_GROUPS)]
    plan_digest: Ident
    timeout_s: Seconds
    version: Version = NOTIF_PROTOCOL_VERSION
    # rounds through decode's staging slots: round 0 also writes every group decode does
    # not stage; a later round writes only ``staged``
    round: Index = 0
    staged: StagedList = msgspec.field(default_factory=list)
    verify: bool = False  # answer round 0 with the digests of the rows written
    skipped_groups: GroupIds = msgspec.field(default_factory=list)  # as Prepare's
    # a packed push (round 0 only): WRITE the rows, packed, as one range at this byte
    # offset of decode's gather arena (advertised in its description); -1: into the blocks
    packed_at: Annotated[int, msgspec.Meta(ge=-1, le=MAX_BYTES)] = -1
    packed_bytes: Count = 0


class Pushed(msgspec.Struct, frozen=True, tag=True):
    """Prefill's answer to ``Push``: the data is in decode's blocks (``ok``), or why not.
    Every Push round gets exactly one (written, refused, or cancelled by decode's
    ``Done``), sent only once every WRITE it posted ended: decode gives the round's
    blocks and slots back only then. A round of one WRITE carries it as that WRITE's
    completion notification (``kvbridge.connector.worker.prefill.answers``)."""

    request_id: RequestId
    ok: bool
    reason: Reason = ""
    num_bytes: Count = 0
    num_descs: Count = 0
    round: Index = 0  # the Push.round answered
    digests: Digests = msgspec.field(default_factory=list)  # Push.verify, ok
    # ok: the rows went packed into decode's gather arena (Push.packed_at), not its blocks
    packed: bool = False
    asked: Ident = ""  # ok: asked_key of the Push round as prefill read it (see Prepared)


class PushStatus(msgspec.Struct, frozen=True, tag=True):
    """Decode asks about a push round it holds blocks for and got no answer to (the answer
    was lost or unreadable, or the Push never arrived). Prefill answers from its own record:
    a round it no longer runs gets ``Pushed(ok=False)`` again (it forgets a round only once
    every WRITE of it ended); a round that runs is answered when it ends."""

    request_id: RequestId
    round: Index = 0


Notification: TypeAlias = Prepare | Prepared | Done | Heartbeat | Push | Pushed | PushStatus

_ENCODER = msgspec.msgpack.Encoder()


def asked_key(msg: Prepare | Push) -> str:
    """A short digest of what decides the bytes a claim or a push round moves (tokens,
    blocks, rewrites, groups, claim and round numbers). The answer carries the key of the
    message as its receiver read it, and the side that asked compares it with the key of
    the message it sent: an answer to a message that changed on the way (version skew, a
    bug) never counts as the answer to the one sent."""
    if isinstance(msg, Prepare):
        fields: tuple[object, ...] = (
            msg.request_id,
            msg.rewrites,
            sorted(msg.skipped_groups),
            msg.claim,
            msg.reader_rank,
        )
    else:
        fields = (
            msg.request_id,
            msg.rewrites,
            msg.block_ids,
            msg.start_token,
            msg.end_token,
            msg.round,
            msg.staged,
            sorted(msg.skipped_groups),
            msg.packed_at,
            msg.packed_bytes,
            msg.plan_digest,
            msg.reader_rank,
        )
    return hashlib.blake2b(_ENCODER.encode(fields), digest_size=8).hexdigest()


_DECODER = msgspec.msgpack.Decoder(Notification)
MAX_NOTIFICATION_BYTES = 64 * 1024
NOT_RUNNING = "does not run here"  # how a PushStatus about a round no longer run ends


def encode_notification(msg: Notification) -> bytes:
    if isinstance(msg, Prepared | Pushed) and len(msg.reason) > MAX_REASON_CHARS:
        # a refusal's reason (an exception's text) is cut, never the refusal itself
        cut = msg.reason[: MAX_REASON_CHARS - 16] + " ... (cut)"
        msg = msgspec.structs.replace(msg, reason=cut)
    data = _ENCODER.encode(msg)
    if len(data) > MAX_NOTIFICATION_BYTES:
        raise NotificationError(f"notification of {len(data)} bytes exceeds 64 KiB")
    return data


def decode_notification(data: bytes) -> Notification:
    if len(data) > MAX_NOTIFICATION_BYTES:
        raise NotificationError(f"notification of {len(data)} bytes exceeds 64 KiB")
    try:
        return _DECODER.decode(data)
    except Exception as exc:  # DecodeError, ValidationError, UnicodeDecodeError, ...
        raise NotificationError(
            f"undecodable notification ({len(data)} bytes): {type(exc).__name__}: {exc}"
        ) from None
