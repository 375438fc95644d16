"""The handshake's wire messages: typed msgspec Structs, encoded as MessagePack.

One request, two replies::

    decode worker                          prefill worker (HandshakeListener)
        MetadataRequest   ------------->
                          <-------------   WorkerDescription | ErrorReply

Top-level messages are tagged (``"type": "<ClassName>"``) so one typed decoder tells them
apart; nested structs are untagged.

Schema evolution: a new field goes *last* in its Struct and has a default. Old decoders
ignore fields they do not know, new decoders fill in the default for fields an old peer did
not send. Anything else (removing, renaming, reordering or retyping a field, a new required
field) is a new ``PROTOCOL_VERSION``.

Protocol history:
    1 - MetadataRequest, WorkerDescription (groups, regions, NIXL metadata), ErrorReply;
        MetadataRequest.requester_agent_name / requester_nixl_metadata (defaults: empty);
        WireSpec.kv_interleaved (default false; vLLM 0.32's K|V content axis);
        WorkerDescription.rewrites_in_place (default true), block_packing (default "");
        WorkerDescription.transfer_mode (default "pull": an older peer only pulls),
        can_repack (default false) and rewrites_on_save (default false);
        WorkerDescription.staging (default none): the registered staging arena a pushing
        prefill writes whole pages into (engine-packed pages larger than decode's);
        WireSpec.state_sharding (default empty: not described): how each state tensor is
        split over TP ranks, so that state groups move between different TP sizes;
        WorkerDescription.kv_heads (default "inner"): where the KV heads sit in a block
        (CacheFormat.heads; "chunk" is vLLM's head-outer cross-layer BHLNC, "outer" its
        LHBNC, which an older peer refuses by name when it parses the description);
        WireRegion.head (default -1): the head a region holds ("outer" caches).
    3 - readers in the protocol (notifications version 2); MetadataRequest.requester_
        description (default none): the requester's description, its NIXL metadata left
        out, so that a prefill can digest what a verifying decode reads;
        WorkerDescription.gather (default none): the registered arena a prefill packs a
        claim's rows into (``extra.gather_mib``), one page per block of the region.
        WorkerDescription.kv_role (default "": not described): the worker's
        ``kv_role`` (``kv_producer``, ``kv_consumer`` or ``kv_both``), so that a plan or
        probe refuses a pair that is not prefill -> decode.
        WorkerDescription.architecture and model_fingerprint (default ""): what
        identifies the model instead of model_name, a path (compared where both are set).
        WorkerDescription.digest_version (default 1): the digest verified loads compare
        (position-weighted rows from 2); peers that differ refuse to verify, by name.
        WorkerDescription.push_status (default False): the worker answers a PushStatus
        notification (a push round whose answer decode never got); decode asks only such
        a prefill, and probes an older one with an empty Heartbeat as before.
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec

from kvbridge.handshake.errors import (
    ErrorCode,
    ProtocolError,
    UnknownRequestError,
    UnsupportedVersionError,
)

# 2: workers that claim what they read (Prepare.hold_s / Prepared.held_s) and answer
#    every Push round once its WRITEs ended; a version-1 peer would answer claims with no
#    hold (every load failing after its READ), so the two refuse each other by name here
# 3: readers in the protocol (notifications version 2): a claim belongs to its reader and a
#    Done ends only the claims it names; a version-2 decode's Done names none, and its
#    prefill would end a hold another reader was granted, so the two refuse each other
PROTOCOL_VERSION = 3


class MetadataRequest(msgspec.Struct, frozen=True, tag=True, tag_field="type"):
    """Ask a worker to describe itself. ``requester_engine_id``/``rank`` serve the peer's
    logs; ``requester_agent_name``/``nixl_metadata`` let it send notifications back."""

    protocol_version: int
    requester_engine_id: str = ""
    requester_rank: int = 0
    # The requester's NIXL agent, so the described worker can notify it back (Prepared).
    requester_agent_name: str = ""
    requester_nixl_metadata: bytes = b""
    # The requester's own description (its NIXL metadata left out: it is the field above),
    # so the described worker can plan as the requester does: a prefill then digests
    # exactly the rows a verifying decode reads (``Prepare.verify``). None: not sent.
    requester_description: WorkerDescription | None = None


class WireStateSharding(msgspec.Struct, frozen=True):
    """How one state tensor is split over TP ranks (``kvbridge.layouts.specs.StateSharding``):
    ``dim`` -1 for a tensor replicated on every rank."""

    dim: int
    sections: list[int] = msgspec.field(default_factory=list)


class WireSpec(msgspec.Struct, frozen=True):
    """A KV-cache spec on the wire (``kind`` is a ``kvbridge.layouts.specs.KVCacheKind`` value)."""

    kind: str
    block_size: int
    num_kv_heads: int = 0
    head_size: int = 0
    dtype: str = ""
    sliding_window: int = 0
    state_shapes: list[list[int]] = msgspec.field(default_factory=list)
    state_dtypes: list[str] = msgspec.field(default_factory=list)
    page_size_bytes: int = 0
    kv_interleaved: bool = False  # K|V side by side per (head, token): one part
    # per state tensor, how the engine shards it over TP ranks; empty: not described
    state_sharding: list[WireStateSharding] = msgspec.field(default_factory=list)


class WireGroup(msgspec.Struct, frozen=True):
    """One KV-cache group: the layers that share a block table, and their spec."""

    group_id: int
    layer_names: list[str]
    spec: WireSpec


class WireRegion(msgspec.Struct, frozen=True):
    """A registered memory region and where it belongs.

    ``group_id`` / ``layer_index`` / ``kv_part`` / ``head`` are -1 where they do not
    apply: a canonical cross-layer buffer holds every layer (``layer_index=-1``), a packed
    block holds K and V together (``kv_part=-1``), a block holds every head (``head=-1``;
    a heads-outer cache, vLLM's LHBNC, has one region per layer and head).
    """

    name: str
    base_addr: int
    block_bytes: int
    block_stride_bytes: int
    num_blocks: int
    memory_kind: str
    device_id: int = 0
    group_id: int = -1
    layer_index: int = -1
    kv_part: int = -1
    head: int = -1


class WorkerDescription(msgspec.Struct, frozen=True, tag=True, tag_field="type"):
    """A worker's self-description: model shape, cache layout, regions, NIXL metadata.

    ``kv_layout`` is ``"NHD"`` or ``"HND"``; ``kv_packing`` is ``"kv_split"`` or
    ``"blocks_first"``. They travel as strings and are checked by negotiation, so that an
    unknown value becomes an ``IncompatiblePeerError`` naming it, not a decode failure.
    """

    protocol_version: int
    engine_id: str
    agent_name: str
    rank: int
    tp_size: int
    model_name: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    compat_hash: str
    block_size: int
    kernel_block_size: int
    kv_layout: str
    kv_packing: str
    cross_layer: bool
    groups: list[WireGroup]
    regions: list[WireRegion]
    nixl_metadata: bytes
    side_channel_host: str = ""
    side_channel_port: int = 0
    # false: this worker's blocks may be read by its own running requests while a reader
    # holds them (an engine's prefix cache), so it never rewrites them after save
    rewrites_in_place: bool = True
    # non-empty: the engine's private element order inside a page (CacheFormat.block_packing)
    block_packing: str = ""
    packed_heads_major: bool = False  # CacheFormat.packed_heads_major
    transfer_mode: str = "pull"  # kvbridge.handshake.modes.TransferMode: both sides must agree
    # the engine rebuilds its packed pages from remote ones after a load (a push writer
    # must plan exactly as this reader does)
    can_repack: bool = False
    # the sender rewrites kept blocks into its last reader's format when they are saved:
    # a reader that needs no rewrite must claim them (an empty Prepare) before reading
    rewrites_on_save: bool = False
    # push mode, engine-packed pages: the registered staging arena (one block of its whole
    # size) whose slots a prefill with larger pages writes into
    # (kvbridge.connector.worker.staging.arenas)
    staging: WireRegion | None = None
    # pipeline parallel: this worker's stage; its groups list only that stage's layers
    pp_rank: int = 0
    pp_size: int = 1
    # what the model is, beside the shapes above (kvbridge.handshake.compat): its class
    # (vLLM's architecture, e.g. "LlamaForCausalLM") and the weights' fingerprint
    # (extra.model_fingerprint, else the served model name); "" : not known, not compared.
    # model_name (the --model path) only names the model in logs.
    architecture: str = ""
    model_fingerprint: str = ""

    @property
    def engine_rank(self) -> int:
        """The worker among all of its engine's (``WorkerIdentity.engine_rank``)."""
        return self.pp_rank * self.tp_size + self.rank

    kv_heads: str = "inner"  # CacheFormat.heads (kvbridge.layouts.arrangement.HeadOrder)
    # this worker echoes Prepare.claim in its Prepared (connector.common.notifications)
    numbered_claims: bool = False
    # pull mode: the registered arena this prefill packs a claim's rows into when the
    # reader asks (Prepare.packed), in pages of block_bytes
    # (kvbridge.connector.worker.prefill.gather_arena); none: it packs nothing
    gather: WireRegion | None = None
    # the worker's kv_role (KVRole value: "kv_producer", "kv_consumer" or "kv_both");
    # empty: an older peer that did not say
    kv_role: str = ""
    # what extra.verify's digests mean (kvbridge.layouts.digest.DIGEST_VERSION); 1: an
    # older peer, whose rows were plain sums. Peers that differ refuse verified loads
    digest_version: int = 1
    push_status: bool = False  # answers PushStatus (kvbridge.connector.common.notifications)


class ErrorReply(msgspec.Struct, frozen=True, tag=True, tag_field="type"):
    """A listener's refusal: a machine-readable code and a sentence for humans."""

    code: ErrorCode
    reason: str


# A union as soon as a second request exists; the tag keeps them apart on the wire.
Request: TypeAlias = MetadataRequest
Reply: TypeAlias = WorkerDescription | ErrorReply


class _Envelope(msgspec.Struct):
    """What every top-level message shares: peeked first to pick the right error."""

    type: str = ""
    protocol_version: int = PROTOCOL_VERSION


_REQUEST_TYPES = ("MetadataRequest",)
_REPLY_TYPES = ("WorkerDescription", "ErrorReply")

_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE_DECODER = msgspec.msgpack.Decoder(_Envelope)
_REQUEST_DECODER = msgspec.msgpack.Decoder(Request)
_REPLY_DECODER = msgspec.msgpack.Decoder(Reply)


def encode(msg: Request | Reply) -> bytes:
    """MessagePack bytes of a request or reply (tag included)."""
    return _ENCODER.encode(msg)


def _peek(data: bytes, what: str, known: tuple[str, ...]) -> _Envelope:
    try:
        envelope = _ENVELOPE_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {what} ({len(data)} bytes): {exc}") from None
    if not envelope.type:
        raise ProtocolError(f"malformed {what} ({len(data)} bytes): no 'type' tag")
    if envelope.type not in known:
        raise UnknownRequestError(
            f"unknown {what} type {envelope.type!r}; expected one of {list(known)}"
        )
    # An ErrorReply is version-less on purpose: it is how a peer says "wrong version".
    if envelope.type != "ErrorReply" and envelope.protocol_version != PROTOCOL_VERSION:
        raise UnsupportedVersionError(
            f"{envelope.type} speaks protocol version {envelope.protocol_version}, "
            f"this process speaks {PROTOCOL_VERSION}; upgrade one side"
        )
    return envelope


def decode_request(data: bytes) -> Request:
    """Decode a request; raises :class:`ProtocolError` (or a subclass) naming the problem."""
    _peek(data, "request", _REQUEST_TYPES)
    try:
        return _REQUEST_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed request ({len(data)} bytes): {exc}") from None


def decode_reply(data: bytes) -> Reply:
    """Decode a reply; raises :class:`ProtocolError` (or a subclass) naming the problem."""
    _peek(data, "reply", _REPLY_TYPES)
    try:
        return _REPLY_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed reply ({len(data)} bytes): {exc}") from None
