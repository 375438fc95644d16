"""Faults a worker can inject into itself (``--fault-inject``), so tests and scripts can
show that a check fails when the data is wrong, or that a lost message costs a lease.

- ``corrupt-block``: after the first completed load, flip the sign bit of every element
  of one loaded full-attention block (all layers of group 0); outputs must then differ.
- ``drop-done``: the first ``Done`` notification this worker would send is dropped; the
  prefill must then free that request's blocks when its lease runs out.
- ``freeze-peer-at-<point>`` (a decode worker, its prefill on this machine): the first
  time this worker reaches ``<point>`` of the protocol with a prefill, it stops that
  prefill's process (SIGSTOP; whoever runs the test sends SIGCONT) and then goes on, so
  the step meets a peer frozen exactly there. Points, in protocol order: ``handshake``
  (before asking for its description), ``endpoints`` (description in hand, before NIXL
  adds its agent and creates the endpoints), ``claim`` (before the ``Prepare`` goes out),
  ``read`` (claim answered, before the READ is posted), ``done`` (before the ``Done``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from kvbridge.connector.common.notifications import Done, Prepare
from kvbridge.connector.transfer.transport import XferHandle
from kvbridge.examples.engine import Engine
from kvbridge.examples.request import Request
from kvbridge.handshake.messages import WorkerDescription
from kvbridge.handshake.port_holder import listening_pids

logger = logging.getLogger(__name__)


def corrupt_first_loaded_block(engine: Engine) -> None:
    runner, done = engine.runner, threading.Event()

    def hook(req: Request) -> None:
        if done.is_set() or req.block_ids is None or not req.num_external_tokens:
            return
        block = req.block_ids[0][req.num_cached_tokens // runner.block_size]
        itemsize = runner.kv_config.groups[0].spec.itemsize
        for slot in runner.buffers.unit_slots(0):
            row = slot.units[block].view(-1, itemsize)
            row[:, itemsize - 1] ^= 0x80  # little-endian: the top byte holds the sign
        logger.warning("fault injection: corrupted block %d of request %s", block, req.request_id)
        done.set()

    engine.on_loaded = hook


def drop_first_done(engine: Engine) -> None:
    outbox, dropped = engine.worker._outbox, threading.Event()
    deliver = outbox._deliver  # the one place the worker hands a notification to NIXL

    def lossy(agent: str, msg: object) -> None:
        if isinstance(msg, Done) and not dropped.is_set():
            dropped.set()
            logger.warning("fault injection: dropped %s to %s", msg, agent)
            return  # "sent": lost on the way
        deliver(agent, msg)

    outbox._deliver = lossy  # type: ignore[method-assign]


FREEZE_POINTS = ("handshake", "endpoints", "claim", "read", "done")
STOPPED_TIMEOUT_S = 5.0


def is_stopped(pid: int) -> bool:
    """``pid`` is stopped by a signal (state T in /proc/<pid>/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"


class _PeerFreezer:
    """Stops the prefill found listening on the handshake port this worker asked, once,
    the first time the worker reaches ``point``."""

    def __init__(self, point: str) -> None:
        self.point = point
        self._pid: int | None = None
        self._fired = threading.Event()

    def learn(self, port: int) -> None:
        pids = [p for p in listening_pids(port) if p != os.getpid()]
        if pids and self._pid is None:
            self._pid = pids[0]

    def reached(self, point: str) -> None:
        if point != self.point or self._fired.is_set():
            return
        self._fired.set()
        if self._pid is None:
            logger.error("fault injection: no peer process known to freeze at %s", point)
            return
        os.kill(self._pid, signal.SIGSTOP)
        deadline = time.monotonic() + STOPPED_TIMEOUT_S
        while not is_stopped(self._pid):  # SIGSTOP is delivered asynchronously
            if time.monotonic() > deadline:
                logger.error("fault injection: peer pid %d did not stop", self._pid)
                return
            time.sleep(0.001)
        logger.warning("fault injection: froze peer pid %d at %s", self._pid, point)


def freeze_peer_at(point: str, engine: Engine) -> None:
    worker = engine.worker
    if worker is None:
        raise ValueError("freeze-peer-at-* needs a worker with a KV transfer config")
    freezer = _PeerFreezer(point)
    client, transfer, outbox = worker._side.client, worker._engine, worker._outbox
    get, add_peer, read, deliver = client.get, transfer.add_peer, transfer.read, outbox._deliver

    def asking(engine_id: str, rank: int, host: str, port: int) -> WorkerDescription:
        freezer.learn(port)
        freezer.reached("handshake")
        return get(engine_id, rank, host, port)

    def adding(metadata: bytes) -> str:
        freezer.reached("endpoints")
        return add_peer(metadata)

    def reading(*args: Any, **kwargs: Any) -> XferHandle:
        freezer.reached("read")
        return read(*args, **kwargs)

    def sending(agent: str, msg: object) -> None:
        if isinstance(msg, Prepare):
            freezer.reached("claim")
        elif isinstance(msg, Done):
            freezer.reached("done")
        deliver(agent, msg)

    client.get = asking  # type: ignore[method-assign]
    transfer.add_peer = adding  # type: ignore[method-assign]
    transfer.read = reading  # type: ignore[method-assign]
    outbox._deliver = sending  # type: ignore[method-assign]


FAULTS: dict[str, Callable[[Engine], None]] = {
    "corrupt-block": corrupt_first_loaded_block,
    "drop-done": drop_first_done,
    **{f"freeze-peer-at-{point}": partial(freeze_peer_at, point) for point in FREEZE_POINTS},
}


def inject(name: str, engine: Engine) -> None:
    FAULTS[name](engine)
