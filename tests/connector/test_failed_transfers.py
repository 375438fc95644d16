"""A failed READ or WRITE is not an ended one: NixlTransferEngine against real NIXL, with
the failures NIXL's UCX backend can report injected at the agent.

NIXL reports a handle failed once one of its UCX requests failed, whatever the others do,
and says nothing more of it afterwards; a post can fail after it issued part of the
transfer (``release_if_ended`` and ``PostFailedError`` cite the NIXL source). So a failed
handle counts as running until its peer is confirmed gone, and a failed post hands its
handle back to be held. Two agents in one process; the READs are real, only NIXL's answer
about them is replaced.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import nixl._bindings as nixl_bindings
import numpy as np
import pytest
import torch

from kvbridge.connector.transfer.errors import PeerDisconnectedError
from kvbridge.connector.transfer.nixl_engine import NixlEngineConfig, NixlTransferEngine
from kvbridge.connector.transfer.transport import (
    PostFailedError,
    XferHandle,
    XferState,
    release_if_ended,
)

NUM_BLOCKS = 16
BLOCK_BYTES = 1024
TIMEOUT_S = 10.0


class FaultyAgent:
    """A NIXL agent whose answers the test replaces; everything else goes to the agent.

    ``post_answer``: ``transfer`` posts for real (NIXL issues the operations) and then
    answers this status, or raises this exception; ``refuse_post`` raises without posting.
    ``state_answer``: ``check_xfer_state`` answers this status or raises this exception.
    ``notif_error``: ``send_notif`` raises it."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.post_answer: str | Exception | None = None
        self.refuse_post: Exception | None = None
        self.state_answer: str | Exception | None = None
        self.notif_error: Exception | None = None
        self.last_status = ""  # what NIXL itself answered the last post

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def transfer(self, handle: object, notif_msg: bytes = b"") -> str:
        if self.refuse_post is not None:
            raise self.refuse_post
        self.last_status = self.inner.transfer(handle, notif_msg)  # type: ignore[attr-defined]
        return _answer(self.post_answer, self.last_status)

    def check_xfer_state(self, handle: object) -> str:
        if self.state_answer is not None:
            return _answer(self.state_answer, "")
        return self.inner.check_xfer_state(handle)  # type: ignore[attr-defined]

    def send_notif(self, peer: str, msg: bytes) -> None:
        if self.notif_error is not None:
            raise self.notif_error
        self.inner.send_notif(peer, msg)  # type: ignore[attr-defined]


def _answer(answer: str | Exception | None, status: str) -> str:
    if isinstance(answer, Exception):
        raise answer
    return status if answer is None else answer


