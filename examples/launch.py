"""Launching real server processes: a prefill, a decode and vllm-router in front of them
(``examples/router.py``), each in its own process group on 127.0.0.1 (fault tests, the soak
script). Every worker binds port 0 (HTTP and side channel) and reports what it got in its
ready file (``examples/ready.py``); the router's launcher holds the ports it hands the
router until the router bound them. Every wait has a deadline; ``close()``
kills whatever is left (SIGCONT first, so a stopped process can die)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvbridge.examples.check import complete, http_get, scrape
from kvbridge.examples.ready import wait_ready_file

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-hybrid-state"


@dataclass
class Proc:
    """A server started with ``--port 0 --ready-file``: ``url`` (and ``ready``, the whole
    record) are known once :meth:`wait_ready` read the file."""

    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    url: str = ""
    ready: dict = field(default_factory=dict)

    @property
    def ready_file(self) -> Path:
        return self.log.with_suffix(".ready.json")

    def start(self) -> None:
        self.ready_file.unlink(missing_ok=True)
        self.url, self.ready = "", {}
        argv = [*self.argv, "--ready-file", str(self.ready_file)]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until the server bound its ports and said which (raises naming why not)."""
        proc = self.proc
        assert proc is not None
        try:
            self.ready = wait_ready_file(
                self.ready_file, timeout_s, alive=lambda: proc.poll() is None
            )
        except (TimeoutError, RuntimeError) as exc:
            raise AssertionError(f"{self.name}: {exc}:\n{self.tail()}") from None
        self.url = self.ready["url"]

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
        if not self.url:
            self.wait_ready(timeout_s)
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
        return scrape(self.url)

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
    ``decode_block_size``, ``decode_kv``) of ``model`` on ``device``, and vllm-router in
    P/D mode in front of them."""

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
        prefill_kv = {
            "kv_role": "kv_producer",
            "engine_id": "prefill-fault",
            "kv_port": 0,  # the bound port reaches the params (and the ready file)
            **self.prefill_kv,
        }
        decode_kv = {
            "kv_role": "kv_consumer",
            "engine_id": "decode-fault",
            "kv_port": 0,
            "handshake_timeout_s": 1.0,
            **self.decode_kv,
        }
        self.procs = {
            "prefill": Proc(
                "prefill",
                self._worker_argv(prefill_kv, self.prefill_block_size, self.prefill_args),
                self.logs / "prefill.log",
            ),
            "decode": Proc(
                "decode",
                self._worker_argv(decode_kv, self.decode_block_size, self.decode_args),
                self.logs / "decode.log",
            ),
            "router": Proc("router", [], self.logs / "router.log"),
        }

    def _worker_argv(self, kv: dict, block_size: int, extra: list[str]) -> list[str]:
        server = [sys.executable, "-m", "kvbridge.examples.server", "--port", "0"]
        args = worker_args(
            "prefill" if kv["kv_role"] == "kv_producer" else "decode",
            kv,
            block_size,
            model=self.model,
            device=self.device,
        )
        return server + args + extra

    def _router_argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kvbridge.examples.router",
            "--prefill",
            self.procs["prefill"].url,
            "--decode",
            self.procs["decode"].url,
            "--health-check-interval",
            "1",
        ]

    def __getitem__(self, name: str) -> Proc:
        return self.procs[name]

    def start(self) -> Cluster:
        """The workers, then (their URLs known) the router; each healthy."""
        workers = [self.procs["prefill"], self.procs["decode"]]
        for p in workers:
            p.start()
        for p in workers:
            p.wait_healthy()
        self._start_router()
        return self

    def _start_router(self) -> None:
        router = self.procs["router"]
        router.kill()
        router.argv = self._router_argv()
        router.start()
        router.wait_healthy()

    def restart(self, name: str) -> None:
        """Kill and start ``name`` again (on new ephemeral ports); a restarted worker gets
        a router that knows its new URL."""
        self.procs[name].kill()
        self.procs[name].start()
        self.procs[name].wait_healthy()
        if name != "router":
            self._start_router()

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()

    def complete(self, name: str, body: dict, timeout_s: float = 60.0) -> dict:
        return complete(self.procs[name].url, body, timeout_s)
