"""The engine thread of a worker: builds and owns the engine (and its connector), and
trades requests and outputs with the HTTP handlers over queues::

    handler --submit(request)--> inbox --> engine thread: add_request, step(), ...
    handler <--RequestOutput / HTTPFailure-- per-request stream <--/

Only this thread touches the model, the block pool and the connector; with a connector
it steps even when idle, so NIXL notifications, handshakes and leases keep moving.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from kvbridge.connector.common.api import WorkerConnector
from kvbridge.examples.completions import HTTPFailure
from kvbridge.examples.engine import Engine
from kvbridge.examples.request import EngineError, Request, RequestOutput

logger = logging.getLogger("kvbridge.server")


class OutputSink(Protocol):
    """Where the engine thread puts one request's outputs (a ``queue.Queue``, or a bridge
    into an event loop: ``examples/http_app.py``)."""

    def put(self, item: RequestOutput | Exception) -> None: ...


class EngineLoop:
    """The engine thread: builds and owns the engine (and connector; NIXL agents belong to
    the thread that made them) and talks to handlers via queues."""

    def __init__(self, factory: Callable[[], Engine], idle_s: float = 0.002) -> None:
        self._factory = factory
        self._idle_s = idle_s
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._streams: dict[str, OutputSink] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.engine: Engine
        self.finished: Counter[str] = Counter()
        self.status_counts: dict[str, int] = {}
        self.free_blocks = 0
        self.healthy = True
        self._aborted = False

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

    def submit(self, request: Request, stream: OutputSink | None = None) -> OutputSink:
        """Queue ``request``; its outputs (or the exception that ends it) go to ``stream``
        (a new ``queue.Queue`` when None), put from the engine thread."""
        sink: OutputSink = queue.Queue() if stream is None else stream
        self._inbox.put(("add", (request, sink)))
        return sink

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
            # Requests only waiting for their KV need no step before the next wait: a loop
            # that stepped them back to back would hold the GIL, and the HTTP handlers of
            # every other request would wait for it (a frozen prefill slowed decode's
            # local requests' first token 10-50x; tests/reliability/test_frozen_points.py)
            self._drain(block=not self.engine.has_runnable)
            # an abort's last output comes out of the next step, even with nothing else to do
            aborted, self._aborted = self._aborted, False
            if not (self.engine.has_unfinished or self.worker is not None or aborted):
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
                self._aborted = True
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
