"""Signed ``kv_transfer_params``: decode reads only blocks a prefill handed out itself.

The params travel through the client and the proxy, so without a signature any client
that reaches a decode worker can name block ids of its own choosing and have decode read
another request's KV out of prefill's registered memory. With the side-channel ``secret``
configured, prefill signs what it returns and decode refuses params that do not verify::

    key       = HMAC-SHA256(secret, b"kvbridge kv_transfer_params v1")
    signature = HMAC-SHA256(key, msgpack(params with signature=""))      (hex)

Every field is covered: engine, address, request id, block ids per group, token counts
and ``expires_at`` (wall-clock seconds, prefill's issue time + its lease). Decode checks
the signature and the expiry once, when it first sees the request; after that its
heartbeats keep prefill's lease alive. Both workers' clocks must roughly agree (NTP).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable

import msgspec

from kvbridge.connector.common.params import KVTransferParams, ParamsError

_LABEL = b"kvbridge kv_transfer_params v1"
_ENCODER = msgspec.msgpack.Encoder()


class ParamsSignatureError(ParamsError):
    """Params that are unsigned, tampered with, signed with another secret, or expired."""


class ParamsSigner:
    """Signs (prefill) and verifies (decode) params; a no-op without a secret."""

    def __init__(self, secret: bytes | None, *, wall_clock: Callable[[], float] = time.time):
        self._key = hmac.new(secret, _LABEL, hashlib.sha256).digest() if secret else None
        self._wall_clock = wall_clock

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def sign(self, params: KVTransferParams, ttl_s: float) -> KVTransferParams:
        """``params`` dated to expire ``ttl_s`` seconds from now, and signed (without a
        secret only dated: decode still claims the blocks before reading near expiry)."""
        dated = msgspec.structs.replace(
            params, expires_at=round(self._wall_clock() + ttl_s, 3), signature=""
        )
        if self._key is None:
            return dated
        return msgspec.structs.replace(dated, signature=self._mac(dated))

    def verify(self, params: KVTransferParams) -> None:
        """Raise :class:`ParamsSignatureError` unless prefill signed exactly these params
        and they have not expired (without a secret: only the expiry, when dated)."""
        rid = params.remote_request_id
        if self._key is not None:
            if not params.signature:
                raise ParamsSignatureError(
                    f"kv_transfer_params of {rid!r} are not signed, and this worker requires "
                    f"signed params (a secret is configured): pass them on exactly as the "
                    f"prefill returned them, from a prefill configured with the same secret"
                )
            want = self._mac(msgspec.structs.replace(params, signature=""))
            if not hmac.compare_digest(want, params.signature):
                raise ParamsSignatureError(
                    f"kv_transfer_params of {rid!r} do not match their signature: changed "
                    f"after the prefill returned them, or signed with another secret"
                )
        now = self._wall_clock()
        if params.expires_at and now > params.expires_at:  # signed params are always dated
            raise ParamsSignatureError(
                f"kv_transfer_params of {rid!r} expired {now - params.expires_at:.1f} s ago "
                f"(expires_at={params.expires_at}); prefill has freed or will free the blocks"
            )

    def _mac(self, unsigned: KVTransferParams) -> str:
        assert self._key is not None
        # the params as they travel (keys newer than a release left out at their default), so
        # a decode of that release computes the same bytes
        payload = _ENCODER.encode(unsigned.to_dict())
        return hmac.new(self._key, payload, hashlib.sha256).hexdigest()
