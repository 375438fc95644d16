"""A transport that is late on purpose: what a slow network does to a connector.

``LateTransport`` sits behind the transfer-engine protocol in front of a real NIXL engine.
Its READs and WRITEs are not posted when asked: they wait until the test calls ``land``.
Releasing such a handle does not stop it (as with UCX, where a GET or PUT already issued
completes when the network delivers it): it still lands at the next ``land``, after the
release. Tearing the peer down (``remove_peer``) does not stop it either (measured with
NIXL: tests/connector/test_worker_multiprocess.py); only the peer's death does
(``disconnect``: what is queued for it never lands, and the transport reports it gone, as
NIXL does with ``nixlRemoteDisconnectError``). Everything else goes to the real engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvbridge.connector.transfer.errors import PeerDisconnectedError, TransferError
from kvbridge.connector.transfer.transport import (
    DescList,
    TransferEngine,
    XferHandle,
    XferOp,
    XferState,
)


@dataclass
class Late:
    handle: XferHandle
    local: DescList
    local_idx: np.ndarray
    remote: DescList
    remote_idx: np.ndarray
    notif: bytes
    landed: bool = False
    dead: bool = False  # its peer died first: it never lands


class LateTransport:
    """Wraps ``inner``; queues every READ/WRITE until ``land()``."""

    def __init__(self, inner: TransferEngine) -> None:
        self.inner = inner
        self.queued: list[Late] = []
        self.num_landed_after_release = 0
        self.num_torn_down = 0  # queued transfers that died with their peer
        self.dead: set[str] = set()  # peers disconnect() killed

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def _queue(self, op: XferOp, local, local_idx, remote, remote_idx, notif) -> XferHandle:
        handle = XferHandle(
            object(),
            self,
            op=op,
            peer=remote.peer,
            num_descs=int(np.asarray(local_idx).size),
            num_bytes=int(local.lens[np.asarray(local_idx)].sum()),
            notif=notif,
        )
        self.queued.append(
            Late(handle, local, np.asarray(local_idx), remote, np.asarray(remote_idx), notif)
        )
        return handle

    def read(self, local, local_idx, remote, remote_idx, notif: bytes = b"") -> XferHandle:
        return self._queue(XferOp.READ, local, local_idx, remote, remote_idx, notif)

    def write(self, local, local_idx, remote, remote_idx, notif: bytes = b"") -> XferHandle:
        return self._queue(XferOp.WRITE, local, local_idx, remote, remote_idx, notif)

    def _late(self, handle: XferHandle) -> Late | None:
        return next((q for q in self.queued if q.handle is handle), None)

    def poll(self, handle: XferHandle) -> XferState:
        if handle.released:
            raise TransferError(f"poll on released {handle!r}")
        if handle.peer in self.dead:
            raise PeerDisconnectedError(f"poll {handle!r}: peer {handle.peer!r} disconnected")
        late = self._late(handle)
        if late is None:
            return self.inner.poll(handle)
        return XferState.DONE if late.landed else XferState.PENDING

    def release(self, handle: XferHandle) -> None:
        if self._late(handle) is None:
            self.inner.release(handle)
            return
        handle._native = None  # released; still queued: it lands anyway

    @property
    def num_in_flight(self) -> int:
        """Queued transfers that have not landed (released ones included)."""
        return sum(not (q.landed or q.dead) for q in self.queued)

    def land(self, pump: Callable[[], object] = lambda: None, timeout_s: float = 10.0) -> int:
        """Deliver every queued transfer (released ones too) through the real engine;
        ``pump`` gives the peer its progress (a step of its engine) while one runs."""
        n = 0
        for q in self.queued:
            if q.landed or q.dead:
                continue
            post = self.inner.read if q.handle.op is XferOp.READ else self.inner.write
            # NIXL sends a completion notification from the post or a poll of a live
            # handle: one released before its data completed never notifies
            notif = b"" if q.handle.released else q.notif
            real = post(q.local, q.local_idx, q.remote, q.remote_idx, notif)
            deadline = time.monotonic() + timeout_s
            while self.inner.poll(real) is XferState.PENDING:
                if time.monotonic() > deadline:
                    raise AssertionError(f"late {q.handle!r} did not land in {timeout_s} s")
                pump()
            self.inner.release(real)
            q.landed = True
            self.num_landed_after_release += q.handle.released
            n += 1
        self.queued = [q for q in self.queued if not (q.landed or q.dead) or not q.handle.released]
        return n

    def remove_peer(self, peer: str) -> None:
        """Forget the peer: its handles are released, and what is queued for it still
        lands at the next ``land`` (removing is not stopping)."""
        for q in self.queued:
            if q.handle.peer == peer:
                q.handle._native = None
        self.inner.remove_peer(peer)

    def disconnect(self, peer: str) -> None:
        """The peer died: what is queued for it never lands; polls and notifications to
        it raise ``PeerDisconnectedError`` and ``peer_gone`` says so."""
        self.dead.add(peer)
        for q in self.queued:
            if q.handle.peer == peer and not (q.landed or q.dead):
                q.dead = True
                self.num_torn_down += 1

    def peer_gone(self, peer: str) -> bool:
        return peer in self.dead or self.inner.peer_gone(peer)

    def send_notif(self, peer: str, msg: bytes) -> None:
        if peer in self.dead:
            raise PeerDisconnectedError(f"send_notif to {peer!r}: disconnected")
        self.inner.send_notif(peer, msg)
