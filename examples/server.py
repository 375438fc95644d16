"""HTTP server of one worker: prefill, decode, or both in one process.

::

    python -m examples.server --model tiny-hybrid --role prefill --port 8100 \\
        --block-size 64 --kv-layout NHD --cross-layers \\
        --kv-transfer-config '{"kv_role": "kv_producer", "engine_id": "prefill-0"}'

Threads: ``ThreadingHTTPServer`` handlers parse and validate, then hand a request to the
single engine thread (:class:`EngineLoop`) over a queue and wait on a per-request queue
(with a timeout) for its outputs. Only the engine thread touches the model, the block
pool and the connector; with a connector it steps even when idle, so NIXL notifications,
handshakes and leases keep moving.

Endpoints: ``POST /v1/completions``, ``GET /health``, ``GET /metrics`` (Prometheus text).
Bad input gets a 4xx JSON ``{"error": reason}``; the server keeps serving.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import queue
import signal
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Annotated

import msgspec
import numpy as np
import torch

from connector.api import WorkerConnector
from connector.config import ConfigError, KVRole, KVTransferConfig
from connector.params import KVTransferParams
from examples.engine import (
    Engine,
    EngineConfig,
    EngineError,
    Request,
    RequestOutput,
    SamplingParams,
)
from examples.faults import FAULTS, inject
from examples.runner import ModelRunner, RunnerConfig
from examples.tokenizer import ByteTokenizer
from layouts.errors import KVBridgeError
from layouts.specs import dtype_name

logger = logging.getLogger("kvbridge.server")
MAX_BODY_BYTES = 1 << 20
_ROLE_KV = {"prefill": KVRole.PRODUCER, "decode": KVRole.CONSUMER, "both": KVRole.BOTH}


class CompletionBody(msgspec.Struct, kw_only=True):
    """``POST /v1/completions`` (unknown OpenAI fields are ignored)."""

    prompt: str | Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 16
    temperature: float = 0.0
    model: str | None = None
    stream: bool = False
    return_logits: bool = False
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    ignore_eos: bool = False
    kv_transfer_params: KVTransferParams | None = None


class HTTPFailure(KVBridgeError):
    """A request that ends in an HTTP error: the status and the reason to send."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.status = status


