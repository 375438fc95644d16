"""The side-channel listener: a ZMQ ROUTER in one background thread.

A worker publishes its self-description through ``describe``; any number of peers may ask
at once (ROUTER queues them, one thread answers in turn; an answer is microseconds).

    peer DEALER --[KVB1|hdr|MetadataRequest]--> ROUTER --describe()--> WorkerDescription
                <--[KVB1|hdr|reply]-------------

Bad input never kills the thread: every message that can be routed back gets a typed
``ErrorReply``, and ``stats()`` counts what was served, refused (by code) and dropped.

Valid requests go to the owner through a bounded :class:`RequestQueue` (the owner drains
it on its own thread): with no secret anyone who reaches the port can send requests, each
with up to ``socket_max_bytes`` of NIXL metadata, so a full queue refuses the request with
``ErrorCode.BUSY`` instead of growing, and the listener keeps serving.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType

import zmq

from kvbridge.handshake.affinity import unpinned
from kvbridge.handshake.errors import (
    AuthenticationError,
    HandshakeError,
    ListenerBusyError,
    MessageTooLargeError,
    ProtocolError,
    UnknownRequestError,
    UnsupportedVersionError,
)
from kvbridge.handshake.framing import MAGIC, FrameCodec, HandshakeSecurity
from kvbridge.handshake.messages import (
    ErrorCode,
    ErrorReply,
    MetadataRequest,
    WorkerDescription,
    decode_request,
    encode,
)
from kvbridge.handshake.port_holder import bind_error_text

logger = logging.getLogger(__name__)

DEFAULT_BASE_PORT = 5600
_MAX_BATCH = 64  # messages handled per wake-up before the stop flag is looked at again

# Most specific first: the first matching class gives the reply code.
_ERROR_CODES: tuple[tuple[type[HandshakeError], ErrorCode], ...] = (
    (MessageTooLargeError, ErrorCode.TOO_LARGE),
    (UnsupportedVersionError, ErrorCode.UNSUPPORTED_VERSION),
    (UnknownRequestError, ErrorCode.UNKNOWN_REQUEST),
    (ProtocolError, ErrorCode.MALFORMED),
    (AuthenticationError, ErrorCode.UNAUTHENTICATED),
    (ListenerBusyError, ErrorCode.BUSY),
)

MAX_QUEUED_REQUESTS = 256  # valid requests waiting for the owner to take them
MAX_QUEUED_BYTES = 64 << 20  # ... and the NIXL metadata they carry


def default_port(rank: int) -> int:
    """The conventional side-channel port of a rank: ``DEFAULT_BASE_PORT + rank``."""
    return DEFAULT_BASE_PORT + rank


@dataclass(frozen=True, kw_only=True)
class ListenerConfig:
    """Where the listener binds and how it behaves; ``port=0`` picks a free port."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_BASE_PORT
    security: HandshakeSecurity = field(default_factory=HandshakeSecurity)
    poll_interval_s: float = 0.05
    rcvhwm: int = 1000

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise HandshakeError(f"ListenerConfig: port={self.port} must be in 0..65535")
        if not 0 < self.poll_interval_s <= 1.0:
            raise HandshakeError(
                f"ListenerConfig: poll_interval_s={self.poll_interval_s} must be in (0, 1]"
            )

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name or "*": assume it is reachable from outside
            return False


class RequestQueue:
    """Valid requests from the listener thread to the owner's: at most ``max_requests``
    and ``max_bytes`` of requester metadata waiting; :meth:`put` refuses more."""

    def __init__(self, max_requests: int | None = None, max_bytes: int | None = None) -> None:
        """Bounds default to ``MAX_QUEUED_REQUESTS`` and ``MAX_QUEUED_BYTES``."""
        self._queue: queue.SimpleQueue[MetadataRequest] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._max_requests = MAX_QUEUED_REQUESTS if max_requests is None else max_requests
        self._max_bytes = MAX_QUEUED_BYTES if max_bytes is None else max_bytes
        self._num_requests = 0
        self._num_bytes = 0

    def __len__(self) -> int:
        return self._num_requests

    def put(self, request: MetadataRequest) -> None:
        """Queue ``request``; raises :class:`ListenerBusyError` when the queue is full (the
        listener answers ``ErrorCode.BUSY``)."""
        size = len(request.requester_nixl_metadata)
        with self._lock:
            if self._num_requests >= self._max_requests or (
                self._num_requests and self._num_bytes + size > self._max_bytes
            ):
                raise ListenerBusyError(
                    f"{self._num_requests} handshake requests ({self._num_bytes} bytes of "
                    f"metadata) wait for this worker, the most it queues ({self._max_requests}"
                    f" requests, {self._max_bytes} bytes); retry later"
                )
            self._num_requests += 1
            self._num_bytes += size
        self._queue.put(request)

    def take(self) -> list[MetadataRequest]:
        """Every request queued so far, oldest first."""
        out = []
        while True:
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                return out
            with self._lock:
                self._num_requests -= 1
                self._num_bytes -= len(request.requester_nixl_metadata)
            out.append(request)


@dataclass(frozen=True)
class ListenerStats:
    """A snapshot of what the listener did since it started."""

    served: int
    dropped: int
    errors: Mapping[ErrorCode, int]

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())


