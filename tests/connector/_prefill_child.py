"""A prefill worker in its own OS process, for test_worker_multiprocess.py (not a test).

It builds a :class:`KVBridgeWorker` (producer) over caches filled with a seeded pattern
(``conftest.fill_buffers``), so the parent can build the same bytes and compute what a
load must deliver. Control is JSON lines: commands on stdin, ``@@``-prefixed events on
stdout (anything else on stdout is NIXL's chatter)::

    -> {"cmd": "send", "request_id": "r1", "block_ids": [[..], ..], "first_block": [..]}
    <- @@ {"event": "kept", "request_id": "r1"}
    <- @@ {"event": "sent", "request_id": "r1"}          (Done arrived, blocks restored)
    -> {"cmd": "digest"}
    <- @@ {"event": "digest", "sha256": "..."}           (of every cache byte)
    -> {"cmd": "held", "request_id": "r1"}
    <- @@ {"event": "held", "readers_done": [0] | null}  (decode ranks done; null: freed)
    -> {"cmd": "freeze_after_write"}
    <- @@ {"event": "armed"}
    <- @@ {"event": "frozen", "descriptors_posted": .., "live_handles": ..}
                      (push mode: once the next WRITEs were posted, before any further NIXL
                       call, the child says so and SIGSTOPs itself; SIGCONT resumes it)

Tensor parallelism: ``rank``, ``tp_size`` and ``total_kv_heads`` in the config make it
rank ``rank`` of a prefill engine (its cache holds that rank's heads; it listens on
``kv_port + rank``, or with ``kv_port`` 0, the default, on an ephemeral port that the
ready event reports). ``rewrites_in_place: false`` makes it an engine that may not rewrite
its blocks for a reader (vLLM: its prefix cache), read in its native arrangement.

The first event is ``{"event": "ready", "port": .., "agent": .., "pid": ..}``. The child
drives its worker (``get_finished``) between commands and exits on ``quit`` or when
stdin closes, so a dead parent never leaves it behind.

    python tests/connector/_prefill_child.py '{"engine_id": "P", "block_size": 64, ...}'
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import sys
import traceback
from dataclasses import dataclass, replace

from kvbridge.connector.common.metadata import ConnectorMetadata, SendSpec
from kvbridge.connector.worker.worker import KVBridgeWorker
from kvbridge.handshake.tp import rank_heads
from kvbridge.layouts.layout import KVLayout, KVPacking
from tests.connector.conftest import (
    MODEL,
    SideFormat,
    fill_buffers,
    make_buffers,
    transfer_config,
)


def side_format(cfg: dict) -> SideFormat:
    return SideFormat(
        block_size=cfg["block_size"],
        layout=KVLayout(cfg.get("layout", "NHD")),
        cross_layer=cfg.get("cross_layer", False),
        packing=KVPacking(cfg.get("packing", "blocks_first")),
        kernel_block_size=cfg.get("kernel_block_size"),
        block_packing=cfg.get("block_packing", ""),
        packed_heads_major=cfg.get("packed_heads_major", False),
        kv_interleaved=cfg.get("kv_interleaved", False),
    )


def _say(**event: object) -> None:
    sys.stdout.write("@@ " + json.dumps(event) + "\n")
    sys.stdout.flush()


@dataclass
class _Freeze:
    """``freeze_after_write``: the descriptor count that, once exceeded, stops the child."""

    armed_at: int | None = None


def _handle(worker: KVBridgeWorker, buffers, freeze: _Freeze, line: str) -> bool:
    """Run one command; False to stop."""
    cmd = json.loads(line)
    match cmd["cmd"]:
        case "send":
            spec = SendSpec(
                request_id=cmd["request_id"],
                block_ids=tuple(tuple(ids) for ids in cmd["block_ids"]),
                first_block=tuple(cmd["first_block"]),
                lease_s=float(cmd.get("lease_s", 30.0)),
            )
            worker.bind_connector_metadata(ConnectorMetadata(reqs_to_send=(spec,)))
            worker.start_load_kv()
            _say(event="kept", request_id=spec.request_id)
        case "held":
            done = worker.readers_done(cmd["request_id"])
            _say(event="held", readers_done=None if done is None else list(done))
        case "digest":
            digest = hashlib.sha256()
            for t in buffers.tensors:
                digest.update(t.numpy().tobytes())
            _say(event="digest", sha256=digest.hexdigest())
        case "freeze_after_write":
            freeze.armed_at = worker.metrics.descriptors_posted
            _say(event="armed")
        case "quit":
            return False
        case other:
            _say(event="error", reason=f"unknown command {other!r}")
    return True


def main(cfg: dict) -> None:
    rank, tp_size = cfg.get("rank", 0), cfg.get("tp_size", 1)
    total = cfg.get("total_kv_heads", MODEL.num_kv_heads)
    heads = rank_heads(rank, tp_size, total).count
    pp_rank, pp_layers = cfg.get("pp_rank", 0), [tuple(s) for s in cfg.get("pp_layers", [])]
    layers = range(*pp_layers[pp_rank]) if pp_layers else (0, 1)
    buffers = make_buffers(
        side_format(cfg),
        cfg["kinds"],
        cfg["num_blocks"],
        heads,
        tp_size=tp_size,
        layers=layers,
        group_layers=cfg.get("group_layers"),
    )
    fill_buffers(buffers, cfg["seed"])
    config = transfer_config(
        "kv_producer",
        cfg["engine_id"],
        kv_port=cfg.get("kv_port", 0),
        extra={"transfer_mode": cfg.get("transfer_mode", "pull")},
    )
    model = replace(MODEL, num_kv_heads=total)
    with KVBridgeWorker(
        config,
        model,
        rank=rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_layers=pp_layers,
        rewrites_in_place=cfg.get("rewrites_in_place", True),
    ) as worker:
        worker.register_kv_caches(buffers)
        _say(event="ready", port=worker.side_channel_port, agent=worker.agent_name, pid=os.getpid())
        try:
            _serve(worker, buffers)
        except Exception as exc:
            # said before the worker shuts down (its pushes then fail "shut down"), so the
            # cause reaches the log even when the parent kills this process meanwhile
            traceback.print_exc()
            sys.stderr.flush()
            _say(event="error", reason=f"{type(exc).__name__}: {exc}")
            raise


def _serve(worker: KVBridgeWorker, buffers) -> None:
    freeze = _Freeze()
    while True:
        out = worker.get_finished()
        for rid in sorted(out.finished_sending):
            _say(event="sent", request_id=rid, expired=rid in out.expired_leases)
        _freeze_if_written(worker, freeze)
        # waiting on stdin for 1 ms paces the loop (no busy core); it is not a sync
        readable, _, _ = select.select([sys.stdin], [], [], 0.001)
        if readable:
            line = sys.stdin.readline()
            if not line or not _handle(worker, buffers, freeze, line):
                return


def _freeze_if_written(worker: KVBridgeWorker, freeze: _Freeze) -> None:
    """Armed, and a push posted its WRITEs in this step: stop here, before the next NIXL
    call could see them complete (this worker has no progress thread, so nothing in this
    process moves them on while it is stopped)."""
    posted = worker.metrics.descriptors_posted
    if freeze.armed_at is None or posted <= freeze.armed_at:
        return
    freeze.armed_at = None
    _say(event="frozen", descriptors_posted=posted, live_handles=worker.num_live_handles)
    os.kill(os.getpid(), signal.SIGSTOP)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
