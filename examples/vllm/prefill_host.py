"""The prefill side of vLLM layout pairs: one OS process (``prefill_child.py``) that
holds prefill ranks, driven over JSON lines (``kvbridge bench vllm_layouts`` and the
vLLM layout tests)."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

CHILD = "kvbridge.examples.vllm.prefill_child"  # run with python -m
START_TIMEOUT_S = 120.0  # the host imports torch, vLLM and NIXL on a shared 2-core machine
EVENT_TIMEOUT_S = 30.0


class PrefillHost:
    """The prefill ranks of every pair, in one process of their own (``prefill_child.py``),
    with a replica of each rank's bytes."""

    def __init__(self, log: Path, child: str = CHILD, cwd: Path | None = None) -> None:
        """``child``: the module the prefill process runs (``python -m``), speaking
        ``prefill_child``'s protocol; ``cwd``: its directory (default: ours)."""
        self._log = log
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", child],
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
        )
        self._events: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.sent: dict[str, set[str]] = {}
        self.wait_for("started", timeout_s=START_TIMEOUT_S)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self._events.put(json.loads(line[3:]))
        self._events.put({"event": "eof"})

    def _note(self, event: dict) -> dict:
        if event["event"] == "sent":
            self.sent.setdefault(event["key"], set()).add(event["request_id"])
        if event["event"] in ("error", "eof"):
            raise AssertionError(f"prefill host said {event}; log: {self._log.read_text()[-3000:]}")
        return event

    def wait_for(self, name: str, timeout_s: float = EVENT_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"prefill host: no {name!r} event within {timeout_s} s; "
                    f"log: {self._log.read_text()[-3000:]}"
                ) from None
            if self._note(event)["event"] == name:
                return event

    def drain(self) -> None:
        while True:
            try:
                self._note(self._events.get_nowait())
            except queue.Empty:
                return

    def command(self, **cmd: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def open_rank(self, key: str, spec: dict, engine_id: str, mode: str, seed: int) -> int:
        """Build one prefill rank (``layout_peer.SideSpec`` fields in ``spec``); its port."""
        self.command(cmd="open", key=key, spec=spec, engine_id=engine_id, mode=mode, seed=seed)
        return self.wait_for("ready")["port"]

    def send(
        self,
        key: str,
        request_id: str,
        block_ids: list[list[int]],
        first_block: list[int] | None = None,
    ) -> None:
        """The rank keeps ``block_ids`` (per group, from ``first_block``; default 0) for
        decode."""
        first = first_block if first_block is not None else [0] * len(block_ids)
        self.command(
            cmd="send", key=key, request_id=request_id, block_ids=block_ids, first_block=first
        )
        self.wait_for("kept")

    def close_rank(self, key: str) -> None:
        self.command(cmd="close", key=key)
        self.wait_for("closed")

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.command(cmd="quit")
                self.proc.wait(timeout=30)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=10)
        finally:
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
            self._log_file.close()
