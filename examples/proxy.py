"""Disaggregating proxy: prefill on one worker, decode on another.

::

    python -m kvbridge.examples.proxy --port 8000 --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200,http://127.0.0.1:8201

``POST /v1/completions``::

    client --> proxy --(max_tokens=1, kv_transfer_params={"do_remote_decode": true})--> prefill
                     <--(kv_transfer_params: engine id, side channel, block ids, tokens)--
           proxy --(the client's request + those params)--> decode --> client
                                                         (streamed per token when "stream")

Workers are picked round-robin. A worker that cannot be reached gives 503, one that
answers garbage or a 5xx gives 502; a worker's 4xx is passed through unchanged. Every
answer is JSON ``{"error": reason}`` on failure.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from kvbridge.examples.ready import bind_failed, write_ready_file

logger = logging.getLogger("kvbridge.proxy")
MAX_BODY_BYTES = 1 << 20


class UpstreamError(Exception):
    """A worker could not be used; ``status`` is what the proxy answers."""

    def __init__(self, status: int, reason: str, body: bytes | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Upstream:
    host: str
    port: int
    name: str

    @classmethod
    def parse(cls, url: str) -> Upstream:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"worker URL {url!r} must look like http://host:port")
        return cls(parts.hostname, parts.port, f"{parts.hostname}:{parts.port}")

    def post(self, path: str, body: dict, timeout_s: float) -> http.client.HTTPResponse:
        """POST JSON; the open response (status may be any). Raises UpstreamError(503)."""
        data = json.dumps(body).encode()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        try:
            conn.request("POST", path, data, {"Content-Type": "application/json"})
            return conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise UpstreamError(503, f"worker {self.name} is unreachable: {exc}") from None

    def post_json(self, path: str, body: dict, timeout_s: float) -> dict:
        resp = self.post(path, body, timeout_s)
        try:
            raw = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise UpstreamError(502, f"worker {self.name} broke off its answer: {exc}") from None
        finally:
            resp.close()
        check_status(self, resp.status, raw)
        try:
            out = json.loads(raw)
        except ValueError:
            raise UpstreamError(502, f"worker {self.name} answered non-JSON") from None
        if not isinstance(out, dict):
            raise UpstreamError(502, f"worker {self.name} answered a non-object")
        return out


def check_status(up: Upstream, status: int, raw: bytes) -> None:
    if status == 200:
        return
    if 400 <= status < 500:  # the client's fault: pass the worker's answer through
        raise UpstreamError(status, f"worker {up.name} refused the request", raw)
    try:
        reason = json.loads(raw).get("error", "")
    except (ValueError, AttributeError):
        reason = raw[:200].decode(errors="replace")
    raise UpstreamError(502, f"worker {up.name} failed with HTTP {status}: {reason}")


class Router:
    """Round-robin over the prefill and decode workers (thread-safe)."""

    def __init__(self, prefill: list[Upstream], decode: list[Upstream], timeout_s: float):
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode worker")
        self.prefill, self.decode = prefill, decode
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._next_prefill = itertools.cycle(prefill)
        self._next_decode = itertools.cycle(decode)

    def pick(self) -> tuple[Upstream, Upstream]:
        with self._lock:
            return next(self._next_prefill), next(self._next_decode)

    def run_prefill(self, up: Upstream, request: dict) -> dict:
        """The prefill half: returns the kv_transfer_params for decode."""
        body = {
            **request,
            "max_tokens": 1,
            "stream": False,
            "return_logits": False,
            "logprobs": None,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        answer = up.post_json("/v1/completions", body, self.timeout_s)
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise UpstreamError(502, f"prefill worker {up.name} returned no kv_transfer_params")
        return params


class ProxyHandler(BaseHTTPRequestHandler):
    server: ProxyServer

    def log_message(self, fmt: str, *args: object) -> None:
        logger.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, data: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, reason: str) -> None:
        self._send(status, json.dumps({"error": reason}).encode())

    def do_GET(self) -> None:
        if self.path == "/health":
            router = self.server.router
            body = {
                "status": "ok",
                "prefill": [u.name for u in router.prefill],
                "decode": [u.name for u in router.decode],
            }
            self._send(200, json.dumps(body).encode())
        else:
            self._error(404, f"no such endpoint: GET {self.path}")

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._error(404, f"no such endpoint: POST {self.path}")
            return
        try:
            request = self._read_json()
            prefill, decode = self.server.router.pick()
            params = self.server.router.run_prefill(prefill, request)
            decode_body = {**request, "kv_transfer_params": params}
            if request.get("stream"):
                self._stream(decode, decode_body)
            else:
                answer = decode.post_json(
                    "/v1/completions", decode_body, self.server.router.timeout_s
                )
                self._send(200, json.dumps(answer).encode())
        except UpstreamError as exc:
            if exc.body is not None:
                self._send(exc.status, exc.body)
            else:
                self._error(exc.status, str(exc))

    def _read_json(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise UpstreamError(411, "Content-Length header is required") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise UpstreamError(413, f"body of {length} bytes exceeds {MAX_BODY_BYTES}")
        try:
            body = json.loads(self.rfile.read(length))
        except ValueError as exc:
            raise UpstreamError(400, f"body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise UpstreamError(400, "body must be a JSON object")
        if "kv_transfer_params" in body:
            raise UpstreamError(400, "kv_transfer_params are set by the proxy, not the client")
        return body

    def _stream(self, decode: Upstream, body: dict) -> None:
        resp = decode.post("/v1/completions", body, self.server.router.timeout_s)
        try:
            if resp.status != 200:
                check_status(decode, resp.status, resp.read())
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            for line in _lines(resp):
                self.wfile.write(line)
                if line == b"\n":
                    self.wfile.flush()
        except (OSError, http.client.HTTPException) as exc:
            logger.warning("stream from %s broke off: %s", decode.name, exc)
        finally:
            resp.close()


def _lines(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    while line := resp.readline():
        yield line


class ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default backlog of 5 resets connections under a few dozen
    # concurrent clients (seen in scripts/soak.py); the kernel caps it at somaxconn
    request_queue_size = 1024

    def __init__(self, addr, router: Router) -> None:
        super().__init__(addr, ProxyHandler)
        self.router = router


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvbridge disaggregating proxy")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: an ephemeral port")
    parser.add_argument(
        "--ready-file", default=None, help="write the bound port here as JSON (examples/ready.py)"
    )
    parser.add_argument("--prefill", required=True, help="URL[,URL...] of prefill workers")
    parser.add_argument("--decode", required=True, help="URL[,URL...] of decode workers")
    parser.add_argument("--timeout", type=float, default=120.0, help="per upstream call (s)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    try:
        router = Router(
            [Upstream.parse(u) for u in args.prefill.split(",") if u],
            [Upstream.parse(u) for u in args.decode.split(",") if u],
            args.timeout,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        server = ProxyServer((args.host, args.port), router)
    except OSError as exc:
        return bind_failed("the proxy", args.host, args.port, exc)
    if args.ready_file:
        write_ready_file(args.ready_file, args.host, server.server_address[1])
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    logger.info("proxy on http://%s:%d", args.host, server.server_address[1])
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
