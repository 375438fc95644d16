"""HTTP server of one worker: prefill, decode, or both in one process.

::

    kvbridge serve prefill --model tiny-hybrid --port 8100 \\
        --block-size 64 --kv-layout NHD --cross-layers --device cuda \\
        --kv-transfer-config '{"kv_role": "kv_producer", "engine_id": "prefill-0"}'

(or ``python -m kvbridge.examples.server --role prefill ...``). ``--port 0`` (and
``"kv_port": 0``) bind ephemeral ports; ``--ready-file PATH`` then says which
(``examples/ready.py``).

The routes (``examples/http_app.py``) run on FastAPI under uvicorn, one event loop; the
single engine thread (``examples/engine_loop.py``) owns the model and the connector. The
command line and what a worker is built from: ``examples/worker_setup.py``.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading

import torch
import uvicorn

from kvbridge.examples.engine_loop import EngineLoop
from kvbridge.examples.http_app import create_app
from kvbridge.examples.ready import bind_failed, write_ready_file
from kvbridge.examples.worker_setup import build, make_parser
from kvbridge.layouts.errors import KVBridgeError

logger = logging.getLogger("kvbridge.server")


class WorkerHTTPServer:
    """uvicorn serving one worker's routes on a socket bound at construction (so the
    port, ``server_address``, is known and a bind error raises here, as ``OSError``)."""

    def __init__(
        self, addr: tuple[str, int], loop: EngineLoop, info: dict, request_timeout_s: float
    ):
        self.loop = loop
        self.info = info
        self.app = create_app(loop, info, request_timeout_s)
        self.socket = socket.create_server(addr, backlog=1024)
        self.server_address = self.socket.getsockname()[:2]
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,
            lifespan="off",
        )
        self._server = uvicorn.Server(config)
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        """Serve until :meth:`shutdown` (or, on the main thread, SIGINT/SIGTERM)."""
        try:
            self._server.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop serving (open streams get a short grace) and wait until it stopped."""
        self._server.should_exit = True
        if not self._stopped.wait(timeout_s):
            raise TimeoutError(f"the HTTP server did not stop within {timeout_s} s")

    def server_close(self) -> None:
        self.socket.close()


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
    logger.info("serving %s on http://%s:%d", info, args.host, server.server_address[1])
    try:  # uvicorn stops on SIGINT and SIGTERM
        server.serve_forever()
    finally:
        server.server_close()
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