class HandshakeListener:
    """Serves ``describe()`` to peers over ZMQ until :meth:`close`."""

    def __init__(
        self,
        config: ListenerConfig,
        describe: Callable[[], WorkerDescription],
        *,
        on_request: Callable[[MetadataRequest], None] | None = None,
    ) -> None:
        """``on_request`` (optional) sees every valid request before it is answered, on the
        listener thread: keep it quick and thread-safe (e.g. :meth:`RequestQueue.put`); a
        :class:`ListenerBusyError` it raises refuses the request with ``ErrorCode.BUSY``."""
        self.config = config
        self._describe = describe
        self._on_request = on_request
        self._codec = FrameCodec(config.security)
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._port: int | None = None
        self._stats_lock = threading.Lock()
        self._served = 0
        self._dropped = 0
        self._errors: collections.Counter[ErrorCode] = collections.Counter()
        self._cached: tuple[WorkerDescription, bytes] | None = None

    def __repr__(self) -> str:
        state = "alive" if self.is_alive else ("closed" if self._stop.is_set() else "new")
        return f"HandshakeListener({self.config.host}:{self._port or self.config.port}, {state})"

    @property
    def port(self) -> int:
        """The bound port (the picked one when configured with ``port=0``)."""
        if self._port is None:
            raise HandshakeError(f"{self!r}: port is known only after start()")
        return self._port

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> HandshakeListener:
        """Bind (errors raise here, in the caller) and start serving in a daemon thread."""
        if self._thread is not None:
            raise HandshakeError(f"{self!r}: start() called twice")
        cfg = self.config
        if not cfg.is_loopback and cfg.security.secret is None:
            logger.warning(
                "handshake listener binds %s without a shared secret: anyone who can reach "
                "it can read this worker's memory layout; set HandshakeSecurity.secret",
                cfg.host,
            )
        with unpinned():  # the ZMQ I/O thread starts with the first socket
            self._ctx = zmq.Context(io_threads=1)
            sock = self._ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, cfg.security.socket_max_bytes)
            sock.setsockopt(zmq.RCVHWM, cfg.rcvhwm)
            sock.setsockopt(zmq.SNDHWM, cfg.rcvhwm)
            if ":" in cfg.host:
                sock.setsockopt(zmq.IPV6, 1)
            host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
            if cfg.port == 0:
                self._port = sock.bind_to_random_port(f"tcp://{host}")
            else:
                sock.bind(f"tcp://{host}:{cfg.port}")
                self._port = cfg.port
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self._ctx.term()
            self._ctx = None
            # names the process holding the port, where procfs shows it
            raise HandshakeError(
                bind_error_text("handshake listener", cfg.host, cfg.port, exc)
            ) from exc
        # The socket moves to the serving thread here and is used only there from now on.
        self._thread = threading.Thread(
            target=self._serve, args=(sock,), name=f"kvbridge-handshake-{self._port}", daemon=True
        )
        with unpinned():
            self._thread.start()
        logger.info("handshake listener serving on %s:%d", cfg.host, self._port)
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop serving and release the socket; prompt (one poll interval). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise HandshakeError(f"{self!r}: serving thread did not stop in {timeout_s} s")
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> HandshakeListener:
        if self._thread is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def stats(self) -> ListenerStats:
        with self._stats_lock:
            errors = MappingProxyType(dict(self._errors))
            return ListenerStats(served=self._served, dropped=self._dropped, errors=errors)

    # -- serving thread ------------------------------------------------------------------

    def _serve(self, sock: zmq.Socket[bytes]) -> None:
        timeout_ms = max(1, int(self.config.poll_interval_s * 1000))
        try:
            while not self._stop.is_set():
                if not sock.poll(timeout_ms, zmq.POLLIN):
                    continue
                for _ in range(_MAX_BATCH):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._handle(sock, frames)
                    except Exception:  # last resort: one bad message must not stop serving
                        logger.exception("handshake listener: dropped a message")
                        self._count_dropped()
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)

    def _handle(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        if len(frames) < 2:  # no routing identity or no message: nobody to answer
            self._count_dropped()
            return
        identity, body = frames[0], frames[1:]
        nonce = b""
        try:
            opened = self._codec.open(body)
            nonce = opened.nonce
            request = decode_request(opened.payload)
            payload = self._answer(request)
            code = None
        except HandshakeError as exc:
            code = next(c for cls, c in _ERROR_CODES if isinstance(exc, cls))
            payload = encode(ErrorReply(code=code, reason=str(exc)))
        except Exception as exc:  # describe() failed: the owner's bug, not the peer's
            logger.exception("handshake listener: internal error while answering")
            code = ErrorCode.INTERNAL
            payload = encode(ErrorReply(code=code, reason=f"{type(exc).__name__}: {exc}"))
        if nonce or self.config.security.secret is None:
            reply, _ = self._codec.seal(payload, in_reply_to=nonce)
        else:
            # The request failed authentication (code is set): the requester may not hold
            # the secret, and an error reply reveals nothing worth protecting.
            reply = [MAGIC, payload]
        with self._stats_lock:  # counted before sending: a peer that sees the reply sees it
            if code is None:
                self._served += 1
            else:
                self._errors[code] += 1
        try:
            sock.send_multipart([identity, *reply], zmq.NOBLOCK)
        except zmq.Again:  # the peer's queue is full: it is not reading; drop
            self._count_dropped()

    def _answer(self, request: MetadataRequest) -> bytes:
        match request:
            case MetadataRequest():
                if self._on_request is not None:
                    self._on_request(request)
                description = self._describe()
                cached = self._cached
                if cached is not None and cached[0] is description:
                    return cached[1]
                payload = encode(description)
                self._cached = (description, payload)
                return payload
        raise UnknownRequestError(f"no handler for {type(request).__name__}")

    def _count_dropped(self) -> None:
        with self._stats_lock:
            self._dropped += 1
