"""Notification messages (connector/common/notifications.py): push rounds through decode's staging
slots on the wire, and peers from before them."""

from __future__ import annotations

import msgspec

from kvbridge.connector.common.notifications import (
    MAX_NOTIFICATION_BYTES,
    Push,
    Pushed,
    StagedPages,
    decode_notification,
    encode_notification,
)
from kvbridge.connector.worker.decode.transfers import MAX_PAGES_PER_ROUND


def _push(**fields: object) -> Push:
    base = Push(
        request_id="p1",
        reader_engine_id="decode",
        reader_rank=3,
        reader_host="127.0.0.1",
        reader_port=5600,
        block_ids=[list(range(64))],
        start_token=0,
        end_token=2047,
        rewrites=[],
        plan_digest="0123456789abcdef",
        timeout_s=29.0,
    )
    return msgspec.structs.replace(base, **fields) if fields else base


def test_a_push_round_and_its_answer_round_trip():
    msg = _push(round=2, staged=[StagedPages(group_id=0, blocks=[4, 5], slots=[1, 0])])
    assert decode_notification(encode_notification(msg)) == msg
    answer = Pushed(request_id="p1", ok=False, reason="cancelled", round=2)
    assert decode_notification(encode_notification(answer)) == answer


def test_messages_from_a_peer_before_push_rounds_decode_as_round_0():
    """Such a peer never stages: its Push and Pushed mean round 0, no slots."""
    old_push = msgspec.to_builtins(_push())
    del old_push["round"], old_push["staged"]
    got = decode_notification(msgspec.msgpack.encode(old_push))
    assert isinstance(got, Push) and (got.round, got.staged) == (0, [])
    old_pushed = {"type": "Pushed", "request_id": "p1", "ok": True, "num_bytes": 7}
    got = decode_notification(msgspec.msgpack.encode(old_pushed))
    assert isinstance(got, Pushed) and got.round == 0 and got.num_bytes == 7


def test_the_largest_round_fits_one_notification():
    """A round names at most MAX_PAGES_PER_ROUND pages, with large ids, next to the
    block ids of a long request."""
    pages = StagedPages(
        group_id=0,
        blocks=list(range(10**6, 10**6 + MAX_PAGES_PER_ROUND)),
        slots=list(range(10**6, 10**6 + MAX_PAGES_PER_ROUND)),
    )
    msg = _push(block_ids=[list(range(10**6, 10**6 + 2048))], staged=[pages])
    assert len(encode_notification(msg)) < MAX_NOTIFICATION_BYTES
