"""One side of ``test_black_hole.py``, run in its own network namespace: a kvbridge NIXL
engine (as a worker builds it) with a small registered buffer.

``p``: writes its agent metadata to ``DIR/p.md``, prints ``kvb:ready``, and waits for stdin
to close. ``d``: reads ``DIR/p.md``, prints ``kvb:ready``, waits for a ``go`` line, then adds
p's agent (or, with a third argument ``remove``, removes p's agent, added, connected and sent
a message before) and prints ``kvb:`` and one JSON object: the seconds the call took
(``op_s``) and its error, if any. (``kvb:`` sets these lines apart from NIXL's log lines on stdout.)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from kvbridge.connector.worker.nixl_setup import nixl_engine


def main() -> None:
    side, folder = sys.argv[1], Path(sys.argv[2])
    engine = nixl_engine(f"blackhole-{side}-{time.monotonic_ns()}", shared=True)
    engine.register([torch.zeros(1 << 16, dtype=torch.uint8)])
    if side == "p":
        (folder / "p.md.tmp").write_bytes(engine.metadata())
        (folder / "p.md.tmp").rename(folder / "p.md")
        print("kvb:ready", flush=True)
        sys.stdin.read()
        return
    metadata = (folder / "p.md").read_bytes()
    op = sys.argv[3] if len(sys.argv) > 3 else "add"
    peer = ""
    if op == "remove":  # a live connection first: added, connected, a message sent
        peer = engine.add_peer(metadata)
        engine.connect(peer)
        engine.send_notif(peer, b"hello")
    print("kvb:ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    start, error = time.monotonic(), ""
    try:
        if op == "remove":
            engine.remove_peer(peer)
        else:
            engine.add_peer(metadata)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    print("kvb:" + json.dumps({"op_s": time.monotonic() - start, "error": error}), flush=True)


if __name__ == "__main__":
    main()
