"""Launching real server processes: a prefill, a decode and the proxy, each in its own
process group on 127.0.0.1 with free ports (fault tests, the soak script). Every wait has
a deadline; ``close()`` kills whatever is left (SIGCONT first, so a stopped process can
die)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvbridge.examples.check import complete, http_get, parse_metrics

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-hybrid-state"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    argv: list[str]
    url: str
    log: Path
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole group (no shutdown path runs) and reap it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, (
                f"{self.name} exited ({self.proc.returncode if self.proc else '?'}):\n{self.tail()}"
            )
            try:
                if http_get(self.url + "/health", timeout_s=1.0)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{self.name} not healthy within {timeout_s} s:\n{self.tail()}")

    def metrics(self) -> dict[str, float]:
        return parse_metrics(http_get(self.url + "/metrics", timeout_s=5.0)[1].decode())

    def free_blocks(self) -> tuple[float, float]:
        m = self.metrics()
        return m['kvbridge_free_blocks{pool="kv"}'], m['kvbridge_total_blocks{pool="kv"}']

    def wait_all_free(self, timeout_s: float) -> None:
        """Until /metrics shows every block free (leases and Done notifications lag)."""
        deadline = time.monotonic() + timeout_s
        while True:
            free, total = self.free_blocks()
            if free == total:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.name}: {total - free:.0f} blocks still in use after {timeout_s} s"
                )
            time.sleep(0.1)

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def worker_args(
    role: str,
    kv: dict,
    block_size: int,
    *extra: str,
    model: str = MODEL,
    device: str | torch.device = "cpu",
) -> list[str]:
    """``kvbridge.examples.server`` arguments of a tiny-model worker with a KV connector; ``device``
    is passed on as ``--device`` (the server checks it)."""
    return [
        "--role",
        role,
        "--model",
        model,
        "--block-size",
        str(block_size),
        "--num-blocks",
        "128",
        "--device",
        str(device),
        "--kv-transfer-config",
        json.dumps(kv),
        *extra,
    ]


@dataclass
class Cluster:
    """Prefill (block ``prefill_block_size``, ``prefill_kv``), decode (block
    ``decode_block_size``, ``decode_kv``) of ``model`` on ``device``, and a proxy."""

    logs: Path
    prefill_kv: dict = field(default_factory=dict)
    decode_kv: dict = field(default_factory=dict)
    decode_args: list[str] = field(default_factory=list)
    prefill_args: list[str] = field(default_factory=list)
    procs: dict[str, Proc] = field(default_factory=dict)
    model: str = MODEL
    device: str | torch.device = "cpu"
    prefill_block_size: int = 32
    decode_block_size: int = 16

    def __post_init__(self) -> None:
        p_port, d_port, x_port = free_port(), free_port(), free_port()
        prefill_kv = {
            "kv_role": "kv_producer",
            "engine_id": "prefill-fault",
            "kv_port": free_port(),
            **self.prefill_kv,
        }
        decode_kv = {
            "kv_role": "kv_consumer",
            "engine_id": "decode-fault",
            "kv_port": free_port(),
            "handshake_timeout_s": 1.0,
            **self.decode_kv,
        }
        urls = {n: f"http://127.0.0.1:{p}" for n, p in (("p", p_port), ("d", d_port))}
        self.procs = {
            "prefill": Proc(
                "prefill",
                self._worker_argv(
                    "prefill", p_port, prefill_kv, self.prefill_block_size, self.prefill_args
                ),
                urls["p"],
                self.logs / "prefill.log",
            ),
            "decode": Proc(
                "decode",
                self._worker_argv(
                    "decode", d_port, decode_kv, self.decode_block_size, self.decode_args
                ),
                urls["d"],
                self.logs / "decode.log",
            ),
            "proxy": Proc(
                "proxy",
                [
                    sys.executable,
                    "-m",
                    "kvbridge.examples.proxy",
                    "--port",
                    str(x_port),
                    "--prefill",
                    urls["p"],
                    "--decode",
                    urls["d"],
                    "--timeout",
                    "60",
                ],
                f"http://127.0.0.1:{x_port}",
                self.logs / "proxy.log",
            ),
        }

    def _worker_argv(
        self, role: str, port: int, kv: dict, block_size: int, extra: list[str]
    ) -> list[str]:
        server = [sys.executable, "-m", "kvbridge.examples.server", "--port", str(port)]
        args = worker_args(role, kv, block_size, model=self.model, device=self.device)
        return server + args + extra

    def __getitem__(self, name: str) -> Proc:
        return self.procs[name]

    def start(self) -> Cluster:
        for p in self.procs.values():
            p.start()
        for p in self.procs.values():
            p.wait_healthy()
        return self

    def restart(self, name: str) -> None:
        self.procs[name].kill()
        self.procs[name].start()
        self.procs[name].wait_healthy()

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()

    def complete(self, name: str, body: dict, timeout_s: float = 60.0) -> dict:
        return complete(self.procs[name].url, body, timeout_s)