class Pair:
    """decode reads prefill's blocks; decode's agent answers what the test says."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:8]
        self.src = torch.arange(NUM_BLOCKS * BLOCK_BYTES, dtype=torch.int64).to(torch.uint8)
        self.src = self.src.reshape(NUM_BLOCKS, BLOCK_BYTES).contiguous()
        self.dst = torch.zeros_like(self.src)
        self.prefill = NixlTransferEngine(NixlEngineConfig(agent_name=f"prefill-{tag}"))
        self.decode = NixlTransferEngine(NixlEngineConfig(agent_name=f"decode-{tag}"))
        self.prefill.register([self.src])
        self.decode.register([self.dst])
        self.peer = self.decode.add_peer(self.prefill.metadata())
        self.local = self.decode.prep_local(_descs(self.dst))
        self.remote = self.decode.prep_remote(self.peer, _descs(self.src))
        self.agent = FaultyAgent(self.decode._agent)
        self.decode._agent = self.agent  # type: ignore[assignment]
        self.wait(self.read(np.arange(1)))  # connected: later READs complete as posted
        self.dst.zero_()

    def wait(self, handle: XferHandle) -> None:
        """Poll ``handle`` to DONE, driving prefill (in one process the first transfer
        needs the target's progress for the wire-up); then release it."""
        deadline = time.monotonic() + TIMEOUT_S
        while self.decode.poll(handle) is XferState.PENDING:
            self.prefill.get_notifs()
            assert time.monotonic() < deadline, f"{handle!r} not done in {TIMEOUT_S} s"
        handle.release()

    def read(self, blocks: np.ndarray) -> XferHandle:
        return self.decode.read(self.local, blocks, self.remote, blocks)

    def confirm_gone(self) -> None:
        """NIXL reports the peer disconnected (here: a notification to it raises)."""
        self.agent.notif_error = nixl_bindings.nixlRemoteDisconnectError(
            "NIXL_ERR_REMOTE_DISCONNECT"
        )
        with pytest.raises(PeerDisconnectedError):
            self.decode.send_notif(self.peer, b"probe")
        assert self.decode.peer_gone(self.peer)

    def close(self) -> None:
        self.agent.notif_error = None
        self.decode.close()
        self.prefill.close()


def _descs(t: torch.Tensor) -> np.ndarray:
    descs = np.zeros((NUM_BLOCKS, 3), dtype=np.int64)
    descs[:, 0] = t.data_ptr() + np.arange(NUM_BLOCKS) * BLOCK_BYTES
    descs[:, 1] = BLOCK_BYTES
    return descs


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    try:
        yield p
    finally:
        p.close()


def test_a_handle_whose_poll_failed_runs_until_its_peer_is_gone(pair: Pair) -> None:
    """NIXL's UCX backend may report a handle failed while other requests of it are in
    flight, and repeats that error from then on: the handle is released, but what it
    names stays held (False) until NIXL reports the peer disconnected."""
    pair.agent.post_answer = "PROC"  # posted, in flight as far as kvbridge knows
    handle = pair.read(np.arange(4))
    pair.agent.state_answer = nixl_bindings.nixlNotFoundError("NIXL_ERR_NOT_FOUND")

    assert release_if_ended(pair.decode, handle) is False
    assert handle.released and pair.decode.num_live_handles == 0
    assert release_if_ended(pair.decode, handle) is False  # still: nothing more was said

    pair.confirm_gone()
    assert release_if_ended(pair.decode, handle) is True


def test_a_disconnect_reported_by_a_poll_ends_the_handle_at_once(pair: Pair) -> None:
    pair.agent.post_answer = "PROC"  # posted, in flight as far as kvbridge knows
    handle = pair.read(np.arange(4))
    pair.agent.state_answer = nixl_bindings.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")
    assert release_if_ended(pair.decode, handle) is True
    assert handle.released and pair.decode.peer_gone(pair.peer)


def test_a_pending_handle_is_not_ended_and_a_done_one_is(pair: Pair) -> None:
    pair.agent.post_answer = "PROC"  # posted, in flight as far as kvbridge knows
    handle = pair.read(np.arange(4))
    pair.agent.state_answer = "PROC"
    assert release_if_ended(pair.decode, handle) is False
    assert not handle.released
    pair.agent.state_answer = "DONE"
    assert release_if_ended(pair.decode, handle) is True and handle.released


def test_a_post_nixl_failed_after_issuing_it_raises_with_its_handle(pair: Pair) -> None:
    """NIXL issued the READ's operations, then failed the post (a later descriptor, the
    flush or the notification): the error carries the handle, released, which counts as
    running until the peer is confirmed gone. The READ did write our memory."""
    pair.agent.post_answer = nixl_bindings.nixlBackendError("NIXL_ERR_BACKEND")
    blocks = np.arange(2, 6)
    with pytest.raises(PostFailedError) as failed:
        pair.read(blocks)
    handle = failed.value.handle
    assert handle.released and pair.decode.num_live_handles == 0
    assert (handle.peer, handle.num_rows) == (pair.peer, blocks.size)
    assert "NIXL_ERR_BACKEND" in str(failed.value)
    assert pair.decode.num_rows_posted == 1  # the warm-up's; the failed post is not counted
    if pair.agent.last_status == "DONE":  # as on this transport, once connected
        assert torch.equal(pair.dst[blocks], pair.src[blocks])  # NIXL moved its bytes
    assert release_if_ended(pair.decode, handle) is False

    pair.confirm_gone()
    assert release_if_ended(pair.decode, handle) is True


def test_a_post_refused_with_a_disconnect_needs_no_handle(pair: Pair) -> None:
    pair.agent.refuse_post = nixl_bindings.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")
    with pytest.raises(PeerDisconnectedError) as failed:
        pair.read(np.arange(4))
    assert not isinstance(failed.value, PostFailedError)
    assert pair.decode.peer_gone(pair.peer) and pair.decode.num_live_handles == 0