def parse_body(raw: bytes, model: str) -> CompletionBody:
    try:
        body = msgspec.json.decode(raw, type=CompletionBody)
    except msgspec.ValidationError as exc:
        raise HTTPFailure(f"invalid request: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # msgspec raises UnicodeDecodeError for invalid UTF-8 inside a JSON string
        raise HTTPFailure(f"body is not valid JSON: {exc}") from None
    if body.temperature != 0:
        raise HTTPFailure(f"temperature={body.temperature}: only greedy decoding (0) is served")
    if body.model not in (None, model):
        raise HTTPFailure(f"model {body.model!r} is not served here; this worker serves {model!r}")
    if isinstance(body.prompt, str) and not body.prompt:
        raise HTTPFailure("prompt is empty")
    return body


class EngineLoop:
    """The engine thread: builds and owns the engine (and connector; NIXL agents belong to
    the thread that made them) and talks to handlers via queues."""

    def __init__(self, factory: Callable[[], Engine], idle_s: float = 0.002) -> None:
        self._factory = factory
        self._idle_s = idle_s
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._streams: dict[str, queue.Queue[RequestOutput | Exception]] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.engine: Engine
        self.finished: Counter[str] = Counter()
        self.status_counts: dict[str, int] = {}
        self.free_blocks = 0
        self.healthy = True

    @property
    def worker(self) -> WorkerConnector | None:
        return self.engine.worker

    def start(self, timeout_s: float = 120.0) -> None:
        """Build the engine on its thread; re-raises what building raised."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"engine not built after {timeout_s} s")
        if self._error is not None:
            raise self._error

    def submit(self, request: Request) -> queue.Queue[RequestOutput | Exception]:
        stream: queue.Queue[RequestOutput | Exception] = queue.Queue()
        self._inbox.put(("add", (request, stream)))
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as exc:  # handed to start(), which re-raises it
            self._error = exc
            return
        finally:
            self._ready.set()
        self.status_counts = self.engine.counts_by_status()
        self.free_blocks = self.engine.pool.num_free
        try:
            self._serve()
        finally:
            if self.engine.worker is not None:
                self.engine.worker.shutdown()

    def _serve(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished
            self._drain(block=not busy)
            if not (self.engine.has_unfinished or self.worker is not None):
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # an engine or connector bug: fail loudly, keep serving
                logger.exception("engine step failed")
                self.healthy = False
                self._fail_all(f"engine step failed: {exc}")
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
                    self.finished[(out.finish_reason.value if out.finish_reason else "?")] += 1
                if stream is not None:
                    stream.put(out)
            self.status_counts = self.engine.counts_by_status()
            self.free_blocks = self.engine.pool.num_free

    def _drain(self, *, block: bool) -> None:
        timeout = self._idle_s if block else None
        while True:
            try:
                kind, item = (
                    self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
                )
            except queue.Empty:
                return
            timeout = None
            if kind == "abort":
                self.engine.abort_request(str(item), "client went away")
                continue
            request, stream = item  # type: ignore[misc]
            try:
                self.engine.add_request(request)
                self._streams[request.request_id] = stream
            except EngineError as exc:
                stream.put(HTTPFailure(str(exc)))

    def _fail_all(self, reason: str) -> None:
        for rid, stream in list(self._streams.items()):
            stream.put(HTTPFailure(reason, 500))
            try:
                self.engine.abort_request(rid, reason)
            except Exception:
                logger.exception("aborting %s after a failed step", rid)
        self._streams.clear()


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
            ok = srv.loop.healthy
            self._json(200 if ok else 503, {"status": "ok" if ok else "unhealthy", **srv.info})
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
        prompt = body.prompt
        ids = ByteTokenizer().encode(prompt) if isinstance(prompt, str) else list(prompt)
        eos = None if body.ignore_eos else ByteTokenizer.eos_id
        wants_logits = body.return_logits or bool(body.logprobs)
        sampling = SamplingParams(
            max_tokens=body.max_tokens, eos_id=eos, return_logits=wants_logits
        )
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        return Request(rid, ids, sampling, body.kv_transfer_params), body

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


def response_body(
    request: Request, body: CompletionBody, outs: list[RequestOutput], *, delta: bool = False
) -> dict:
    """The JSON answer (or one streamed chunk, ``delta=True``) of a completion."""
    tokens = [t for o in outs for t in o.new_token_ids]
    rows = [r for o in outs for r in o.new_logits]
    last = outs[-1]
    out: dict = {
        "id": request.request_id,
        "object": "text_completion.chunk" if delta else "text_completion",
        "text": ByteTokenizer().decode(tokens),
        "token_ids": tokens,
        "finish_reason": last.finish_reason.value if last.finish_reason else None,
    }
    if body.return_logits:
        out["logits"] = [r.tolist() for r in rows]
    if body.logprobs:
        out["logprobs"] = [top_logprobs(r, body.logprobs) for r in rows]
    if last.finished:
        params = last.kv_transfer_params
        out["kv_transfer_params"] = params.to_dict() if params is not None else None
        out["usage"] = {
            "prompt_tokens": len(request.prompt_token_ids),
            "completion_tokens": len(request.output_token_ids),
            "cached_tokens": last.num_cached_tokens,
            "loaded_tokens": last.num_loaded_tokens,
        }
    return out


def top_logprobs(logits: np.ndarray, k: int) -> list[list[float]]:
    """``[[token_id, logprob], ...]`` of the ``k`` most likely tokens, best first."""
    lp = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1)
    values, ids = lp.topk(k)
    return [[int(i), float(v)] for i, v in zip(ids, values, strict=True)]


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


def build(args: argparse.Namespace) -> tuple[EngineLoop, dict]:
    """The engine loop of a worker (built on its own thread by ``start()``) and the info
    ``/health`` reports; bad configuration raises before anything starts."""
    info = {"model": args.model, "role": args.role}
    runner_config = RunnerConfig.from_args(args)
    config = None
    if args.role != "both" or args.kv_transfer_config:
        raw = args.kv_transfer_config or json.dumps(
            {"kv_role": _ROLE_KV[args.role].value, "engine_id": f"{args.role}-{args.port}"}
        )
        config = KVTransferConfig.from_json(raw)
        if config.kv_role is not _ROLE_KV[args.role]:
            raise ConfigError(
                f"--role {args.role} needs kv_role {_ROLE_KV[args.role].value!r}, the "
                f"kv-transfer-config says {config.kv_role.value!r}"
            )

    def factory() -> Engine:
        runner = ModelRunner(runner_config)
        scheduler = worker = None
        if config is not None:
            scheduler, worker = _connector(config, runner, info)
        engine = Engine(
            runner,
            EngineConfig(max_num_seqs=args.max_num_seqs),
            scheduler=scheduler,
            worker=worker,
            exclusive_blocks=config is not None and config.is_producer,
        )
        if args.fault_inject:
            inject(args.fault_inject, engine)
        return engine

    return EngineLoop(factory), info


def _connector(config: KVTransferConfig, runner: ModelRunner, info: dict):
    # Imported here: role "both" without a connector needs neither NIXL nor ZMQ.
    from connector.scheduler import KVBridgeScheduler
    from connector.worker import KVBridgeWorker, ModelInfo

    mc = runner.model_config
    model = ModelInfo(
        model_name=mc.name,
        dtype=dtype_name(mc.dtype),
        num_kv_heads=mc.num_kv_heads,
        head_size=mc.head_size,
    )
    worker = KVBridgeWorker(config, model)
    worker.register_kv_caches(runner.buffers)
    if not config.kv_port:  # an ephemeral side channel: advertise the bound port
        config = dataclasses.replace(config, kv_port=worker.side_channel_port)
    info |= {"engine_id": config.engine_id, "kv_port": config.kv_port}
    return KVBridgeScheduler(config, runner.kv_config), worker


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="kvbridge example worker (HTTP)")
    parser.add_argument("--role", choices=sorted(_ROLE_KV), default="both")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--kv-transfer-config", default=None, help="JSON, or a JSON file path")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--fault-inject", choices=sorted(FAULTS), default=None)
    parser.add_argument("--log-level", default="INFO")
    RunnerConfig.add_arguments(parser)
    return parser


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
    server = WorkerHTTPServer((args.host, args.port), loop, info, args.request_timeout)
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
