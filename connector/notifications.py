"""Small typed messages that travel as NIXL notifications between paired workers.

::

    decode                                  prefill
      Prepare(req, rewrites)   ------>      rewrite blocks after save (sender transform)
                               <------      Prepared(req, ok, reason)
      NIXL READ ...
      Done(req, ok, readers)   ------>      restore blocks, free them after the last reader
      Heartbeat([req, ...])    ------>      extend leases of requests still queued

    push mode (handshake.modes): decode names its blocks, prefill writes into them
      Push(req, blocks, rewrites) ------>   rewrite after save, NIXL WRITE into decode
                               <------      Pushed(req, ok, reason, bytes)
      Done(req, ok, readers)   ------>      restore blocks, free them after the last reader

Encoded with msgspec (MessagePack), tagged, one decoder built once. Keep them small
(NIXL notifications are meant for <= 64 KiB).
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec

from layouts.arrangement import BlockArrangement, HeadOrder
from layouts.errors import KVBridgeError
from layouts.layout import KVLayout

NOTIF_PROTOCOL_VERSION = 1


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


class Prepare(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    rewrites: list[GroupRewrite]
    version: int = NOTIF_PROTOCOL_VERSION


class Prepared(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    ok: bool
    reason: str = ""


class Done(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    ok: bool = True  # False: decode gave up (abort, failure); prefill frees all the same
    # decode ranks that each send this prefill rank a Done for the request (tensor
    # parallelism: every decode rank reading its heads); prefill frees after the last
    readers: int = 1
    reader_rank: int = 0


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    request_ids: list[str]


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


class Pushed(msgspec.Struct, frozen=True, tag=True):
    """Prefill's answer to ``Push``: the data is in decode's blocks (``ok``), or why not."""

    request_id: str
    ok: bool
    reason: str = ""
    num_bytes: int = 0
    num_descs: int = 0


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
