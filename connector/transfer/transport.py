"""The transfer-engine contract: what the connector asks of whatever moves the bytes.

Descriptor lists are prepared once per region and peer; a transfer then picks blocks by
index (Nx3 numpy arrays in, int32 index arrays per request)::

    local  DescList  [d0 d1 d2 ... dN-1]   (prep_local, once)
    remote DescList  [r0 r1 r2 ... rM-1]   (prep_remote, once per peer)
    read(local, [7, 2, 9], remote, [0, 1, 5])  ->  d7<-r0, d2<-r1, d9<-r5

Rows that run adjacent on both sides (``kvbridge.layouts.runs``: ``read(local, [3, 4, 5], remote,
[8, 9, 10])`` where d3..d5 and r8..r10 each touch end to start) may be posted as one
descriptor per run; ``XferHandle.num_descs`` says how many descriptors were posted and
``num_rows`` how many rows were asked for.

Failures are raised (``kvbridge.connector.transfer.errors``), never returned as states. Handles are
owned by the engine that made them: ``release()`` on a handle is the same as asking its engine,
and a released handle forgets its native resource so it can never reach NIXL again.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from kvbridge.connector.transfer.errors import DescriptorError, TransferError, TransferTimeoutError
from kvbridge.layouts.region import MemoryKind


class XferState(enum.Enum):
    """Where a posted transfer stands. Failures raise ``TransferError`` subclasses."""

    PENDING = "pending"
    DONE = "done"


class XferOp(enum.Enum):
    READ = "read"  # remote -> local (decode pulls from prefill)
    WRITE = "write"  # local -> remote


class DescList:
    """A prepared descriptor list: local (``peer == ""``) or on one remote peer."""

    __slots__ = ("_native", "_owner", "adjacent", "lens", "memory_kind", "peer", "table")

    def __init__(
        self,
        native: object,
        owner: TransferEngine,
        *,
        peer: str,
        table: np.ndarray,
        adjacent: np.ndarray,
        memory_kind: MemoryKind,
    ) -> None:
        self._native: object | None = native
        self._owner = owner
        self.peer = peer
        self.table = table  # Nx3 int64 (addr, len, device_id) as prepared, read-only
        self.lens = table[:, 1]  # int64 byte length of each descriptor, read-only
        # adjacent[r]: row r + 1 starts where row r ends, in one allocation (kvbridge.layouts.runs)
        self.adjacent = adjacent
        self.memory_kind = memory_kind

    @property
    def num_descs(self) -> int:
        return len(self.lens)

    @property
    def released(self) -> bool:
        return self._native is None

    def release(self) -> None:
        """Idempotent; same as ``owner.release_descs(self)``."""
        if self._native is not None:
            self._owner.release_descs(self)

    def __repr__(self) -> str:
        where = f"peer={self.peer!r}" if self.peer else "local"
        return (
            f"DescList({where}, num_descs={self.num_descs}, "
            f"{self.memory_kind.value}, released={self.released})"
        )


class XferHandle:
    """One posted transfer. Poll it through its engine; release it exactly once (idempotent)."""

    __slots__ = (
        "_done",
        "_native",
        "_owner",
        "notif",
        "num_bytes",
        "num_descs",
        "num_rows",
        "op",
        "peer",
    )

    def __init__(
        self,
        native: object,
        owner: TransferEngine,
        *,
        op: XferOp,
        peer: str,
        num_descs: int,
        num_bytes: int,
        notif: bytes,
        num_rows: int | None = None,
    ) -> None:
        self._native: object | None = native
        self._owner = owner
        self._done = False
        self.op = op
        self.peer = peer
        self.num_descs = num_descs  # descriptors posted (a merged run counts once)
        self.num_rows = num_descs if num_rows is None else num_rows  # rows asked for
        self.num_bytes = num_bytes
        self.notif = notif

    @property
    def released(self) -> bool:
        return self._native is None

    def release(self) -> None:
        """Idempotent; same as ``owner.release(self)``. Cancels the transfer if in flight."""
        if self._native is not None:
            self._owner.release(self)

    def __repr__(self) -> str:
        state = "released" if self.released else ("done" if self._done else "posted")
        rows = f" of {self.num_rows} rows" if self.num_rows != self.num_descs else ""
        return (
            f"XferHandle({self.op.name} peer={self.peer!r}, num_descs={self.num_descs}"
            f"{rows}, num_bytes={self.num_bytes}, {state})"
        )


class PostFailedError(TransferError):
    """NIXL failed a READ or WRITE after it may have issued part of it: ``handle`` is that
    transfer, released. NIXL's UCX backend issues a request per descriptor and keeps only
    the last one (``nixlUcxEngine::sendXferRange``, src/plugins/ucx/ucx_backend.cpp,
    frees each earlier request without cancelling it), so when a later descriptor, the
    flush or the notification fails, the post returns the error while the operations
    issued before it still run. Hold the memory the transfer names as for any transfer
    that may run: ``release_if_ended(engine, handle)`` says when it can no longer land
    (its peer confirmed gone)."""

    def __init__(self, message: str, handle: XferHandle) -> None:
        super().__init__(message)
        self.handle = handle


class TransferEngine(Protocol):
    """Moves registered bytes between this process and its peers.

    One engine is used from one thread (the one that created it); agents underneath are
    not thread-safe. Every method raises ``TransferError`` (or a subclass) on failure and
    after ``close()``.
    """

    agent_name: str

    @property
    def num_descriptors_posted(self) -> int:
        """Descriptors handed to NIXL by successful posts since creation: a run of
        adjacent rows posted as one descriptor counts once (NIXL may coalesce further)."""
        ...

    @property
    def num_rows_posted(self) -> int:
        """Rows (prepared descriptors picked by index) of successful posts since creation;
        ``num_descriptors_posted`` when no run was merged."""
        ...

    @property
    def bytes_posted(self) -> int:
        """Bytes covered by successful posts since creation."""
        ...

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register whole contiguous allocations (per-layer caches, cross-layer buffers).

        CPU tensors register as DRAM, CUDA tensors as VRAM; the engine keeps a reference to
        each tensor until ``close()``. Raises ``RegistrationError`` for empty or
        non-contiguous tensors, overlap with an earlier registration, or a NIXL refusal.
        """
        ...

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registrations) for the handshake.
        Call it after ``register`` so peers can address the registered memory."""
        ...

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; return its agent name. Idempotent for identical metadata.
        Raises ``TransferError`` for corrupt metadata or different metadata under a name
        that is already loaded (each process incarnation needs a unique agent name)."""
        ...

    def remove_peer(self, peer: str) -> None:
        """Release every handle and descriptor list that touches ``peer``, then forget it
        (disconnects). A no-op for an unknown peer. Removing is not stopping: a READ or
        WRITE already posted may still complete afterwards (``peer_gone`` says when none
        can)."""
        ...

    def peer_gone(self, peer: str) -> bool:
        """The transport reported ``peer`` disconnected (a transfer, poll or notification
        raised ``PeerDisconnectedError``): its process died or the connection failed, so
        no transfer with it can still land. Stays true after ``remove_peer``; a name never
        comes back (each process incarnation has its own). False for a peer that is merely
        slow, frozen or unknown."""
        ...

    def connect(self, peer: str) -> None:
        """Set up the transport's connection to a known peer now, so that the first
        transfer does not pay for it (optional: transfers connect on first use)."""
        ...

    def prep_local(self, descs: np.ndarray) -> DescList:
        """Prepare an Nx3 int64 array ``(addr, len, device_id)`` of local descriptors.
        Raises ``DescriptorError`` for a malformed array or a row outside registered memory."""
        ...

    def prep_remote(
        self, peer: str, descs: np.ndarray, *, memory_kind: MemoryKind = MemoryKind.DRAM
    ) -> DescList:
        """Prepare ``peer``'s descriptors (from its handshake). Raises ``TransferError`` for
        an unknown peer and ``DescriptorError`` for rows outside the peer's registrations.
        Consecutive rows that touch end to start are taken to lie in one registration of
        the peer (a region's block table does), so a run of them may move as one descriptor."""
        ...

    def read(
        self,
        local: DescList,
        local_idx: np.ndarray,
        remote: DescList,
        remote_idx: np.ndarray,
        notif: bytes = b"",
    ) -> XferHandle:
        """Post a READ ``remote[remote_idx[k]] -> local[local_idx[k]]``; ``notif`` reaches
        the peer when the data has landed. Positions whose rows run adjacent on both sides
        may be posted as one descriptor (``handle.num_descs`` counts what was posted).
        Raises ``DescriptorError`` (before posting) for unequal or empty index arrays,
        indices out of bounds, paired descriptors of different lengths, or released
        lists; ``PeerDisconnectedError`` if the peer is gone; ``PostFailedError``, with
        the released handle, when NIXL failed the post after it may have issued part of
        it (hold what it names until ``release_if_ended`` says it ended).
        """
        ...

    def write(
        self,
        local: DescList,
        local_idx: np.ndarray,
        remote: DescList,
        remote_idx: np.ndarray,
        notif: bytes = b"",
    ) -> XferHandle:
        """Post a WRITE ``local[local_idx[k]] -> remote[remote_idx[k]]``; as ``read``."""
        ...

    def poll(self, handle: XferHandle) -> XferState:
        """Non-blocking state of ``handle``; drives progress when no progress thread runs.
        Raises ``PeerDisconnectedError`` / ``TransferError`` on failure and
        ``TransferError`` for a released handle."""
        ...

    def release(self, handle: XferHandle) -> None:
        """Free ``handle``. Idempotent. Release is not cancel: an RMA operation already
        posted may still complete after this returns, so release a handle in flight only
        where nothing reuses the memory it targets (``decode.quarantine``)."""
        ...

    def release_descs(self, descs: DescList) -> None:
        """Free a prepared descriptor list. Idempotent; posted transfers are unaffected."""
        ...

    def send_notif(self, peer: str, msg: bytes) -> None:
        """Send a standalone notification (FIFO per peer). Raises ``PeerDisconnectedError``
        when the peer is gone, which makes it a cheap liveness probe."""
        ...

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender agent name. Also drives
        progress: a passive side must call it regularly."""
        ...

    def close(self) -> None:
        """Release every handle, descriptor list, peer and registration. Idempotent."""
        ...


def release_if_ended(engine: TransferEngine, handle: XferHandle) -> bool:
    """True (and the handle released) once nothing of the transfer can still land: NIXL
    reports it done, or it failed or was released and its peer is confirmed gone
    (``peer_gone``: a dead process sends nothing more). False: it may still run.

    A failure alone is not an end. NIXL 1.5's UCX backend reports a handle failed as soon
    as one of its UCX requests did, without waiting for the others: ``status()`` of
    ``nixlUcxBackendReqH`` (src/plugins/ucx/ucx_backend.cpp) returns the last request's
    error before it looks at the rest, and an error outranks a request still in
    progress. From then on ``nixlAgent::getXferStatus`` (src/core/nixl_agent.cpp)
    repeats that error without asking the backend (and answers "not found" without
    asking it at all once the peer's metadata was dropped or replaced), and releasing
    cancels what is left (``nixlUcxBackendReqH::release``), which UCX does not do for a
    GET or PUT already issued. So no NIXL call says when the rest ended: a failed handle
    is released and counts as running until its peer is confirmed gone. A disconnect,
    the usual failure, confirms that in the same poll."""
    if handle.released:
        return engine.peer_gone(handle.peer)
    try:
        state = engine.poll(handle)
    except TransferError:
        engine.release(handle)
        return engine.peer_gone(handle.peer)
    if state is XferState.PENDING:
        return False
    engine.release(handle)
    return True


def wait_done(
    engine: TransferEngine,
    handle: XferHandle,
    *,
    timeout_s: float,
    poll_interval_s: float = 0.0002,
) -> None:
    """Poll ``handle`` until DONE; raise ``TransferTimeoutError`` after ``timeout_s``.

    A dead peer raises from ``poll``; a frozen one only shows as time passing, which is
    why every wait has a deadline. The handle stays owned by the caller either way.
    """
    start = time.monotonic()
    while engine.poll(handle) is XferState.PENDING:
        elapsed = time.monotonic() - start
        if elapsed >= timeout_s:
            raise TransferTimeoutError(
                f"agent {engine.agent_name!r}: {handle!r} still pending after "
                f"{elapsed:.3f} s (timeout_s={timeout_s}); it may still complete"
            )
        time.sleep(poll_interval_s)


def check_desc_array(descs: np.ndarray, what: str) -> np.ndarray:
    """Validate an Nx3 ``(addr, len, device_id)`` array; return it as contiguous int64."""
    if not isinstance(descs, np.ndarray) or descs.ndim != 2 or descs.shape[1] != 3:
        shape = getattr(descs, "shape", type(descs).__name__)
        raise DescriptorError(f"{what}: need an Nx3 array (addr, len, device_id), got {shape}")
    if len(descs) == 0 or descs.dtype.kind not in "iu":
        raise DescriptorError(f"{what}: need a non-empty integer array, got {descs.dtype}")
    descs = np.ascontiguousarray(descs, dtype=np.int64)
    bad = np.flatnonzero((descs[:, 0] < 0) | (descs[:, 1] <= 0) | (descs[:, 2] < 0))
    if len(bad):
        raise DescriptorError(f"{what}: row {bad[0]} = {descs[bad[0]].tolist()} is invalid")
    return descs


def check_indices(idx: np.ndarray, num_descs: int, what: str) -> np.ndarray:
    """Validate a 1-D index array into a list of ``num_descs``; return it as int32."""
    idx = np.asarray(idx)
    if idx.ndim != 1 or idx.dtype.kind not in "iu" or len(idx) == 0:
        raise DescriptorError(
            f"{what}: need a non-empty 1-D integer array, got shape {idx.shape} {idx.dtype}"
        )
    bad = np.flatnonzero((idx < 0) | (idx >= num_descs))
    if len(bad):
        raise DescriptorError(
            f"{what}: index {int(idx[bad[0]])} at position {bad[0]} outside [0, {num_descs})"
        )
    return np.ascontiguousarray(idx, dtype=np.int32)
