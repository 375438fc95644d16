"""``kvbridge probe HOST:PORT``: handshake with a running worker's side channel now, before
any request (the same request a peer sends, signed with the secret when there is one)."""

from __future__ import annotations

from kvbridge.handshake.client import ClientConfig, HandshakeClient
from kvbridge.handshake.framing import HandshakeSecurity
from kvbridge.handshake.messages import WorkerDescription
from kvbridge.layouts.errors import KVBridgeError


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise KVBridgeError(f"{text!r}: expected HOST:PORT of a worker's side channel")
    return host, int(port)


def fetch_description(
    address: str, *, secret: str | None, timeout_s: float, retries: int
) -> WorkerDescription:
    """The worker's description, or the handshake error (timeout, refused secret, ...)."""
    host, port = parse_address(address)
    security = HandshakeSecurity(secret=secret.encode() if secret else None)
    client = HandshakeClient(
        ClientConfig(timeout_s=timeout_s, retries=retries, security=security),
        requester_engine_id="kvbridge-probe",
    )
    try:
        return client.fetch(host, port)
    finally:
        client.close()
