"""Faults a worker can inject into itself (``--fault-inject``), so tests and scripts can
show that a check fails when the data is wrong, or that a lost message costs a lease.

- ``corrupt-block``: after the first completed load, flip the sign bit of every element
  of one loaded full-attention block (all layers of group 0); outputs must then differ.
- ``drop-done``: the first ``Done`` notification this worker would send is dropped; the
  prefill must then free that request's blocks when its lease runs out.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvbridge.connector.common.notifications import Done
from kvbridge.examples.engine import Engine
from kvbridge.examples.request import Request

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


FAULTS: dict[str, Callable[[Engine], None]] = {
    "corrupt-block": corrupt_first_loaded_block,
    "drop-done": drop_first_done,
}


def inject(name: str, engine: Engine) -> None:
    FAULTS[name](engine)
