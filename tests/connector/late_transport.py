"""A transport that is late on purpose: what a slow network does to a connector.

``LateTransport`` sits behind the transfer-engine protocol in front of a real NIXL engine.
Its READs and WRITEs are not posted when asked: they wait until the test calls ``land``.
Releasing such a handle does not stop it (as with UCX, where a GET or PUT already issued
completes when the network delivers it): it still lands at the next ``land``, after the
release. Only tearing the peer down (``remove_peer``: its endpoint closed) ends what is
queued for it without landing. Everything else goes to the real engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvbridge.connector.transfer.errors import TransferError
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


class LateTransport:
    """Wraps ``inner``; queues every READ/WRITE until ``land()``."""

    def __init__(self, inner: TransferEngine) -> None:
        self.inner = inner
        self.queued: list[Late] = []
        self.num_landed_after_release = 0
        self.num_torn_down = 0

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
        return sum(not q.landed for q in self.queued)

    def land(self, pump: Callable[[], object] = lambda: None, timeout_s: float = 10.0) -> int:
        """Deliver every queued transfer (released ones too) through the real engine;
        ``pump`` gives the peer its progress (a step of its engine) while one runs."""
        n = 0
        for q in self.queued:
            if q.landed:
                continue
            post = self.inner.read if q.handle.op is XferOp.READ else self.inner.write
            real = post(q.local, q.local_idx, q.remote, q.remote_idx, q.notif)
            deadline = time.monotonic() + timeout_s
            while self.inner.poll(real) is XferState.PENDING:
                if time.monotonic() > deadline:
                    raise AssertionError(f"late {q.handle!r} did not land in {timeout_s} s")
                pump()
            self.inner.release(real)
            q.landed = True
            self.num_landed_after_release += q.handle.released
            n += 1
        self.queued = [q for q in self.queued if not (q.landed and q.handle.released)]
        return n

    def remove_peer(self, peer: str) -> None:
        """Tear the peer down: what is queued for it fails and can never land."""
        for q in [q for q in self.queued if q.handle.peer == peer and not q.landed]:
            q.handle._native = None
            self.queued.remove(q)
            self.num_torn_down += 1
        self.inner.remove_peer(peer)
