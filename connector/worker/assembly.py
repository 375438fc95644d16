"""A worker's parts, built and wired together when the engine registers its KV caches.

:class:`~kvbridge.connector.worker.worker.KVBridgeWorker` is the engine-facing facade; this
module builds what it drives, in the order their dependencies need::

    host stage        a host mirror of the cache, when the cache is not where NIXL moves
    transfer engine   the NIXL agent (on no engine-pinned core), its calls gated
    set-up thread     kvbridge's own threads, started before the engine lowers its priority
    staging slots     registered before the description when prefill pushes into them
    side channel      this worker's description and listener; the peer directories
    outbox, inbox     what leaves for peers, and what arrives from them
    roles             sender (+ pusher in push mode) for prefill, receiver for decode

A part that fails to build closes the ones built before it: a worker whose registration
failed holds no agent, thread or listener.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbridge.connector.common.config import FailurePolicy, ReadProbeMode
from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.connector.worker.agent_gate import AgentGate
from kvbridge.connector.worker.boundary import Boundary
from kvbridge.connector.worker.decode.inflight import PushEndpoint
from kvbridge.connector.worker.decode.landing import Verifier
from kvbridge.connector.worker.decode.packed_reads import PackedReads
from kvbridge.connector.worker.decode.receiver import Receiver
from kvbridge.connector.worker.digests import region_units
from kvbridge.connector.worker.inbox import Inbox
from kvbridge.connector.worker.outbox import Outbox
from kvbridge.connector.worker.peer_setup import PeerSetup
from kvbridge.connector.worker.peers import PeerDirectory
from kvbridge.connector.worker.prefill.gather_arena import PAGE_BYTES, GatherArena, open_arena
from kvbridge.connector.worker.prefill.pushes import Pusher
from kvbridge.connector.worker.prefill.reader_digests import ReaderDigests
from kvbridge.connector.worker.prefill.sender import Sender
from kvbridge.connector.worker.read_probe import ReadProbe
from kvbridge.connector.worker.side_channel import SideChannel
from kvbridge.connector.worker.staging.arenas import StagingPools, slot_region
from kvbridge.connector.worker.staging.host_stage import HostStage, host_stage_for
from kvbridge.handshake.affinity import unpinned
from kvbridge.handshake.description import WorkerIdentity, parse_description
from kvbridge.handshake.modes import TransferMode
from kvbridge.layouts.allocation import KVCacheBuffers

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

    from kvbridge.connector.common.config import KVTransferConfig
    from kvbridge.connector.common.metrics import ConnectorMetrics
    from kvbridge.connector.worker.device_order import DeviceOrder
    from kvbridge.connector.worker.routing import Router
    from kvbridge.connector.worker.staging.engine_copies import EngineCopies
    from kvbridge.connector.worker.staging.staged_reads import Repacker


@dataclass(frozen=True, kw_only=True)
class Wiring:
    """What the worker was constructed with that its parts need (``KVBridgeWorker``'s
    arguments and settings, one field each)."""

    config: KVTransferConfig
    identity: WorkerIdentity
    router: Router
    gate: AgentGate
    metrics: ConnectorMetrics
    clock: Callable[[], float]
    engine_factory: Callable[[str], TransferEngine]
    device_order: Callable[[torch.device], DeviceOrder]
    repacker: Repacker | None
    engine_copies: Callable[[KVCacheBuffers], EngineCopies | str] | None
    host_staging: bool | None
    rewrites_in_place: bool
    rewrite_on_save: bool


@dataclass(kw_only=True)
class WorkerParts:
    """What a registered worker drives (``targets`` and ``pusher``: push mode only)."""

    engine: TransferEngine
    setup: PeerSetup
    stage: HostStage | None
    side: SideChannel
    peers: PeerDirectory
    targets: PeerDirectory | None
    outbox: Outbox
    inbox: Inbox
    sender: Sender
    pusher: Pusher | None
    receiver: Receiver
    boundary: Boundary


def stages_pages(w: Wiring, buffers: KVCacheBuffers, mode: TransferMode) -> bool:
    """A decode in ``mode`` whose engine repacks packed pages: prefill's larger (or
    non-dividing) pages land in its staging slots (read there in pull mode, written there
    by prefill in push mode)."""
    return (
        w.config.extra.transfer_mode is mode
        and w.config.is_consumer
        and w.repacker is not None
        and bool(buffers.format.block_packing)
    )


def read_probe_for(
    w: Wiring, engine: TransferEngine, setup: PeerSetup, moved: KVCacheBuffers
) -> ReadProbe | None:
    """A pulling decode's probe of each new peer (``extra.read_probe``; ``auto``: when
    what NIXL moves, ``moved``, is GPU memory), run by ``setup``'s set-up thread."""
    extra = w.config.extra
    if not w.config.is_consumer or extra.transfer_mode is not TransferMode.PULL:
        return None
    if extra.read_probe is ReadProbeMode.OFF:
        return None
    if extra.read_probe is ReadProbeMode.AUTO and moved.device.type != "cuda":
        return None
    return ReadProbe(
        engine, moved.device, w.metrics, pause=w.gate.paused, stopping=lambda: setup.closing
    )


def assemble(w: Wiring, buffers: KVCacheBuffers) -> WorkerParts:
    """Build a worker's parts for ``buffers``, under the agent gate. When a part fails,
    what was built before it is closed as a shutdown closes it: the gate released first
    (the set-up thread's jobs take it, and closing joins that thread), the side channel
    and the engine under the gate again; a close that fails is logged, and the error that
    stopped the build is the one raised."""
    with contextlib.ExitStack() as built:
        with w.gate.setup():
            parts = _assemble(w, buffers, built)
        built.pop_all()
        return parts


