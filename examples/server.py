"""HTTP server of one worker: prefill, decode, or both in one process.

::

    python -m kvbridge.examples.server --model tiny-hybrid --role prefill --port 8100 \\
        --block-size 64 --kv-layout NHD --cross-layers --device cuda \\
        --kv-transfer-config '{"kv_role": "kv_producer", "engine_id": "prefill-0"}'

``--port 0`` (and ``"kv_port": 0``) bind ephemeral ports; ``--ready-file PATH`` then says
which (``examples/ready.py``).

Threads: ``ThreadingHTTPServer`` handlers parse and validate (``examples/completions.py``),
then hand a request to the single engine thread (``examples/engine_loop.py``) over a queue
and wait on a per-request queue (with a timeout) for its outputs. The command line and
what a worker is built from: ``examples/worker_setup.py``.

Endpoints: ``POST /v1/completions``, ``GET /health``, ``GET /metrics`` (Prometheus text).
Bad input gets a 4xx JSON ``{"error": reason}``; the server keeps serving.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import signal
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from kvbridge.examples.completions import (
    CompletionBody,
    HTTPFailure,
    parse_body,
    response_body,
    to_request,
)
from kvbridge.examples.engine_loop import EngineLoop
from kvbridge.examples.ready import bind_failed, write_ready_file
from kvbridge.examples.request import Request, RequestOutput
from kvbridge.examples.worker_setup import build, make_parser
from kvbridge.layouts.errors import KVBridgeError

logger = logging.getLogger("kvbridge.server")
MAX_BODY_BYTES = 1 << 20


class Handler(BaseHTTPRequestHandler):
    server: WorkerHTTPServer

    def log_message(self, fmt: str, *args: object) -> None:
        logger.debug("%s " + fmt, self.address_string(), *args)

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        srv = self.server
        if self.path == "/health":
            worker = srv.loop.worker
            reason = worker.unhealthy_reason if worker is not None else None
            ok = srv.loop.healthy and reason is None
            body = {"status": "ok" if ok else "unhealthy", **srv.info}
            if reason is not None:
                body["reason"] = reason
            self._json(200 if ok else 503, body)
        elif self.path == "/metrics":
            data = srv.metrics_text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._json(404, {"error": f"no such endpoint: GET {self.path}"})

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._json(404, {"error": f"no such endpoint: POST {self.path}"})
            return
        try:
            request, body = self._read_request()
        except HTTPFailure as exc:
            self._json(exc.status, {"error": str(exc)})
            return
        stream = self.server.loop.submit(request)
        if body.stream:
            self._stream(request, body, stream)
        else:
            self._respond(request, body, stream)

    def _read_request(self) -> tuple[Request, CompletionBody]:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise HTTPFailure("Content-Length header is required", 411) from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise HTTPFailure(f"body of {length} bytes exceeds {MAX_BODY_BYTES}", 413)
        body = parse_body(self.rfile.read(length), self.server.info["model"])
        params = body.kv_transfer_params
        remote = params is not None and (params.do_remote_prefill or params.do_remote_decode)
        if remote and self.server.loop.engine.scheduler is None:
            raise HTTPFailure(
                "kv_transfer_params ask for a remote transfer, but this worker runs without "
                "a KV connector (start it with --role prefill/decode or --kv-transfer-config)"
            )
        return to_request(body), body

    def _outputs(self, request: Request, stream: queue.Queue) -> Iterator[RequestOutput]:
        """Yield the request's outputs until it finishes; abort it on timeout."""
        timeout = self.server.request_timeout_s
        while True:
            try:
                item = stream.get(timeout=timeout)
            except queue.Empty:
                self.server.loop.abort(request.request_id)
                raise HTTPFailure(f"no output for {timeout} s; request aborted", 504) from None
            if isinstance(item, Exception):
                raise item
            if item.error is not None:
                status = 400 if item.invalid_request else 502
                raise HTTPFailure(item.error, status)
            yield item
            if item.finished:
                return

    def _respond(self, request: Request, body: CompletionBody, stream: queue.Queue) -> None:
        try:
            outs = list(self._outputs(request, stream))
        except HTTPFailure as exc:
            self._json(exc.status, {"error": str(exc), "id": request.request_id})
            return
        self._json(200, response_body(request, body, outs))

    def _stream(self, request: Request, body: CompletionBody, stream: queue.Queue) -> None:
        outputs = self._outputs(request, stream)
        try:  # errors before the first token still get a plain JSON answer
            first = next(outputs)
        except HTTPFailure as exc:
            self._json(exc.status, {"error": str(exc), "id": request.request_id})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        try:
            for out in itertools.chain([first], outputs):
                self._event(response_body(request, body, [out], delta=True))
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            self.server.loop.abort(request.request_id)
        except HTTPFailure as exc:
            self._event({"error": str(exc), "id": request.request_id})

    def _event(self, body: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        self.wfile.flush()


class WorkerHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default backlog of 5 resets connections under a few dozen
    # concurrent clients (seen in scripts/soak.py); the kernel caps it at somaxconn
    request_queue_size = 1024

    def __init__(self, addr, loop: EngineLoop, info: dict, request_timeout_s: float):
        super().__init__(addr, Handler)
        self.loop = loop
        self.info = info
        self.request_timeout_s = request_timeout_s

    def metrics_text(self) -> str:
        loop = self.loop
        lines = []
        metrics = getattr(loop.worker, "metrics", None)
        if metrics is not None:
            lines.append(metrics.prometheus().rstrip("\n"))
            lines += [
                "# TYPE kvbridge_live_transfer_handles gauge",
                f"kvbridge_live_transfer_handles {loop.worker.num_live_handles}",
            ]
        pool = loop.engine.pool
        lines += [
            "# TYPE kvbridge_free_blocks gauge",
            f'kvbridge_free_blocks{{pool="kv"}} {loop.free_blocks}',
            "# TYPE kvbridge_total_blocks gauge",
            f'kvbridge_total_blocks{{pool="kv"}} {pool.num_blocks}',
            "# TYPE kvbridge_requests gauge",
        ]
        lines += [f'kvbridge_requests{{state="{s}"}} {n}' for s, n in loop.status_counts.items()]
        lines.append("# TYPE kvbridge_requests_finished counter")
        lines += [
            f'kvbridge_requests_finished{{reason="{r}"}} {n}'
            for r, n in list(loop.finished.items())
        ]
        sched = loop.engine.scheduler
        if sched is not None:
            lines.append("# TYPE kvbridge_load_outcomes counter")
            for state, n in list(sched.load_outcomes.items()):
                lines.append(f'kvbridge_load_outcomes{{outcome="{state.name.lower()}"}} {n}')
            lines.append("# TYPE kvbridge_send_outcomes counter")
            for state, n in list(sched.send_outcomes.items()):
                lines.append(f'kvbridge_send_outcomes{{outcome="{state.name.lower()}"}} {n}')
        return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    try:
        loop, info = build(args)
        loop.start()
    except KVBridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        server = WorkerHTTPServer((args.host, args.port), loop, info, args.request_timeout)
    except OSError as exc:
        loop.close()
        return bind_failed("the worker's HTTP server", args.host, args.port, exc)
    if args.ready_file:  # --port 0: the launcher learns the bound ports from here
        write_ready_file(args.ready_file, args.host, server.server_address[1], **info)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    logger.info("serving %s on http://%s:%d", info, args.host, server.server_address[1])
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
