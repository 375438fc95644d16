"""The side-channel client: fetch a peer's WorkerDescription, once per (engine, rank).

Each attempt uses a fresh DEALER socket (LINGER 0), so a late answer to an abandoned
attempt can never be mistaken for the answer to the next one::

    attempt 1: connect, send, poll(timeout_s) ... nothing -> close, sleep backoff
    attempt 2: connect, send, poll(timeout_s) ... reply   -> verify, decode, return

Only timeouts and ``busy`` refusals (the peer's request queue was full: a live peer that
will answer once it has drained it) are retried: a refused, malformed or unauthenticated
reply comes from a live peer that will answer the same way again, so it raises at once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import TracebackType

import zmq

from kvbridge.handshake.errors import (
    AuthenticationError,
    HandshakeError,
    HandshakeTimeoutError,
    PeerAuthenticationError,
    PeerError,
)
from kvbridge.handshake.framing import MAGIC, FrameCodec, HandshakeSecurity
from kvbridge.handshake.messages import (
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    MetadataRequest,
    WorkerDescription,
    decode_reply,
    encode,
)


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Timeouts and retries of :class:`HandshakeClient`.

    A dead peer costs at most ``(retries + 1) * timeout_s`` plus the backoff sleeps
    ``backoff_s * (1 + 2 + 4 + ...)``.
    """

    timeout_s: float = 2.0
    retries: int = 3
    backoff_s: float = 0.05
    security: HandshakeSecurity = field(default_factory=HandshakeSecurity)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.retries < 0 or self.backoff_s < 0:
            raise HandshakeError(
                f"ClientConfig: timeout_s={self.timeout_s} must be positive, "
                f"retries={self.retries} and backoff_s={self.backoff_s} non-negative"
            )

    @property
    def max_wait_s(self) -> float:
        """The longest :meth:`HandshakeClient.fetch` can take against a silent peer."""
        backoff = sum(self.backoff_s * 2**i for i in range(self.retries))
        return (self.retries + 1) * self.timeout_s + backoff


