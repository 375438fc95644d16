"""Two full connectors (scheduler side + worker side + block pool) in one process.

A tiny stand-in for an engine loop: it calls the connector APIs in the order the
``kvbridge.connector.common.api`` docstring gives, with real NIXL agents and a shared fake clock,
and checks the block pools at the end (every block freed exactly once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvbridge.connector.common.api import SchedulerEvents
from kvbridge.connector.common.config import KVTransferConfig
from kvbridge.connector.common.params import KVTransferParams
from kvbridge.connector.scheduler.scheduler import KVBridgeScheduler
from kvbridge.connector.transfer.transport import TransferEngine
from kvbridge.connector.worker.decode.inflight import describe_source
from kvbridge.connector.worker.device_order import DeviceOrder
from kvbridge.connector.worker.staging.staged_reads import Repacker
from kvbridge.connector.worker.worker import KVBridgeWorker, ModelInfo
from kvbridge.examples.block_pool import BlockPool
from kvbridge.layouts.allocation import CacheFormat, KVCacheBuffers
from kvbridge.layouts.groups import KVCacheConfig
from tests.handshake.plan_harness import make_groups
from tests.verified_loads import is_decode, verifying

MODEL = ModelInfo(model_name="m", dtype="float16", num_kv_heads=2, head_size=4)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: KVTransferParams | None = None
    block_ids: list[list[int]] = field(default_factory=list)


@dataclass
class Side:
    sched: KVBridgeScheduler
    worker: KVBridgeWorker
    pool: BlockPool
    buffers: KVCacheBuffers
    config: KVCacheConfig
    events: list[SchedulerEvents] = field(default_factory=list)
    freed: list[str] = field(default_factory=list)

    def step(self) -> SchedulerEvents:
        self.worker.bind_connector_metadata(self.sched.build_connector_meta())
        self.worker.start_load_kv()
        self.worker.wait_for_save()
        ev = self.sched.update_connector_output(self.worker.get_finished())
        for rid in ev.free_request_ids:
            self.pool.free(self.sched.take_blocks_to_free(rid))
            self.freed.append(rid)
        self.events.append(ev)
        return ev

    def settle(self, timeout_s: float = 10.0) -> None:
        """Wait until the worker's set-up thread ran every job asked for so far (it runs
        them in order): a dropped peer's removal, an agent being added."""
        setup = self.worker._setup
        assert setup is not None
        ran = threading.Event()
        setup.nixl(ran.set)
        assert ran.wait(timeout_s), f"timed out after {timeout_s} s waiting for the set-up thread"

    def allocate(self, num_tokens: int) -> list[list[int]]:
        out = []
        for g in self.config.groups:
            n = -(-num_tokens // g.spec.block_size)
            out.append(self.pool.allocate(n))
        return out


def make_side(
    role: str,
    engine_id: str,
    block_size: int,
    fmt: CacheFormat,
    kinds: str,
    clock: FakeClock,
    *,
    num_blocks: int = 64,
    rewrites_in_place: bool = True,
    repacker: Repacker | None = None,
    repacker_for: Callable[[KVCacheBuffers], Repacker] | None = None,
    device: str = "cpu",
    host_staging: bool | None = None,
    engine_factory: Callable[[str], TransferEngine] | None = None,
    device_order: Callable[[torch.device], DeviceOrder] = DeviceOrder,
    **extra_config: object,
) -> Side:
    """``device``: where the cache lives; ``host_staging``: see ``KVBridgeWorker``;
    ``repacker_for``: builds the engine's repacker on the side's buffers;
    ``engine_factory``: the worker's transfer engine (default: NIXL); ``extra_config``:
    KVTransferConfig fields (a decode verifies every load unless its ``extra`` says
    otherwise: ``tests/verified_loads.py``)."""
    kv = KVCacheConfig.uniform(make_groups(block_size, kinds), num_blocks)
    buffers = KVCacheBuffers(kv, fmt, device)
    for t in buffers.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    if is_decode(role):
        extra_config = verifying(extra_config)
    config = KVTransferConfig.from_dict(
        {
            "kv_role": role,
            "engine_id": engine_id,
            "kv_port": 0,  # ephemeral: handed to the scheduler below
            "handshake_timeout_s": 1.0,
            **extra_config,
        }
    )
    worker = KVBridgeWorker(
        config,
        MODEL,
        clock=clock,
        rewrites_in_place=rewrites_in_place,
        host_staging=host_staging,
        engine_factory=engine_factory,
        device_order=device_order,
    )
    if repacker_for is not None:
        repacker = repacker_for(buffers)
    if repacker is not None:
        worker.set_repacker(repacker)
    worker.register_kv_caches(buffers)
    sched = KVBridgeScheduler(config, kv, clock=clock, wall_clock=clock)
    sched.set_side_channel_ports([worker.side_channel_port])
    return Side(
        sched=sched, worker=worker, pool=BlockPool(kv.num_blocks), buffers=buffers, config=kv
    )


def prefill_finish(side: Side, request: Request) -> KVTransferParams:
    """Prefill ran the prompt; the request ends and its blocks wait for decode."""
    request.block_ids = side.allocate(len(request.prompt_token_ids))
    delay, params = side.sched.request_finished(request, request.block_ids)
    assert delay and params is not None
    side.pool.free(side.sched.take_blocks_to_free(request.request_id))
    return params


def decode_admit(side: Side, request: Request, num_computed: int = 0) -> int:
    """Decode allocates blocks for the prompt and schedules the load; returns tokens."""
    n, _is_async = side.sched.get_num_new_matched_tokens(request, num_computed)
    request.block_ids = side.allocate(len(request.prompt_token_ids))
    side.sched.update_state_after_alloc(request, request.block_ids, n)
    return n


def run_until(
    sides: list[Side], done: Callable[[], bool], what: str, timeout_s: float = 10.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            state = "; ".join(describe(s) for s in sides)
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what} ({state})")
        for s in sides:
            s.step()
        # between steps an engine lets go of the GIL (vLLM's workers wait for the next
        # step in time.sleep(0), kvbridge's engine_step_wait; the example engine on its
        # inbox): a loop that never did left kvbridge's set-up threads the GIL only once
        # per 5 ms switch interval, for each NIXL or ZMQ call, and a first load took
        # 0.4-2.8 s instead of 0.04 s (once over 10 s in CI)
        time.sleep(0)


def describe(side: Side) -> str:
    """Where ``side``'s worker stands, for a timed-out wait: its loads (each source's
    state, as a timed-out load's reason gives it), its peers and its message counters.
    The pair's clock is fake, so a wait on a resend or a deadline never ends here."""
    w = side.worker
    parts = [w.agent_name]
    receiver, peers = w._receiver, w._peers
    if receiver is not None:
        now = w._clock()
        for rid, load in receiver._loads.items():
            states = ", ".join(f"{s.key}: {describe_source(s, now)}" for s in load.sources)
            parts.append(f"load {rid}: {states}")
    if peers is not None:
        parts += [f"peer {k}: {p.state.value} {p.reason}".rstrip() for k, p in peers._peers.items()]
    m = w.metrics
    parts.append(
        f"notifications sent {m.notifications_sent} received {m.notifications_received} "
        f"failed {m.notifications_failed} bad {m.bad_notifications}; claims sent "
        f"{m.claims_sent}; rounds deferred {m.rounds_deferred}; handshakes {m.handshakes} "
        f"failed {m.handshake_failures}"
    )
    return ", ".join(parts)


def loaded(side: Side, rid: str) -> bool:
    return any(rid in ev.loaded_request_ids for ev in side.events)


def failed(side: Side, rid: str) -> list:
    return [f for ev in side.events for f in (*ev.failed, *ev.recompute) if f.request_id == rid]


def token_ids(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 250, n).tolist()
