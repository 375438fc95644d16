"""The worker-side connector: registers caches, serves handshakes, moves blocks.

It owns one transfer engine (NIXL), a :class:`~kvbridge.connector.worker.side_channel.SideChannel`
(the listener that describes this worker to readers, and the client that asks others), a peer
directory (to read from others), a :class:`Sender` (prefill role) and a :class:`Receiver`
(decode role); in push mode also a :class:`Pusher` and a second peer directory of the
decode workers it writes to (prefill role). What arrives from peers goes through an
:class:`~kvbridge.connector.worker.inbox.Inbox`, what leaves through an
:class:`~kvbridge.connector.worker.outbox.Outbox`. ``assembly`` builds and wires them at
``register_kv_caches``; this module is the engine-facing facade that runs them once per
engine step.

Threads: the engine's calls and the idle-progress thread take turns under the worker's
lock and run a progress round only when the agent gate is free (``agent_gate``); what may
wait on a peer (handshakes, adding and removing agents) runs on the worker's own threads
(``peer_setup``). A round that finds the gate taken is skipped: the engine's step queues
its metadata for the next round and returns what is already done, so it never waits on
another process.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvbridge.connector.common.config import KVTransferConfig
from kvbridge.connector.common.metadata import ConnectorMetadata, WorkerOutput
from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.transfer.nixl_config import MergeRuns
from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.connector.worker.agent_gate import AgentGate
from kvbridge.connector.worker.assembly import Wiring, assemble
from kvbridge.connector.worker.boundary import Boundary
from kvbridge.connector.worker.decode.receiver import Receiver
from kvbridge.connector.worker.device_order import DeviceOrder
from kvbridge.connector.worker.idle_progress import IdleProgress
from kvbridge.connector.worker.inbox import Inbox
from kvbridge.connector.worker.nixl_setup import engine_call, nixl_engine
from kvbridge.connector.worker.outbox import Outbox
from kvbridge.connector.worker.peer_health import merged
from kvbridge.connector.worker.peer_setup import PeerSetup
from kvbridge.connector.worker.peers import PeerDirectory
from kvbridge.connector.worker.prefill.pushes import POSTED_WAIT_S, Pusher
from kvbridge.connector.worker.prefill.sender import Sender
from kvbridge.connector.worker.routing import Router
from kvbridge.connector.worker.side_channel import SideChannel
from kvbridge.connector.worker.staging.engine_copies import CopyBlocksOp, EngineCopies
from kvbridge.connector.worker.staging.host_stage import HostStage
from kvbridge.connector.worker.staging.staged_reads import Repacker
from kvbridge.handshake.description import WorkerIdentity
from kvbridge.handshake.messages import WorkerDescription
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.errors import KVBridgeError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """The model a worker serves, as far as compatibility goes."""

    model_name: str  # names it in logs; never compared (a path differs between copies)
    dtype: str
    num_kv_heads: int  # the model's KV heads (all ranks together; a rank holds a slice)
    head_size: int
    architecture: str = ""  # the model's class, where the engine says (vLLM's)
    model_fingerprint: str = ""  # which weights; extra.model_fingerprint takes precedence


class KVBridgeWorker:
    """Implements :class:`kvbridge.connector.common.api.WorkerConnector`."""

    def __init__(
        self,
        config: KVTransferConfig,
        model: ModelInfo,
        *,
        rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_layers: Sequence[tuple[int, int]] = (),
        engine_factory: Callable[[str], TransferEngine] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rewrites_in_place: bool = True,
        host_staging: bool | None = None,
        device_order: Callable[[torch.device], DeviceOrder] = DeviceOrder,
    ) -> None:
        """``rewrites_in_place=False``: the engine may run its own requests on a block
        while a reader holds it (a prefix cache that hits held blocks), so this worker
        never rewrites blocks after save; readers read them natively (more descriptors).
        ``host_staging``: None (default) decides from ``kv_buffer_device`` and where the
        cache lives; True stages through a host mirror even for a cache in host memory
        (the staging path without a GPU). ``device_order``: builds what fences kvbridge's
        kernels on the cache's device (a recording fake in tests). ``pp_rank`` and
        ``pp_layers``: this worker's pipeline stage, and the model layers ``[first, end)``
        of each of its engine's stages (empty: no pipeline parallelism)."""
        self._device_order = device_order
        self.config = config
        self._host_staging = host_staging
        self._stage: HostStage | None = None
        self._engine_copies: Callable[[KVCacheBuffers], EngineCopies | str] | None = None
        self.rewrites_in_place = rewrites_in_place
        self._repacker: Repacker | None = None  # see set_repacker
        extra = config.extra
        self.transfer_mode = extra.transfer_mode
        self.rewrite_on_save = extra.rewrite_on_save and rewrites_in_place
        self._router = Router(
            rank, tp_size, model.num_kv_heads, pp_rank=pp_rank, pp_layers=pp_layers
        )
        self.pp_rank = pp_rank
        self.pp_size = len(pp_layers) or 1
        self.engine_rank = self._router.engine_rank  # stage-major: kv_port + engine_rank
        self.model = model
        self.rank = rank
        self.tp_size = tp_size
        self.metrics = ConnectorMetrics()
        self._clock = clock
        delay_us = extra.nixl_progress_us
        # get_notifs moves UCX along only where NIXL runs no progress thread of its own
        self._notifs_progress = not delay_us
        merge = MergeRuns.ON if extra.merge_runs else MergeRuns.OFF
        self._engine_factory = engine_factory or (
            # called from the step, the idle thread and the set-up thread, one at a time
            lambda name: nixl_engine(name, delay_us, shared=True, merge=merge)
        )
        self.agent_name = f"{config.engine_id}-r{self._router.engine_rank}-{uuid.uuid4().hex[:8]}"
        self._engine: TransferEngine | None = None
        self._gate = AgentGate()  # who may call the engine now (see the module docstring)
        self._setup: PeerSetup | None = None
        self._pending: list[ConnectorMetadata | str] = []  # for the next round (str: abort)
        self._buffers: KVCacheBuffers | None = None
        self._side: SideChannel | None = None
        self._peers: PeerDirectory | None = None
        self._sender: Sender | None = None
        self._receiver: Receiver | None = None
        self._targets: PeerDirectory | None = None  # push mode: decode workers we write to
        self._pusher: Pusher | None = None
        self._outbox: Outbox | None = None
        self._inbox: Inbox | None = None
        self._boundary = Boundary(self.metrics)  # replaced by the wired one at registration
        self._meta = ConnectorMetadata()
        self._closed = False
        # the engine's calls and the idle-progress thread (if any) take turns
        self._lock = threading.RLock()
        idle_ms, busy_us = extra.idle_progress_ms, extra.busy_progress_us
        self._idle = (
            IdleProgress(  # real time, always
                self._lock,
                lambda: self._round(step=False),
                idle_ms / 1000,
                busy=self._in_flight,
                busy_interval_s=busy_us / 1e6,
                on_failure=self._thread_died,
                on_stall=self._progress_stalled,
            )
            if idle_ms or busy_us
            else None
        )

    @property
    def unhealthy_reason(self) -> str | None:
        """Why this worker is unhealthy (a background thread died), or None."""
        return self._idle.failure if self._idle is not None else None

    def _thread_died(self, reason: str) -> None:
        self.metrics.background_thread_failures += 1

    def _progress_stalled(self, late_s: float) -> None:
        self.metrics.progress_stalls += 1
        self.metrics.progress_stall_seconds += late_s

    # -- setup ----------------------------------------------------------------------------

    @property
    def description(self) -> WorkerDescription:
        if self._side is None:
            raise KVBridgeError("register_kv_caches() has not been called")
        return self._side.description

    @property
    def side_channel_port(self) -> int:
        return self._side.port if self._side else 0

    def set_repacker(self, repacker: Repacker) -> None:
        """For engine-packed pages (``CacheFormat.block_packing``): the engine's way to
        rebuild its pages from whole remote pages (smaller ones side by side in a local
        block, or larger ones in staging slots). Call it before ``register_kv_caches``."""
        if self._engine is not None:
            raise KVBridgeError("set_repacker() must come before register_kv_caches()")
        self._repacker = repacker

    def set_engine_copies(self, copies: Callable[[KVCacheBuffers], EngineCopies | str]) -> None:
        """Before ``register_kv_caches``: how to stage through the engine's own copies
        (``staging.engine_copies``); the engine's op follows in :meth:`set_host_copy_op`."""
        if self._engine is not None:
            raise KVBridgeError("set_engine_copies() must come before register_kv_caches()")
        self._engine_copies = copies

    @engine_call
    def set_host_copy_op(self, op: CopyBlocksOp) -> None:
        if self._stage is not None:  # else NIXL moves the cache itself: nothing to copy
            self._stage.use_engine_op(op)

    @property
    def host_copy_path(self) -> str | None:
        """``"vllm"`` or ``"kvbridge"`` (whose copies fill the host mirror), None: no mirror."""
        return self._stage.copy_path if self._stage is not None else None

    def register_kv_caches(self, buffers: KVCacheBuffers) -> None:
        if self._engine is not None:
            raise KVBridgeError("KV caches are already registered")
        self._register(buffers)  # under the agent gate (assembly)
        if self._idle is not None:
            self._idle.start()

    def _register(self, buffers: KVCacheBuffers) -> None:
        self._buffers = buffers
        identity = WorkerIdentity(
            engine_id=self.config.engine_id,
            agent_name=self.agent_name,
            model_name=self.model.model_name,
            dtype=self.model.dtype,
            num_layers=buffers.config.num_layers,
            num_kv_heads=self.model.num_kv_heads,
            head_size=self.model.head_size,
            rank=self.rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            architecture=self.model.architecture,
            model_fingerprint=self.config.extra.model_fingerprint or self.model.model_fingerprint,
        )
        wiring = Wiring(
            config=self.config,
            identity=identity,
            router=self._router,
            gate=self._gate,
            metrics=self.metrics,
            clock=self._clock,
            engine_factory=self._engine_factory,
            device_order=self._device_order,
            repacker=self._repacker,
            engine_copies=self._engine_copies,
            host_staging=self._host_staging,
            rewrites_in_place=self.rewrites_in_place,
            rewrite_on_save=self.rewrite_on_save,
        )
        parts = assemble(wiring, buffers)
        self._engine, self._setup, self._stage = parts.engine, parts.setup, parts.stage
        self._side, self._peers, self._targets = parts.side, parts.peers, parts.targets
        self._outbox, self._inbox = parts.outbox, parts.inbox
        self._sender, self._pusher, self._receiver = parts.sender, parts.pusher, parts.receiver
        self._boundary = parts.boundary

    # -- per step -------------------------------------------------------------------------

    @engine_call
    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        self._meta = metadata

    @engine_call
    def start_load_kv(self) -> None:
        self._ready()
        meta, self._meta = self._meta, ConnectorMetadata()
        self._pending.append(meta)
        self._round()

    def _apply(self, meta: ConnectorMetadata) -> None:
        """The scheduler's orders of one step (in a round: the gate is held). Each order
        is its own failure boundary: one that raises fails that request alone (a send is
        dropped and reported finished once no granted claim runs, a load fails), and
        every other order of the step is still applied."""
        receiver, sender = self._ready()
        outbox, run = self._outbox, self._boundary.run
        assert outbox is not None
        for rid in meta.reqs_freed:  # aborted before this worker had them: refuse readers
            run("order: freed send", lambda r=rid: sender.abort(r, report=False))  # type: ignore[misc]
        for rid in meta.sends_to_end:  # aborted: end the hold (after granted claims)
            run("order: end send", lambda r=rid: sender.abort(r))  # type: ignore[misc]
        for spec in meta.reqs_to_send:
            run(
                "order: send",
                lambda sp=spec: sender.add(sp),  # type: ignore[misc]
                lambda _, sp=spec: sender.drop(sp.request_id),  # type: ignore[misc]
            )
        for load in meta.reqs_to_load:
            run(
                "order: load",
                lambda ld=load: receiver.add(ld),  # type: ignore[misc]
                lambda reason, ld=load: receiver.refuse(ld, reason),  # type: ignore[misc]
            )
        # a request with no load of its own here (aborted before it loaded, or a full
        # prefix hit) releases prefill's blocks, unless another local request with the
        # same params loads them right now (a duplicate): that load's Done is the one
        for rid, params in meta.reqs_to_abort:
            run("order: abort load", lambda r=rid, p=params: self._abort_load(receiver, r, p))  # type: ignore[misc]
        for rid, params in meta.reqs_to_release:
            run(
                "order: release",
                lambda r=rid, p=params: self._release_remote(receiver, r, p, ok=True),  # type: ignore[misc]
            )
        run("order: heartbeats", lambda: outbox.queue_heartbeats(meta.reqs_waiting))

    def _abort_load(self, receiver: Receiver, request_id: str, params: KVTransferParams) -> None:
        if not receiver.abort(request_id):
            self._release_remote(receiver, request_id, params, ok=False)

    def _round(self, *, step: bool = True) -> bool:
        """One progress round, unless the set-up thread holds the agent gate right now
        (a peer's set-up may be held in NIXL for as long as the peer makes it): then
        nothing here waits for it, the orders stay queued and False is returned.
        ``step=False``: the idle-progress thread's round."""
        with self._gate.round() as held:
            if not held:
                self.metrics.rounds_deferred = self._gate.rounds_deferred
                return False
            _, sender = self._ready()
            inbox, run = self._inbox, self._boundary.run
            assert inbox is not None
            while self._pending:  # one at a time, each order its own failure boundary
                order = self._pending.pop(0)
                if isinstance(order, str):
                    run("order: abort send", lambda o=order: sender.abort(o))  # type: ignore[misc]
                else:
                    self._apply(order)
            answered = self._progress()
            if step:  # the engine's own rounds: leases end, early claims are answered
                run("round: leases", sender.expire)
                answered += run("round: replies", inbox.send_replies) or 0
            if answered and self._notifs_progress:  # their READs come now: over TCP a
                run("round: notifications", inbox.handle_notifications)  # GET moves with us
            if self._pusher is not None:  # last: the rest of the round let its WRITEs move
                self._poll_posted(self._pusher, step)
            return True

    def _poll_posted(self, pusher: Pusher, step: bool) -> None:
        """The WRITEs this round posted, polled once more; in the progress thread's round
        (``step=False``) until done, for at most ``POSTED_WAIT_S``, so their push is
        answered in it (never in the engine's step: that wait would be the engine's)."""
        wait_s = 0.0 if step else POSTED_WAIT_S
        self._boundary.run("round: posted pushes", lambda: pusher.poll_posted(wait_s))

    @engine_call
    def wait_for_save(self) -> None:
        """Saves are synchronous here (the forward wrote the blocks); sends were recorded
        in :meth:`start_load_kv`. Kept for the engine-facing API."""
        self._ready()

    @engine_call
    def get_finished(self) -> WorkerOutput:
        receiver, sender = self._ready()
        self._round()
        done, failed, failing = receiver.take_results()
        finished, expired = sender.take_results()
        return WorkerOutput(
            finished_sending=frozenset(finished),
            finished_recving=frozenset(done),
            failed_loads=tuple(failed),
            failing_loads=tuple(failing),
            expired_leases=frozenset(expired),
        )

    @property
    def num_connecting_peers(self) -> int:
        """Peers still being set up: handshakes and NIXL set-ups in flight, and messages
        waiting for a requester's agent to be added (0 when every one is through)."""
        dirs = (self._peers, self._targets)
        awaiting = self._outbox.num_awaiting if self._outbox is not None else 0
        return sum(d.num_connecting for d in dirs if d is not None) + awaiting

    @property
    def num_live_handles(self) -> int:
        """NIXL transfer handles not yet released (0 when idle: a leak shows here)."""
        return int(getattr(self._engine, "num_live_handles", 0))

    @property
    def num_leased_staging_bytes(self) -> int:
        """Staging-slot bytes lent to loads, or held for push rounds prefill has not
        answered yet (0 when idle: a leak shows here)."""
        return self._receiver.num_leased_staging_bytes if self._receiver is not None else 0

    @engine_call
    def readers_done(self, request_id: str) -> tuple[int, ...] | None:
        """Prefill: decode ranks that finished reading a held request (None: not held)."""
        _, sender = self._ready()
        return sender.readers_done(request_id)

    @engine_call
    def abort_send(self, request_id: str) -> None:
        """Prefill: a kept request is dropped (engine abort); restore and forget it (in
        this step's round, or the next one that runs)."""
        self._ready()
        self._pending.append(request_id)
        self._round()

    # -- internals --------------------------------------------------------------------------

    def _release_remote(
        self, receiver: Receiver, request_id: str, params: KVTransferParams, *, ok: bool
    ) -> None:
        """Tell prefill it may free ``params``' blocks, unless another local request
        loads them right now."""
        assert self._outbox is not None
        if receiver.loading_remote(params.remote_request_id):
            logger.info(
                "no Done for prefill request %s from %s: another request here loads it",
                params.remote_request_id,
                request_id,
            )
            return
        self._outbox.queue_done(params, ok=ok)

    def _in_flight(self) -> bool:
        """Whether a peer may be waiting on this worker right now (read without the lock,
        by the progress thread: a stale answer only moves one round). Not while a peer's
        set-up holds or waits for the agent gate (a round would only be deferred), and not
        for loads held in quarantine alone (they wait for a frozen or dead peer: idle
        progress and the engine's steps poll them)."""
        if self._gate.setting_up:
            return False
        sender, receiver, pusher = self._sender, self._receiver, self._pusher
        return bool(
            self._pending
            or (sender is not None and sender.num_pending)
            or (receiver is not None and receiver.num_active)
            or (pusher is not None and pusher.num_inflight)
            or (self._outbox is not None and self._outbox.num_queued)
        )

    def _ready(self) -> tuple[Receiver, Sender]:
        if self._receiver is None or self._sender is None or self._closed:
            raise KVBridgeError("worker connector is not registered or already shut down")
        return self._receiver, self._sender

    def _progress(self) -> int:
        """One round's work; returns how many claims it answered ok."""
        receiver, _ = self._ready()
        side, inbox, outbox = self._side, self._inbox, self._outbox
        assert side is not None and inbox is not None and outbox is not None
        pusher, run = self._pusher, self._boundary.run
        # each stage its own failure boundary (each message, load and push round inside
        # it has its own): one that raises waits for the next round, the rest go on
        run("round: requesters", side.add_requesters)
        answered = run("round: notifications", inbox.handle_notifications) or 0
        if pusher is not None:
            run("round: pushes", pusher.step)
        run("round: loads", receiver.step)
        run("round: outbox", outbox.flush)
        answered += run("round: replies", inbox.send_replies) or 0
        directories = [d for d in (self._peers, self._targets) if d is not None]
        self.metrics.handshakes = sum(d.handshakes for d in directories)
        self.metrics.handshake_failures = sum(d.failures for d in directories)
        self.metrics.peer_states, self.metrics.peer_failures = merged(d.book for d in directories)
        return answered

    # -- teardown ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._idle is not None:
            self._idle.close()  # before the lock: it may be in a round right now
        with self._lock:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        parts = (
            self._receiver,
            self._pusher,
            self._sender,
            self._side,
            self._peers,
            self._targets,
        )
        with self._gate.setup():
            for part in parts:
                if part is not None:
                    part.close()
        if self._setup is not None:  # runs the removals the parts asked for
            self._setup.close()
        if self._engine is not None:
            with self._gate.setup():  # last: the others may still release NIXL handles
                self._engine.close()

    def __enter__(self) -> KVBridgeWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