class HandshakeClient:
    """Fetches and caches peers' descriptions. Thread-safe; fetches may run concurrently."""

    def __init__(
        self,
        config: ClientConfig | None = None,
        *,
        requester_engine_id: str = "",
        requester_rank: int = 0,
        request: MetadataRequest | None = None,
    ) -> None:
        """``request`` overrides the request sent (e.g. to carry the requester's agent)."""
        self.config = config or ClientConfig()
        self._codec = FrameCodec(self.config.security)
        self._request = encode(
            request
            or MetadataRequest(
                protocol_version=PROTOCOL_VERSION,
                requester_engine_id=requester_engine_id,
                requester_rank=requester_rank,
            )
        )
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = zmq.Context(io_threads=1)
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, int], WorkerDescription] = {}
        # per key with a fetch in flight: how many, and the forgets since the first began
        self._fetching: dict[tuple[str, int], int] = {}
        self._forgets: dict[tuple[str, int], int] = {}

    def __repr__(self) -> str:
        state = "closed" if self._ctx is None else f"{len(self._cache)} cached"
        return f"HandshakeClient(timeout_s={self.config.timeout_s}, {state})"

    def get(self, engine_id: str, rank: int, host: str, port: int) -> WorkerDescription:
        """The description of ``(engine_id, rank)``: cached, or fetched from host:port.

        A fetched description is what this call gets, and is cached only when nobody
        called :meth:`forget` for the key while it was fetched: a fetch that began before
        a peer restarted must not hand the old process's description to whoever forgot
        it and asked again (concurrent callers, the handshake threads of one worker).

        Raises :class:`HandshakeError` when the peer at host:port is someone else.
        """
        key = (engine_id, rank)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                return cached
            self._fetching[key] = self._fetching.get(key, 0) + 1
            forgets = self._forgets.get(key, 0)
        try:
            description = self.fetch(host, port)
            if (description.engine_id, description.engine_rank) != key:
                raise HandshakeError(
                    f"peer {host}:{port} answered as engine {description.engine_id!r} rank "
                    f"{description.engine_rank}, expected engine {engine_id!r} rank {rank}; "
                    "stale side-channel address, or the port of another rank?"
                )
            with self._lock:
                if self._forgets.get(key, 0) == forgets:
                    self._cache[key] = description
            return description
        finally:
            with self._lock:
                left = self._fetching.pop(key) - 1
                if left:
                    self._fetching[key] = left
                else:
                    self._forgets.pop(key, None)

    def forget(self, engine_id: str, rank: int) -> None:
        """Drop a cached description (the peer restarted); the next get() handshakes, and
        a get() fetching it now does not cache what it fetched."""
        key = (engine_id, rank)
        with self._lock:
            self._cache.pop(key, None)
            if key in self._fetching:
                self._forgets[key] = self._forgets.get(key, 0) + 1

    def fetch(self, host: str, port: int) -> WorkerDescription:
        """Handshake with host:port now (no cache); retries only on timeouts and busy
        refusals (the last refusal is raised when every attempt was refused)."""
        ctx = self._ctx
        if ctx is None:
            raise HandshakeError(f"{self!r}: fetch({host}:{port}) after close()")
        cfg = self.config
        started = time.monotonic()
        busy: PeerError | None = None
        for attempt in range(cfg.retries + 1):
            if attempt:
                time.sleep(cfg.backoff_s * 2 ** (attempt - 1))
            reply = self._attempt(ctx, host, port)
            if reply is None:
                continue
            try:
                return self._accept(reply, f"{host}:{port}")
            except PeerError as exc:
                if exc.code is not ErrorCode.BUSY:
                    raise
                busy = exc  # its queue was full: it answers once it drained it
        if busy is not None:
            raise busy
        elapsed = time.monotonic() - started
        raise HandshakeTimeoutError(
            f"no handshake reply from {host}:{port} after {cfg.retries + 1} attempt(s) in "
            f"{elapsed:.2f} s (timeout_s={cfg.timeout_s} each); is the peer's listener "
            "running and is this its side-channel port?"
        )

    def close(self) -> None:
        """Release the ZMQ context; idempotent. Cached descriptions stay readable."""
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.term()

    def __enter__(self) -> HandshakeClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _attempt(
        self, ctx: zmq.Context[zmq.Socket[bytes]], host: str, port: int
    ) -> tuple[list[bytes], bytes] | None:
        """One request/response on a fresh socket: (reply frames, request nonce) or None."""
        frames, nonce = self._codec.seal(self._request)
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.config.security.socket_max_bytes)
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
            # The pipe exists from connect() on, so this queues even before TCP is up.
            sock.send_multipart(frames, zmq.NOBLOCK)
            if not sock.poll(int(self.config.timeout_s * 1000), zmq.POLLIN):
                return None
            return sock.recv_multipart(zmq.NOBLOCK), nonce
        except zmq.Again:
            return None
        finally:
            sock.close(linger=0)

    def _accept(self, reply: tuple[list[bytes], bytes], peer: str) -> WorkerDescription:
        frames, nonce = reply
        try:
            opened = self._codec.open(frames, in_reply_to=nonce)
            authenticated = opened.authenticated or self.config.security.secret is None
            message = decode_reply(opened.payload)
        except AuthenticationError as exc:
            message = self._unauthenticated_error_reply(frames, peer, exc)
            authenticated = False
        except HandshakeError as exc:
            raise type(exc)(f"reply from {peer}: {exc}") from None
        match message:
            case WorkerDescription():
                return message
            case ErrorReply(code=code, reason=reason):
                error = PeerAuthenticationError if code is ErrorCode.UNAUTHENTICATED else PeerError
                raise error(peer, code, reason, authenticated=authenticated)
        raise AssertionError(f"decode_reply returned {type(message).__name__}")

    def _unauthenticated_error_reply(
        self, frames: list[bytes], peer: str, cause: AuthenticationError
    ) -> ErrorReply:
        """A listener answers a request it could not authenticate with a plain ErrorReply;
        believe that (it can only make us fail), never a plain description."""
        if len(frames) == 2 and frames[0] == MAGIC:
            try:
                message = decode_reply(frames[1])
            except HandshakeError:
                message = None
            if isinstance(message, ErrorReply):
                return message
        raise AuthenticationError(f"reply from {peer} refused: {cause}") from None
