"""``NixlTransferEngine``: the only module in kvbridge that talks to NIXL.

Ownership: one engine owns one NIXL agent and every handle, descriptor list, peer and
registration made through it; ``close()`` releases them all. NIXL agents are not
thread-safe (two threads on one agent segfaulted), so an engine is used from the thread
that created it and every call checks that (one ``get_ident`` compare) and raises
``TransferError`` otherwise, instead of taking a lock that would hide a design mistake. A
``shared`` engine (NIXL's strict thread mode) may be called from several threads; its
owner then sets ``guard``, which every call checks the same way: the worker's agent gate
(``kvbridge.connector.worker.agent_gate``), so that no call reaches NIXL unannounced.

Progress: the NIXL Python wrapper starts its progress thread with a zero delay, which
spins a full core per agent. By default there is no progress thread; ``poll()`` and
``get_notifs()`` drive progress, so the owner (the worker's step loop) must call them.

NIXL reports failures as exceptions from ``transfer()`` / ``check_xfer_state()`` (the
"ERR" state was never seen) and as status strings otherwise; both are mapped in one
function each (``kvbridge.connector.transfer.nixl_calls``: ``translate``, ``to_state``).
A peer NIXL reports disconnected (``nixlRemoteDisconnectError`` from a transfer, a poll, a
notification or a connect) is remembered by name (``peer_gone``): only that proves no
transfer with it can still land; ``remove_peer`` alone does not stop one.

Posting: by index through the prepared lists (``make_prepped_xfer``), or, for rows that
run adjacent on both sides, one descriptor per run through lists built for that transfer
(``initialize_xfer``); ``NixlEngineConfig.merge`` picks (``kvbridge.connector.transfer.xfer_rows``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from nixl._api import nixl_agent

from kvbridge.connector.transfer.errors import (
    DescriptorError,
    PeerDisconnectedError,
    RegistrationError,
    TransferError,
)
from kvbridge.connector.transfer.gpu_paths import warn_slow_gpu_path
from kvbridge.connector.transfer.nixl_calls import (
    LOCAL,
    NIXL_MEM,
    make_xfer,
    new_agent,
    nixl_call,
    to_state,
)
from kvbridge.connector.transfer.nixl_config import (
    MAX_NOTIF_BYTES,
    MergeRuns,
    NixlEngineConfig,
    ProgressMode,
    XferTelemetry,
)
from kvbridge.connector.transfer.registrations import (
    Registration,
    check_no_overlap,
    registered_rows,
)
from kvbridge.connector.transfer.transport import (
    DescList,
    PostFailedError,
    XferHandle,
    XferOp,
    XferState,
    check_desc_array,
)
from kvbridge.connector.transfer.xfer_rows import xfer_rows
from kvbridge.layouts.region import MemoryKind
from kvbridge.layouts.runs import next_adjacent

# the config lives in kvbridge.connector.transfer.nixl_config; importing it from here keeps working
__all__ = ["MergeRuns", "NixlEngineConfig", "NixlTransferEngine", "ProgressMode", "XferTelemetry"]

# disconnected peers remembered (agent names are unique per process incarnation, so this
# only bounds memory; a handle to a peer forgotten here counts as still running: safe)
GONE_KEPT = 4096


class NixlTransferEngine:
    """``TransferEngine`` over one NIXL agent. See the module docstring for ownership."""

    def __init__(self, config: NixlEngineConfig) -> None:
        self.config = config
        self.agent_name = config.agent_name
        self._owner_thread = threading.get_ident()
        # set by a shared engine's owner: True when the calling thread may call NIXL now
        self.guard: Callable[[], bool] | None = None
        self._agent: nixl_agent | None = new_agent(config)
        self._registrations: list[Registration] = []
        self._peers: set[str] = set()
        self._desc_lists: set[DescList] = set()
        self._xfers: set[XferHandle] = set()
        # peers NIXL reported disconnected (oldest first, GONE_KEPT at most): see peer_gone
        self._gone: dict[str, None] = {}
        self._num_descriptors_posted = 0
        self._num_rows_posted = 0
        self._bytes_posted = 0

    # -- ownership ---------------------------------------------------------------------

    def _enter(self, what: str) -> nixl_agent:
        if self.guard is not None:
            if not self.guard():
                raise TransferError(
                    f"agent {self.agent_name!r}: {what} called from thread "
                    f"{threading.get_ident()} without the owner's gate held"
                )
        elif not self.config.shared and threading.get_ident() != self._owner_thread:
            raise TransferError(
                f"agent {self.agent_name!r}: {what} called from thread "
                f"{threading.get_ident()}, but the engine belongs to thread "
                f"{self._owner_thread} (NIXL agents are not thread-safe)"
            )
        if self._agent is None:
            raise TransferError(f"agent {self.agent_name!r}: {what} after close()")
        return self._agent

    def __enter__(self) -> NixlTransferEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._agent is None

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(sorted(self._peers))

    @property
    def num_live_handles(self) -> int:
        return len(self._xfers)

    @property
    def num_live_desc_lists(self) -> int:
        return len(self._desc_lists)

    @property
    def num_descriptors_posted(self) -> int:
        return self._num_descriptors_posted

    @property
    def num_rows_posted(self) -> int:
        return self._num_rows_posted

    @property
    def bytes_posted(self) -> int:
        return self._bytes_posted

    # -- memory and peers ----------------------------------------------------------------

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        agent = self._enter("register")
        if len(tensors) == 0:
            raise RegistrationError(f"agent {self.agent_name!r}: register() got no tensors")
        for i, t in enumerate(tensors):
            if not t.is_contiguous() or t.numel() == 0:
                raise RegistrationError(
                    f"agent {self.agent_name!r}: tensor {i} (shape {tuple(t.shape)}, "
                    f"stride {t.stride()}) must be non-empty and contiguous"
                )
        kinds = {MemoryKind.of(t) for t in tensors}
        if len(kinds) != 1:
            raise RegistrationError(
                f"agent {self.agent_name!r}: register() mixes {sorted(k.value for k in kinds)};"
                " register DRAM and VRAM tensors in separate calls"
            )
        kind = kinds.pop()
        spans = np.array(
            [(t.data_ptr(), t.numel() * t.element_size(), t.device.index or 0) for t in tensors],
            dtype=np.int64,
        )
        check_no_overlap(self._registrations, spans, f"agent {self.agent_name!r}")
        with nixl_call(
            f"agent {self.agent_name!r}: register {len(spans)}", RegistrationError, slow_s=None
        ):
            native = agent.register_memory(spans, NIXL_MEM[kind])
        self._registrations.append(Registration(native, tuple(tensors), spans, kind))
        if kind is MemoryKind.VRAM:
            warn_slow_gpu_path(os.environ)  # a setting that keeps UCX off CUDA IPC

    def metadata(self) -> bytes:
        agent = self._enter("metadata")
        with nixl_call(f"agent {self.agent_name!r}: metadata"):
            return agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        agent = self._enter("add_peer")
        with nixl_call(
            f"agent {self.agent_name!r}: add_peer ({len(metadata)} bytes)", diagnose=True
        ):
            raw = agent.add_remote_agent(metadata)
        peer = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._peers.add(peer)
        return peer

    def connect(self, peer: str) -> None:
        agent = self._enter("connect")
        if peer not in self._peers:
            raise TransferError(f"agent {self.agent_name!r}: connect to unknown peer {peer!r}")
        what = f"agent {self.agent_name!r}: make_connection {peer!r}"
        with self._watch(peer), nixl_call(what, diagnose=True):
            agent.make_connection(peer)

    def peer_gone(self, peer: str) -> bool:
        return peer in self._gone

    @contextlib.contextmanager
    def _watch(self, peer: str) -> Iterator[None]:
        """Remember ``peer`` as gone when NIXL reports it disconnected inside the block
        (the one fact that proves nothing more moves between us)."""
        try:
            yield
        except PeerDisconnectedError:
            self._gone[peer] = None
            while len(self._gone) > GONE_KEPT:
                del self._gone[next(iter(self._gone))]
            raise

    def remove_peer(self, peer: str) -> None:
        agent = self._enter("remove_peer")
        if peer not in self._peers:
            return
        for handle in [h for h in self._xfers if h.peer == peer]:
            self.release(handle)
        for descs in [d for d in self._desc_lists if d.peer == peer]:
            self.release_descs(descs)
        self._peers.discard(peer)
        with nixl_call(f"agent {self.agent_name!r}: remove_peer {peer!r}", diagnose=True):
            agent.remove_remote_agent(peer)

    # -- descriptor lists ------------------------------------------------------------------

    def prep_local(self, descs: np.ndarray) -> DescList:
        agent = self._enter("prep_local")
        what = f"agent {self.agent_name!r}: prep_local"
        descs = check_desc_array(descs, what)
        kind, spans = registered_rows(self._registrations, descs, what)
        with nixl_call(what, DescriptorError):
            native = agent.prep_xfer_dlist(LOCAL, descs, NIXL_MEM[kind])
        return self._own_desc_list(native, "", descs, kind, next_adjacent(descs, spans))

    def prep_remote(
        self, peer: str, descs: np.ndarray, *, memory_kind: MemoryKind = MemoryKind.DRAM
    ) -> DescList:
        agent = self._enter("prep_remote")
        what = f"agent {self.agent_name!r}: prep_remote for peer {peer!r}"
        if peer not in self._peers:
            raise TransferError(f"{what}: unknown peer; known: {self.peers}; add_peer first")
        descs = check_desc_array(descs, what)
        with nixl_call(what, DescriptorError):
            native = agent.prep_xfer_dlist(peer, descs, NIXL_MEM[memory_kind])
        # the peer's registrations are not known here: a list's touching rows are taken
        # to be one allocation (the TransferEngine.prep_remote contract)
        return self._own_desc_list(native, peer, descs, memory_kind, next_adjacent(descs))

    def _own_desc_list(
        self,
        native: object,
        peer: str,
        descs: np.ndarray,
        kind: MemoryKind,
        adjacent: np.ndarray,
    ) -> DescList:
        table = descs.copy()
        table.flags.writeable = False
        desc_list = DescList(
            native, self, peer=peer, table=table, adjacent=adjacent, memory_kind=kind
        )
        self._desc_lists.add(desc_list)
        return desc_list

    def release_descs(self, descs: DescList) -> None:
        if descs._native is None:
            return
        self._enter("release_descs")
        native, descs._native = descs._native, None  # forget first: never reused
        self._desc_lists.discard(descs)
        with nixl_call(f"agent {self.agent_name!r}: release {descs!r}"):
            native.release()  # type: ignore[attr-defined]

    # -- transfers -------------------------------------------------------------------------

    def read(
        self,
        local: DescList,
        local_idx: np.ndarray,
        remote: DescList,
        remote_idx: np.ndarray,
        notif: bytes = b"",
    ) -> XferHandle:
        return self._post(XferOp.READ, local, local_idx, remote, remote_idx, notif)

    def write(
        self,
        local: DescList,
        local_idx: np.ndarray,
        remote: DescList,
        remote_idx: np.ndarray,
        notif: bytes = b"",
    ) -> XferHandle:
        return self._post(XferOp.WRITE, local, local_idx, remote, remote_idx, notif)

    def _post(
        self,
        op: XferOp,
        local: DescList,
        local_idx: np.ndarray,
        remote: DescList,
        remote_idx: np.ndarray,
        notif: bytes,
    ) -> XferHandle:
        agent = self._enter(op.name.lower())
        what = f"agent {self.agent_name!r}: {op.name} with peer {remote.peer!r}"
        if local.released or local._owner is not self or local.peer:
            raise DescriptorError(f"{what}: {local!r} is not a live local list of this engine")
        if remote.released or remote._owner is not self or not remote.peer:
            raise DescriptorError(f"{what}: {remote!r} is not a live remote list of this engine")
        rows = xfer_rows(local, local_idx, remote, remote_idx, self.config.merge, what)
        if len(notif) > MAX_NOTIF_BYTES:
            raise TransferError(f"{what}: notif of {len(notif)} bytes > {MAX_NOTIF_BYTES}")
        with nixl_call(what, DescriptorError):
            native = make_xfer(agent, op, local, remote, rows, notif)
        handle = XferHandle(
            native,
            self,
            op=op,
            peer=remote.peer,
            num_descs=rows.num_descs,
            num_rows=rows.num_rows,
            num_bytes=rows.num_bytes,
            notif=notif,
        )
        self._xfers.add(handle)
        try:
            with self._watch(remote.peer), nixl_call(f"{what}: post {handle!r}"):
                status = agent.transfer(native)
            handle._done = to_state(status, f"{what}: post {handle!r}") is XferState.DONE
        except TransferError as exc:
            # NIXL says nothing more of this handle (its status stays the error), so it
            # is released here; the post's error is the one worth raising, a second one
            # from the release is not. What NIXL issued before the failure may still run
            # (PostFailedError): the caller holds the memory until release_if_ended says
            # the handle ended. A disconnect needs no handle: the peer is gone (_watch).
            with contextlib.suppress(TransferError):
                self.release(handle)
            if isinstance(exc, PeerDisconnectedError):
                raise
            raise PostFailedError(str(exc), handle) from exc
        self._num_descriptors_posted += handle.num_descs
        self._num_rows_posted += handle.num_rows
        self._bytes_posted += handle.num_bytes
        return handle

    def poll(self, handle: XferHandle) -> XferState:
        agent = self._enter("poll")
        native = self._live_native(handle, "poll")
        if handle._done:
            return XferState.DONE
        what = f"agent {self.agent_name!r}: poll {handle!r}"
        with self._watch(handle.peer), nixl_call(what):
            state = to_state(agent.check_xfer_state(native), what)
        handle._done = state is XferState.DONE
        return state

    def telemetry(self, handle: XferHandle) -> XferTelemetry | None:
        """NIXL's view of a DONE transfer (merged descriptor count, bytes, durations), or
        None when ``capture_telemetry`` is off. Before DONE NIXL returns garbage, so this
        raises ``TransferError`` for a transfer not yet seen DONE by ``poll``."""
        agent = self._enter("telemetry")
        native = self._live_native(handle, "telemetry")
        if not self.config.capture_telemetry:
            return None
        if not handle._done:
            raise TransferError(f"agent {self.agent_name!r}: telemetry of pending {handle!r}")
        with nixl_call(f"agent {self.agent_name!r}: telemetry {handle!r}"):
            t = agent.get_xfer_telemetry(native)
        return XferTelemetry(t.descCount, t.totalBytes, t.postDuration, t.xferDuration)

    def _live_native(self, handle: XferHandle, what: str) -> object:
        if handle._native is None or handle._owner is not self:
            raise TransferError(
                f"agent {self.agent_name!r}: {what} on {handle!r}, which is released or "
                "belongs to another engine"
            )
        return handle._native

    def release(self, handle: XferHandle) -> None:
        if handle._native is None:
            return
        self._enter("release")
        native, handle._native = handle._native, None  # forget first: never reposted
        self._xfers.discard(handle)
        with nixl_call(f"agent {self.agent_name!r}: release {handle!r}"):
            native.release()  # type: ignore[attr-defined]

    # -- notifications ---------------------------------------------------------------------

    def send_notif(self, peer: str, msg: bytes) -> None:
        agent = self._enter("send_notif")
        what = f"agent {self.agent_name!r}: send_notif to {peer!r}"
        if peer not in self._peers:
            raise TransferError(f"{what}: unknown peer; known: {self.peers}")
        if len(msg) > MAX_NOTIF_BYTES:
            raise TransferError(f"{what}: {len(msg)} bytes > {MAX_NOTIF_BYTES}")
        with self._watch(peer), nixl_call(what):
            agent.send_notif(peer, msg)

    def get_notifs(self) -> dict[str, list[bytes]]:
        agent = self._enter("get_notifs")
        with nixl_call(f"agent {self.agent_name!r}: get_notifs"):
            return agent.get_new_notifs()

    # -- shutdown --------------------------------------------------------------------------

    def close(self) -> None:
        if self._agent is None:
            return
        agent = self._enter("close")
        errors: list[TransferError] = []
        # Everything is released even if one release fails; the first failure is raised.
        for release, items in (
            (self.release, list(self._xfers)),
            (self.release_descs, list(self._desc_lists)),
            (self.remove_peer, sorted(self._peers)),
        ):
            for item in items:
                try:
                    release(item)  # type: ignore[operator]
                except TransferError as exc:
                    errors.append(exc)
        for reg in self._registrations:
            try:
                with nixl_call(
                    f"agent {self.agent_name!r}: deregister", RegistrationError, slow_s=None
                ):
                    agent.deregister_memory(reg.native)
            except TransferError as exc:
                errors.append(exc)
        self._registrations.clear()
        self._peers.clear()
        self._agent = None
        if errors:
            raise TransferError(
                f"agent {self.agent_name!r}: close() hit {len(errors)} error(s); first: {errors[0]}"
            ) from errors[0]

    def __repr__(self) -> str:
        return (
            f"NixlTransferEngine({self.agent_name!r}, peers={len(self._peers)}, "
            f"registrations={len(self._registrations)}, live_handles={len(self._xfers)}, "
            f"closed={self.closed})"
        )
