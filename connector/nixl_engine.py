"""``NixlTransferEngine``: the only module in kvbridge that talks to NIXL.

Ownership: one engine owns one NIXL agent and every handle, descriptor list, peer and
registration made through it; ``close()`` releases them all. NIXL agents are not
thread-safe (two threads on one agent segfaulted), so an engine is used from the thread
that created it and every call checks that (one ``get_ident`` compare) and raises
``TransferError`` otherwise, instead of taking a lock that would hide a design mistake.

Progress: the NIXL Python wrapper starts its progress thread with a zero delay, which
spins a full core per agent. By default there is no progress thread; ``poll()`` and
``get_notifs()`` drive progress, so the owner (the worker's step loop) must call them.

NIXL reports failures as exceptions from ``transfer()`` / ``check_xfer_state()`` (the
"ERR" state was never seen) and as status strings otherwise; both are mapped in one
function each (``connector.nixl_calls``: ``translate``, ``to_state``).
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from connector.errors import (
    DescriptorError,
    RegistrationError,
    TransferError,
)
from connector.nixl_calls import LOCAL, NIXL_MEM, NIXL_OPS, nixl_call, progress_delay, to_state
from connector.registrations import Registration, check_no_overlap, registered_kind
from connector.transport import (
    DescList,
    XferHandle,
    XferOp,
    XferState,
    check_desc_array,
    check_indices,
)
from layouts.region import MemoryKind

MAX_NOTIF_BYTES = 64 * 1024  # larger notifications take milliseconds (NIXL_NOTES)


class ProgressMode(enum.Enum):
    PROGRESS_THREAD_OFF = "off"  # the owner drives progress via poll()/get_notifs()
    PROGRESS_THREAD_SPIN = "spin"  # the wrapper's thread: zero delay, one busy core per agent
    # NIXL's progress thread sleeping ``progress_delay_us`` between rounds: transfers and
    # connection set-up move while the owner is idle (an engine with nothing scheduled)
    PROGRESS_THREAD_DELAY = "delay"


@dataclass(frozen=True, kw_only=True)
class NixlEngineConfig:
    """``agent_name`` must be unique per process incarnation, e.g.
    ``f"{engine_id}-{rank}-{uuid4().hex[:8]}"``: NIXL refuses new metadata under a name
    it still holds."""

    agent_name: str
    backends: tuple[str, ...] = ("UCX",)
    progress: ProgressMode = ProgressMode.PROGRESS_THREAD_OFF
    progress_delay_us: int = 1000  # PROGRESS_THREAD_DELAY only
    capture_telemetry: bool = False
    # True: several threads call in turn (the worker's lock serialises them); the agent
    # locks its API (STRICT) and any thread may call. False: only the creating thread.
    shared: bool = False

    def __post_init__(self) -> None:
        if not self.agent_name:
            raise TransferError("NixlEngineConfig.agent_name is empty; pass a unique name")
        if not self.backends:
            raise TransferError(f"NixlEngineConfig({self.agent_name!r}).backends is empty")


@dataclass(frozen=True)
class XferTelemetry:
    """NIXL's per-transfer telemetry; ``num_descs`` counts descriptors after merging."""

    num_descs: int
    num_bytes: int
    post_us: int
    xfer_us: int


