"""Child process for test_nixl_multiprocess.py (a helper script, not a test).

Registers ``num_blocks`` blocks of known bytes, prints one ``@@`` JSON line with its agent
metadata and descriptors, then keeps driving NIXL (no progress thread: ``get_notifs`` is
what progresses) and reports every notification it receives as another ``@@`` line.
Exits when stdin closes (the parent died or is done) or on a ``quit`` line.

    python tests/connector/_nixl_peer.py AGENT_NAME NUM_BLOCKS BLOCK_BYTES SEED
"""

from __future__ import annotations

import base64
import json
import os
import select
import sys

import numpy as np
import torch

from kvbridge.connector.transfer.nixl_engine import NixlEngineConfig, NixlTransferEngine


def block_bytes_of(seed: int, num_blocks: int, block_bytes: int) -> torch.Tensor:
    """The content both sides agree on: one row per block, a seeded random 64-byte stripe
    repeated along it (cheap for large caches, and every block differs)."""
    assert block_bytes % 64 == 0, block_bytes
    gen = torch.Generator().manual_seed(seed)
    stripe = torch.randint(0, 256, (num_blocks, 64), dtype=torch.uint8, generator=gen)
    return stripe.repeat(1, block_bytes // 64)


def _say(**msg: object) -> None:
    sys.stdout.write("@@ " + json.dumps(msg) + "\n")
    sys.stdout.flush()


def main(agent_name: str, num_blocks: int, block_bytes: int, seed: int) -> None:
    cache = block_bytes_of(seed, num_blocks, block_bytes)
    with NixlTransferEngine(NixlEngineConfig(agent_name=agent_name)) as engine:
        engine.register([cache])
        descs = np.zeros((num_blocks, 3), dtype=np.int64)
        descs[:, 0] = cache.data_ptr() + np.arange(num_blocks) * block_bytes
        descs[:, 1] = block_bytes
        _say(
            agent=agent_name,
            pid=os.getpid(),
            metadata=base64.b64encode(engine.metadata()).decode(),
            descs=descs.tolist(),
        )
        while True:
            for sender, msgs in engine.get_notifs().items():
                for msg in msgs:
                    _say(notif_from=sender, notif=msg.decode())
            readable, _, _ = select.select([sys.stdin], [], [], 0.001)
            if readable:
                line = sys.stdin.readline()
                if not line or line.strip() == "quit":
                    return


if __name__ == "__main__":
    name, blocks, size, seed_arg = sys.argv[1:5]
    main(name, int(blocks), int(size), int(seed_arg))
