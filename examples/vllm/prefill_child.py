"""Prefill vLLM workers' connectors in one OS process (``prefill_host.PrefillHost``).

Each ``open`` builds one prefill rank: vLLM's allocation (``layout_peer.build_allocation``)
filled with seeded bytes, registered through the adapter's
``VLLMWorkerSide.register_kv_caches`` (its own NIXL agent and side channel). One process
serves the whole test module, so vLLM is imported once. JSON lines on stdin,
``@@``-prefixed events on stdout (anything else there is NIXL's)::

    <- @@ {"event": "started"}
    -> {"cmd": "open", "key": "k", "spec": {..}, "engine_id": "P-1", "mode": "pull", "seed": 1}
    <- @@ {"event": "ready", "key": "k", "port": ..}
    -> {"cmd": "send", "key": "k", "request_id": "r1", "block_ids": [[..]], "first_block": [0]}
    <- @@ {"event": "kept", "key": "k", "request_id": "r1"}
    <- @@ {"event": "sent", "key": "k", "request_id": "r1"}   (decode is done with the blocks)
    -> {"cmd": "close", "key": "k"}
    <- @@ {"event": "closed", "key": "k"}
    -> {"cmd": "quit"}

It drives every worker (``transfer_results``) between commands and exits when stdin
closes, shutting each worker down.

    python -m kvbridge.examples.vllm.prefill_child
"""

from __future__ import annotations

import json
import select
import sys
import traceback

from kvbridge.connector.common.metadata import ConnectorMetadata, SendSpec
from kvbridge.connector.vllm.worker_side import VLLMWorkerSide
from kvbridge.examples.vllm.layout_peer import SideSpec, bind, build_allocation, fill, worker_side


def _say(**event: object) -> None:
    sys.stdout.write("@@ " + json.dumps(event) + "\n")
    sys.stdout.flush()


def _handle(sides: dict[str, VLLMWorkerSide], cmd: dict) -> None:
    key = cmd.get("key", "")
    match cmd["cmd"]:
        case "open":
            spec = SideSpec(**cmd["spec"])
            a = build_allocation(spec)
            fill(a, cmd["seed"])
            side = worker_side(spec, a, "kv_producer", cmd["engine_id"], cmd["mode"])
            sides[key] = side
            _say(event="ready", key=key, port=side.worker.side_channel_port)
        case "send":
            send = SendSpec(
                request_id=cmd["request_id"],
                block_ids=tuple(tuple(ids) for ids in cmd["block_ids"]),
                first_block=tuple(cmd["first_block"]),
                lease_s=30.0,
            )
            bind(sides[key], ConnectorMetadata(reqs_to_send=(send,)))
            _say(event="kept", key=key, request_id=send.request_id)
        case "close":
            sides.pop(key).shutdown()
            _say(event="closed", key=key)
        case other:
            raise ValueError(f"unknown command {other!r}")


def main() -> None:
    sides: dict[str, VLLMWorkerSide] = {}
    _say(event="started")
    try:
        while True:
            for key, side in list(sides.items()):
                sending, _, _ = side.transfer_results()
                for rid in sorted(sending):
                    _say(event="sent", key=key, request_id=rid)
            # waiting on stdin for 1 ms paces the loop (no busy core); it is not a sync
            readable, _, _ = select.select([sys.stdin], [], [], 0.001)
            if not readable:
                continue
            line = sys.stdin.readline()
            if not line:
                return
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                return
            _handle(sides, cmd)
    except Exception as exc:
        traceback.print_exc()
        _say(event="error", reason=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        for side in sides.values():
            side.shutdown()


if __name__ == "__main__":
    main()