def _close(what: str, close: Callable[[], None], gate: AgentGate | None) -> None:
    """Close one part of a build that failed; never raise over the build's own error."""
    try:
        if gate is None:
            close()
        else:
            with gate.setup():
                close()
    except Exception:
        logger.exception("kvbridge: closing %s after a failed registration failed", what)


def _assemble(w: Wiring, buffers: KVCacheBuffers, built: contextlib.ExitStack) -> WorkerParts:
    config, extra, metrics = w.config, w.config.extra, w.metrics
    mode = extra.transfer_mode
    stage = host_stage_for(
        config.kv_buffer_device,
        buffers,
        metrics,
        forced=w.host_staging,
        repacks=w.repacker is not None,
        engine_copies=w.engine_copies,
    )
    moved = stage.host_buffers if stage is not None else buffers
    with unpinned():  # NIXL/UCX helper threads must not share an engine-pinned core
        engine = w.engine_factory(w.identity.agent_name)
    built.callback(_close, "the NIXL engine", engine.close, w.gate)
    if hasattr(engine, "guard"):  # every NIXL call from now on checks the gate
        engine.guard = w.gate.held
    # kvbridge's own threads: started now, before the engine lowers its step thread's
    # priority (a thread inherits its creator's), on every core
    with unpinned():
        setup = PeerSetup(engine, w.gate)
    built.callback(_close, "the set-up threads", setup.close, None)
    engine.register(moved.tensors)
    staging = StagingPools(engine, extra.staging_bytes, device=buffers.device)
    # packed reads: registered before the description, which advertises it to readers
    gather = None
    if extra.gather_bytes:
        gather = open_arena(engine, extra.gather_bytes, moved.device)
    if stages_pages(w, buffers, TransferMode.PUSH):
        # prefill writes whole pages into these slots: registered before the
        # description, so the NIXL metadata prefill gets in the handshake covers them
        staging.open()
    side = SideChannel(
        config,
        w.identity,
        moved,
        engine,
        setup,
        rewrites_in_place=w.rewrites_in_place,
        transfer_mode=mode,
        can_repack=w.repacker is not None,
        rewrites_on_save=w.rewrite_on_save,
        staging=staging.region,
        gather=slot_region(gather.region, PAGE_BYTES) if gather is not None else None,
    )
    built.callback(_close, "the side channel", side.close, w.gate)
    if stages_pages(w, buffers, TransferMode.PULL):
        # pull: larger prefill pages land in these slots. Allocated and registered now, on
        # the engine's thread at startup, not inside the first such load
        # (docs/handover.md); after the description, which advertises slots only to
        # pushing prefills
        staging.open()
    probe = read_probe_for(w, engine, setup, moved)
    peers = side.directory(can_repack=w.repacker is not None, probe=probe)
    order = w.device_order(buffers.device)
    outbox = Outbox(engine, peers, w.router, metrics, ensure_agent=side.ensure_agent)
    units = region_units(moved)  # where NIXL moves from and to: digests read them there
    digests = ReaderDigests(parse_description(side.description), units, side.agents.layout)
    packer = None if gather is None else GatherArena(engine, gather, units, digests, order, metrics)
    boundary = Boundary(metrics)  # one failure boundary per message, order and round stage
    sender = Sender(
        buffers,
        metrics,
        clock=w.clock,
        rewrites_in_place=w.rewrites_in_place,
        rewrite_on_save=w.rewrite_on_save,
        stage=stage,
        order=order,
        # a Prepare or Push may come before the engine hands this worker the request (its
        # next step, seconds away under load): wait for it as long as the lease
        early_wait_s=config.lease_s,
        digests=digests,
        gather=packer,
        boundary=boundary,
    )
    targets = pusher = push = None
    if mode is TransferMode.PUSH:
        targets = side.directory(writer=True)
        pusher = Pusher(
            engine,
            targets,
            sender,
            metrics,
            outbox.send_raw,
            clock=w.clock,
            digests=digests,
            gather=packer,
            boundary=boundary,
        )
        push = PushEndpoint(config.engine_id, w.router.engine_rank, config.kv_ip, side.port)
    receiver = Receiver(
        engine,
        peers,
        buffers,
        metrics,
        outbox.send,
        timeout_s=config.transfer_timeout_s,
        clock=w.clock,
        repacker=w.repacker,
        staging=staging,
        router=w.router,
        notify=outbox.queue_to,
        push=push,
        stage=stage,
        order=order,
        verifier=Verifier(extra.verify, extra.verify_rate, moved, units, metrics)
        if config.is_consumer
        else None,
        max_quarantined_bytes=extra.max_quarantined_bytes,
        fail_early=config.failure_policy is FailurePolicy.FAIL,
        packed=PackedReads(engine, gather, PAGE_BYTES, moved, units, order, metrics)
        if gather is not None and config.is_consumer
        else None,
        boundary=boundary,
    )
    inbox = Inbox(
        engine, outbox, metrics, sender=sender, receiver=receiver, pusher=pusher, boundary=boundary
    )
    for host, peer_port in extra.warm_peer_addresses:
        if config.is_consumer:
            peers.warm(host, peer_port)
        elif targets is not None:
            targets.warm(host, peer_port)
    return WorkerParts(
        engine=engine,
        setup=setup,
        stage=stage,
        side=side,
        peers=peers,
        targets=targets,
        outbox=outbox,
        inbox=inbox,
        sender=sender,
        pusher=pusher,
        receiver=receiver,
        boundary=boundary,
    )
