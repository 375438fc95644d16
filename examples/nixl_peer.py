"""A NIXL peer in its own process, for tests and experiments that need a real remote agent.

The child (this module run as a script) registers ``num_blocks`` blocks of known bytes,
prints one ``@@`` JSON line with its agent metadata and descriptors, then keeps driving
NIXL (no progress thread: ``get_notifs`` is what progresses) and reports every notification
it receives as another ``@@`` line. It exits when stdin closes (the parent died or is done)
or on a ``quit`` line::

    python -m kvbridge.examples.nixl_peer AGENT_NAME NUM_BLOCKS BLOCK_BYTES SEED

:class:`Peer` starts one from the parent and speaks that line protocol
(``tests/connector/test_nixl_multiprocess.py``,
``scripts/experiments/measure_frozen_peer.py``).
"""

from __future__ import annotations

import base64
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

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


TIMEOUT_S = 10.0  # a child's answer, and its exit once killed


class Peer:
    """One child process and the line protocol to it."""

    def __init__(
        self, agent_name: str, seed: int, log: Path, num_blocks: int, block_bytes: int
    ) -> None:
        self.agent_name = agent_name
        self.seed = seed
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvbridge.examples.nixl_peer",
                agent_name,
                str(num_blocks),
                str(block_bytes),
                str(seed),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        self._buf = b""
        hello = self.next_msg()
        self.metadata = base64.b64decode(hello["metadata"])
        self.descs = np.array(hello["descs"], dtype=np.int64)
        if hello["agent"] != agent_name or hello["pid"] != self.proc.pid:
            raise RuntimeError(f"child {agent_name} introduced itself as {hello}")

    def next_msg(self, timeout_s: float = TIMEOUT_S) -> dict:
        """The next ``@@`` line as JSON; other output (NIXL logging) is skipped."""
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None  # stdout=PIPE
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.startswith(b"@@ "):
                    return json.loads(line[3:])
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"child {self.agent_name} said nothing within {timeout_s} s")
            readable, _, _ = select.select([fd], [], [], left)
            if readable:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"child {self.agent_name} exited: rc={self.proc.poll()}")
                self._buf += chunk

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=TIMEOUT_S)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._log.close()


if __name__ == "__main__":
    name, blocks, size, seed_arg = sys.argv[1:5]
    main(name, int(blocks), int(size), int(seed_arg))
