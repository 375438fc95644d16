"""The example worker's HTTP routes on FastAPI (served by uvicorn, as vLLM's are):
everything vllm-router needs from a prefill or decode worker.

* ``GET /health``: 200 ``{"status": "ok", ...}``, 503 with a reason when unhealthy;
* ``GET /v1/models``: the one model served;
* ``GET /metrics``: Prometheus text (``examples/metrics_export.py``);
* ``POST /v1/completions`` and ``POST /v1/chat/completions``: whole or streamed (server-sent
  events), with the ``kv_transfer_params`` the router sends and returns.

Bodies are bounded (413 past ``MAX_BODY_BYTES``, before they are read); bad input gets a
4xx JSON ``{"error": reason}`` and the worker keeps serving. Handlers never block the event
loop: the engine thread puts outputs into an :class:`AsyncSink`, which hands them to the
loop. A client that goes away (socket closed, whole or streamed) aborts its request: the
engine frees its blocks (prefill's at once; decode's once no transfer touches them).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvbridge.examples.chat import chat_response_body, parse_chat
from kvbridge.examples.completions import (
    CompletionBody,
    HTTPFailure,
    parse_body,
    response_body,
    to_request,
)
from kvbridge.examples.engine_loop import EngineLoop
from kvbridge.examples.metrics_export import CONTENT_TYPE, make_registry, metrics_text
from kvbridge.examples.request import Request as EngineRequest
from kvbridge.examples.request import RequestOutput

MAX_BODY_BYTES = 1 << 20
Render = Callable[..., dict]


class AsyncSink:
    """An engine-thread -> event-loop queue of one request's outputs."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()

    def put(self, item: RequestOutput | Exception) -> None:
        self._loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _error(status: int, reason: str, **extra: object) -> JSONResponse:
    return JSONResponse({"error": reason, **extra}, status_code=status)


async def read_body(request: Request) -> bytes:
    """The body, refused with 413 past ``MAX_BODY_BYTES`` (by its Content-Length before
    reading, or while reading a chunked one)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise HTTPFailure(f"Content-Length {declared!r} is not a number") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise HTTPFailure(f"body of {length} bytes exceeds {MAX_BODY_BYTES}", 413)
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise HTTPFailure(f"body of more than {MAX_BODY_BYTES} bytes", 413)
    return bytes(data)


def create_app(loop: EngineLoop, info: dict, request_timeout_s: float) -> FastAPI:
    """The routes of one worker around its engine loop; ``info`` is what ``/health``
    reports (model, role, device; engine id and side channel with a connector)."""
    app = FastAPI(title="kvbridge example worker", docs_url=None, redoc_url=None)
    model = str(info["model"])
    registry = make_registry(loop)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405):
            reason = f"no such endpoint: {request.method} {request.url.path}"
            return _error(404, reason)
        return _error(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health() -> JSONResponse:
        worker = loop.worker
        reason = worker.unhealthy_reason if worker is not None else None
        ok = loop.healthy and reason is None
        body = {"status": "ok" if ok else "unhealthy", **info}
        if reason is not None:
            body["reason"] = reason
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": model, "object": "model", "owned_by": "kvbridge", "root": model}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(metrics_text(registry), media_type=CONTENT_TYPE)

    async def serve(request: Request, parse: Callable[[bytes], CompletionBody], render: Render):
        try:
            body = parse(await read_body(request))
            engine_request = _engine_request(loop, body)
        except HTTPFailure as exc:
            return _error(exc.status, str(exc))
        sink = AsyncSink(asyncio.get_running_loop())
        loop.submit(engine_request, sink)
        outputs = _Outputs(loop, engine_request, sink, request_timeout_s)
        if body.stream:
            return await _stream(request, outputs, body, render)
        return await _whole(request, outputs, body, render)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, lambda raw: parse_body(raw, model), response_body)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serve(request, lambda raw: parse_chat(raw, model), chat_response_body)

    return app


def _engine_request(loop: EngineLoop, body: CompletionBody) -> EngineRequest:
    params = body.kv_transfer_params
    remote = params is not None and (params.do_remote_prefill or params.do_remote_decode)
    if remote and loop.engine.scheduler is None:
        raise HTTPFailure(
            "kv_transfer_params ask for a remote transfer, but this worker runs without "
            "a KV connector (start it with --role prefill/decode or --kv-transfer-config)"
        )
    return to_request(body)


class _Outputs:
    """One request's outputs, in order, until it finishes; aborts it when the wait for
    the next one passes the timeout, when the client goes away, or when the reader stops
    early (``close``)."""

    def __init__(
        self, loop: EngineLoop, request: EngineRequest, sink: AsyncSink, timeout_s: float
    ) -> None:
        self.loop, self.request, self.sink, self.timeout_s = loop, request, sink, timeout_s
        self.finished = False

    async def next(self) -> RequestOutput:
        try:
            item = await asyncio.wait_for(self.sink.queue.get(), self.timeout_s)
        except asyncio.TimeoutError:
            raise HTTPFailure(f"no output for {self.timeout_s} s; request aborted", 504) from None
        if isinstance(item, Exception):
            self.finished = True  # the engine ended it (failed step, refused request)
            raise item
        if item.error is not None:
            self.finished = True
            raise HTTPFailure(item.error, 400 if item.invalid_request else 502)
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.loop.abort(self.request.request_id)


async def _until_disconnect(request: Request) -> None:
    """Returns once the client closed its connection (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _whole(request: Request, outputs: _Outputs, body: CompletionBody, render: Render):
    async def collect() -> list[RequestOutput]:
        outs = [await outputs.next()]
        while not outs[-1].finished:
            outs.append(await outputs.next())
        return outs

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client went away: nobody reads the answer
            work.cancel()
            return Response(status_code=499)
        outs = work.result()
    except HTTPFailure as exc:
        return _error(exc.status, str(exc), id=outputs.request.request_id)
    finally:
        gone.cancel()
        outputs.close()
    return JSONResponse(render(outputs.request, body, outs))


async def _stream(request: Request, outputs: _Outputs, body: CompletionBody, render: Render):
    try:  # errors before the first token still get a plain JSON answer
        first = await outputs.next()
    except HTTPFailure as exc:
        outputs.close()
        return _error(exc.status, str(exc), id=outputs.request.request_id)

    async def events() -> AsyncIterator[bytes]:
        # Starlette cancels this generator when the client disconnects: close() aborts
        try:
            out = first
            while True:
                yield _event(render(outputs.request, body, [out], delta=True))
                if out.finished:
                    break
                out = await outputs.next()
            yield b"data: [DONE]\n\n"
        except HTTPFailure as exc:
            yield _event({"error": str(exc), "id": outputs.request.request_id})
        finally:
            outputs.close()

    headers = {"Cache-Control": "no-cache"}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"