class NixlTransferEngine:
    """``TransferEngine`` over one NIXL agent. See the module docstring for ownership."""

    def __init__(self, config: NixlEngineConfig) -> None:
        self.config = config
        self.agent_name = config.agent_name
        self._owner_thread = threading.get_ident()
        threaded = config.progress is not ProgressMode.PROGRESS_THREAD_OFF
        nixl_config = nixl_agent_config(
            enable_prog_thread=threaded,
            capture_telemetry=config.capture_telemetry,
            backends=list(config.backends),
            # NIXL's own progress thread (or another of ours) runs beside the owner's
            # calls: lock the API
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
            if threaded or config.shared
            else None,
        )
        with (
            nixl_call(f"agent {self.agent_name!r}: create"),
            progress_delay(
                config.progress_delay_us
                if config.progress is ProgressMode.PROGRESS_THREAD_DELAY
                else 0
            ),
        ):
            self._agent: nixl_agent | None = nixl_agent(self.agent_name, nixl_config)
        missing = set(config.backends) - set(self._agent.backends)
        if missing:
            raise TransferError(
                f"agent {self.agent_name!r}: backends {sorted(missing)} unavailable; "
                f"plugins present: {sorted(self._agent.plugin_list)}"
            )
        self._registrations: list[Registration] = []
        self._peers: set[str] = set()
        self._desc_lists: set[DescList] = set()
        self._xfers: set[XferHandle] = set()
        self._num_descriptors_posted = 0
        self._bytes_posted = 0

    # -- ownership ---------------------------------------------------------------------

    def _enter(self, what: str) -> nixl_agent:
        if not self.config.shared and threading.get_ident() != self._owner_thread:
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
        with nixl_call(f"agent {self.agent_name!r}: register {len(spans)}", RegistrationError):
            native = agent.register_memory(spans, NIXL_MEM[kind])
        self._registrations.append(Registration(native, tuple(tensors), spans, kind))

    def metadata(self) -> bytes:
        agent = self._enter("metadata")
        with nixl_call(f"agent {self.agent_name!r}: metadata"):
            return agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        agent = self._enter("add_peer")
        with nixl_call(f"agent {self.agent_name!r}: add_peer ({len(metadata)} bytes)"):
            raw = agent.add_remote_agent(metadata)
        peer = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._peers.add(peer)
        return peer

    def connect(self, peer: str) -> None:
        agent = self._enter("connect")
        if peer not in self._peers:
            raise TransferError(f"agent {self.agent_name!r}: connect to unknown peer {peer!r}")
        with nixl_call(f"agent {self.agent_name!r}: make_connection {peer!r}"):
            agent.make_connection(peer)

    def remove_peer(self, peer: str) -> None:
        agent = self._enter("remove_peer")
        if peer not in self._peers:
            return
        for handle in [h for h in self._xfers if h.peer == peer]:
            self.release(handle)
        for descs in [d for d in self._desc_lists if d.peer == peer]:
            self.release_descs(descs)
        self._peers.discard(peer)
        with nixl_call(f"agent {self.agent_name!r}: remove_peer {peer!r}"):
            agent.remove_remote_agent(peer)

    # -- descriptor lists ------------------------------------------------------------------

    def prep_local(self, descs: np.ndarray) -> DescList:
        agent = self._enter("prep_local")
        what = f"agent {self.agent_name!r}: prep_local"
        descs = check_desc_array(descs, what)
        kind = registered_kind(self._registrations, descs, what)
        with nixl_call(what, DescriptorError):
            native = agent.prep_xfer_dlist(LOCAL, descs, NIXL_MEM[kind])
        return self._own_desc_list(native, "", descs, kind)

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
        return self._own_desc_list(native, peer, descs, memory_kind)

    def _own_desc_list(
        self, native: object, peer: str, descs: np.ndarray, kind: MemoryKind
    ) -> DescList:
        lens = descs[:, 1].copy()
        lens.flags.writeable = False
        desc_list = DescList(native, self, peer=peer, lens=lens, memory_kind=kind)
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
        li = check_indices(local_idx, local.num_descs, f"{what}: local_idx")
        ri = check_indices(remote_idx, remote.num_descs, f"{what}: remote_idx")
        if len(li) != len(ri):
            raise DescriptorError(f"{what}: {len(li)} local indices but {len(ri)} remote ones")
        local_lens, remote_lens = local.lens[li], remote.lens[ri]
        bad = np.flatnonzero(local_lens != remote_lens)
        if len(bad):
            k = bad[0]
            raise DescriptorError(
                f"{what}: position {k}: local desc {li[k]} has {local_lens[k]} bytes, "
                f"remote desc {ri[k]} has {remote_lens[k]}"
            )
        if len(notif) > MAX_NOTIF_BYTES:
            raise TransferError(f"{what}: notif of {len(notif)} bytes > {MAX_NOTIF_BYTES}")
        with nixl_call(what, DescriptorError):
            native = agent.make_prepped_xfer(
                NIXL_OPS[op], local._native, li, remote._native, ri, notif
            )
        handle = XferHandle(
            native,
            self,
            op=op,
            peer=remote.peer,
            num_descs=len(li),
            num_bytes=int(local_lens.sum()),
            notif=notif,
        )
        self._xfers.add(handle)
        try:
            with nixl_call(f"{what}: post {handle!r}"):
                status = agent.transfer(native)
            handle._done = to_state(status, f"{what}: post {handle!r}") is XferState.DONE
        except TransferError:
            # The caller never sees this handle, so it is ours to free; the post's error
            # is the one worth raising, a second one from the release is not.
            with contextlib.suppress(TransferError):
                self.release(handle)
            raise
        self._num_descriptors_posted += handle.num_descs
        self._bytes_posted += handle.num_bytes
        return handle

    def poll(self, handle: XferHandle) -> XferState:
        agent = self._enter("poll")
        native = self._live_native(handle, "poll")
        if handle._done:
            return XferState.DONE
        what = f"agent {self.agent_name!r}: poll {handle!r}"
        with nixl_call(what):
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
        with nixl_call(what):
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
                with nixl_call(f"agent {self.agent_name!r}: deregister", RegistrationError):
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
