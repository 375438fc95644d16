"""Staged prefill workers for test_host_buffer_pair.py, in one OS process of their own.

The JSON-lines protocol of ``kvbridge.examples.vllm.prefill_child`` (driven by its
``PrefillHost``), where ``open`` takes a ``staged_peer.StagedSpec`` as a dict and builds
the side with ``staged_peer.staged_side`` (host staging, vLLM's copy operation recorded),
plus one command::

    -> {"cmd": "calls", "key": "k"}
    <- @@ {"event": "calls", "key": "k", "path": "vllm", "calls": [[direction, [ids]], ..]}

    python -m tests.connector.vllm._staged_prefill
"""

from __future__ import annotations

import json
import select
import sys
import traceback

from kvbridge.connector.common.metadata import ConnectorMetadata, SendSpec
from kvbridge.connector.vllm.step_metadata import KVBridgeMetadata
from kvbridge.connector.vllm.worker_side import VLLMWorkerSide
from tests.connector.vllm.staged_peer import StagedSpec, staged_cache, staged_side
from tests.connector.vllm.vllm_copy_ops import RecordingCopyOp


def _say(**event: object) -> None:
    sys.stdout.write("@@ " + json.dumps(event) + "\n")
    sys.stdout.flush()


class Sides:
    """The open prefill sides, each with its recorded copy operation."""

    def __init__(self) -> None:
        self.sides: dict[str, tuple[VLLMWorkerSide, RecordingCopyOp]] = {}

    def command(self, cmd: dict) -> None:
        key = cmd.get("key", "")
        if cmd["cmd"] == "open":
            cache = staged_cache(StagedSpec.from_dict(cmd["spec"]), cmd["seed"])
            self.sides[key] = staged_side(cache, "kv_producer", cmd["engine_id"], cmd["mode"])
            _say(event="ready", key=key, port=self.sides[key][0].worker.side_channel_port)
        elif cmd["cmd"] == "send":
            send = SendSpec(
                request_id=cmd["request_id"],
                block_ids=tuple(tuple(ids) for ids in cmd["block_ids"]),
                first_block=tuple(cmd["first_block"]),
                lease_s=30.0,
            )
            side = self.sides[key][0]
            side.bind(KVBridgeMetadata(ConnectorMetadata(reqs_to_send=(send,))))
            side.start_load_kv()
            side.wait_for_save()
            _say(event="kept", key=key, request_id=send.request_id)
        elif cmd["cmd"] == "calls":
            side, op = self.sides[key]
            calls = [[c.direction, list(c.src_block_ids)] for c in op.calls]
            _say(event="calls", key=key, path=side.host_copy_path, calls=calls)
        elif cmd["cmd"] == "close":
            self.sides.pop(key)[0].shutdown()
            _say(event="closed", key=key)
        else:
            raise ValueError(f"unknown command {cmd['cmd']!r}")

    def step(self) -> None:
        for key, (side, _) in self.sides.items():
            sending, _, _ = side.transfer_results()
            for rid in sorted(sending):
                _say(event="sent", key=key, request_id=rid)

    def close(self) -> None:
        for side, _ in self.sides.values():
            side.shutdown()


def main() -> None:
    sides = Sides()
    _say(event="started")
    try:
        while True:
            sides.step()
            # waiting on stdin for 1 ms paces the loop (no busy core); it is not a sync
            if not select.select([sys.stdin], [], [], 0.001)[0]:
                continue
            line = sys.stdin.readline()
            if not line or json.loads(line)["cmd"] == "quit":
                return
            sides.command(json.loads(line))
    except Exception as exc:
        traceback.print_exc()
        _say(event="error", reason=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        sides.close()


if __name__ == "__main__":
    main()
