"""A prefill and a decode example server in this process (real engines, real NIXL between
their agents, real HTTP), for tests that poke the servers from outside."""

from __future__ import annotations

import http.client
import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvbridge.examples.check import blocks_in_use
from kvbridge.examples.engine_loop import EngineLoop
from kvbridge.examples.launch import MODEL, worker_args
from kvbridge.examples.server import WorkerHTTPServer
from kvbridge.examples.worker_setup import build, make_parser
from tests.verified_loads import verifying

SECRET = "reliability-test-secret-0123456789"
__all__ = ["MODEL", "SECRET", "Worker", "decodes", "post", "worker_pair"]


def post(url: str, body: dict | bytes, path: str = "/v1/completions") -> tuple[int, dict]:
    """POST JSON (or raw bytes) to a worker or the router; the status and the JSON answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


@dataclass
class Worker:
    url: str
    loop: EngineLoop
    server: WorkerHTTPServer
    thread: threading.Thread

    def post(self, body: dict | bytes, path: str = "/v1/completions") -> tuple[int, dict]:
        return post(self.url, body, path)

    def blocks_in_use(self, timeout_s: float = 10.0) -> int:
        return blocks_in_use(self.url, timeout_s)


def _start(role: str, kv: dict, block_size: int) -> Worker:
    argv = worker_args(role, kv, block_size)
    loop, info = build(make_parser().parse_args(argv))
    loop.start()
    server = WorkerHTTPServer(("127.0.0.1", 0), loop, info, request_timeout_s=60)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    return Worker(f"http://127.0.0.1:{server.server_address[1]}", loop, server, thread)


def _stop(w: Worker) -> None:
    w.server.shutdown()
    w.server.server_close()
    w.thread.join()
    w.loop.close()


@contextmanager
def worker_pair(
    *, secret: str | None = SECRET, lease_s: float = 30.0, **decode_extra
) -> Iterator[tuple[Worker, Worker]]:
    """(prefill block 32, decode block 16) with the same ``secret`` (None: none);
    ``decode_extra``: decode's config keys (it verifies every load unless its ``extra``
    says otherwise: ``tests/verified_loads.py``)."""
    common = {"secret": secret} if secret else {}
    prefill = _start(
        "prefill",
        {
            "kv_role": "kv_producer",
            "engine_id": f"prefill-{uuid.uuid4().hex[:8]}",
            "kv_port": 0,  # ephemeral: the scheduler advertises the bound port
            "lease_s": lease_s,
            **common,
        },
        32,
    )
    try:
        decode = _start(
            "decode",
            verifying(
                {
                    "kv_role": "kv_consumer",
                    "engine_id": f"decode-{uuid.uuid4().hex[:8]}",
                    "kv_port": 0,
                    **common,
                    **decode_extra,
                }
            ),
            16,
        )
    except BaseException:
        _stop(prefill)
        raise
    try:
        yield prefill, decode
    finally:
        _stop(decode)
        _stop(prefill)


@contextmanager
def decodes(
    num_decodes: int, *, secret: str | None = SECRET, **decode_extra
) -> Iterator[list[Worker]]:
    """``num_decodes`` decodes (block 16) in this process, each its own engine id and NIXL
    agent, configured as :func:`worker_pair`'s decode."""
    common = {"secret": secret} if secret else {}
    started: list[Worker] = []
    try:
        for _ in range(num_decodes):
            kv = {
                "kv_role": "kv_consumer",
                "engine_id": f"decode-{uuid.uuid4().hex[:8]}",
                "kv_port": 0,
                **common,
                **decode_extra,
            }
            started.append(_start("decode", verifying(kv), 16))
        yield started
    finally:
        for w in reversed(started):
            _stop(w)
