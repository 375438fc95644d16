"""Each peer's state and failed handshakes by reason (connector.worker.peer_health), as a
worker's metrics export them: a misconfigured pair shows at its first handshake."""

from __future__ import annotations

import logging

import pytest

from kvbridge.connector.common.metrics import PEER_STATES, ConnectorMetrics, parse_metrics
from kvbridge.connector.worker.peer_health import PeerBook, PeerHealth, classify
from kvbridge.handshake.errors import (
    AuthenticationError,
    ErrorCode,
    HandshakeTimeoutError,
    IncompatiblePeerError,
    PeerAuthenticationError,
    ProtocolError,
)
from tests.connector.conftest import SideFormat

FMT = SideFormat(16, cross_layer=True)
SECRET_A = "a" * 32
SECRET_B = "b" * 32


def test_every_health_is_an_exported_state() -> None:
    assert sorted(h.value for h in PeerHealth) == sorted(PEER_STATES)


@pytest.mark.parametrize(
    ("exc", "health"),
    [
        (AuthenticationError("HMAC mismatch"), PeerHealth.BAD_SECRET),
        (
            PeerAuthenticationError("p:1", ErrorCode.UNAUTHENTICATED, "x", authenticated=False),
            PeerHealth.BAD_SECRET,
        ),
        (IncompatiblePeerError([("head_size", 64, 128)]), PeerHealth.INCOMPATIBLE),
        (HandshakeTimeoutError("no reply"), PeerHealth.UNREACHABLE),
        (ProtocolError("malformed"), PeerHealth.FAILED),
    ],
)
def test_a_failure_is_classified_by_its_error(exc: Exception, health: PeerHealth) -> None:
    assert classify(exc) is health


def test_a_peer_failing_the_same_way_is_logged_once_at_error_and_counted_each_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    book = PeerBook()
    with caplog.at_level(logging.DEBUG, logger="kvbridge.connector.worker.peer_health"):
        for _ in range(3):
            book.set("10.0.0.5:5600", PeerHealth.CONNECTING)
            book.set("10.0.0.5:5600", PeerHealth.BAD_SECRET, "HMAC mismatch")
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "10.0.0.5:5600 is bad_secret" in errors[0].getMessage()
    assert "set the same `secret`" in errors[0].getMessage()
    assert book.failures == {"bad_secret": 3}
    assert book.states == {"10.0.0.5:5600": PeerHealth.BAD_SECRET}
    book.set("10.0.0.5:5600", PeerHealth.READY)  # fixed, then broken again: a new ERROR
    book.set("10.0.0.5:5600", PeerHealth.BAD_SECRET, "HMAC mismatch")
    assert sum(r.levelno == logging.ERROR for r in caplog.records) == 2


def test_the_states_and_failures_export_as_a_gauge_and_a_counter() -> None:
    metrics = ConnectorMetrics(
        peer_states={"10.0.0.5:5600": "bad_secret", "10.0.0.6:5600": "ready"},
        peer_failures={"bad_secret": 4},
    )
    scraped = parse_metrics(metrics.prometheus())
    assert scraped['kvbridge_peer_state{peer="10.0.0.5:5600",state="bad_secret"}'] == 1.0
    assert scraped['kvbridge_peer_state{peer="10.0.0.5:5600",state="ready"}'] == 0.0
    assert scraped['kvbridge_peer_state{peer="10.0.0.6:5600",state="ready"}'] == 1.0
    assert scraped['kvbridge_peer_failures_total{reason="bad_secret"}'] == 4.0


def test_a_secret_mismatch_shows_at_the_first_handshake(cluster, caplog) -> None:
    prefill = cluster.new_node("kv_producer", FMT, "F", secret=SECRET_A)
    address = f"127.0.0.1:{prefill.port}"
    decode = cluster.new_node(
        "kv_consumer", FMT, "F", secret=SECRET_B, extra={"warm_peers": [address]}
    )
    cluster.pump(
        [decode],
        lambda: decode.worker.metrics.peer_states.get(address) == "bad_secret",
        "the peer's bad_secret state",
    )
    assert decode.worker.metrics.peer_failures == {"bad_secret": 1}
    assert f"peer {address} is bad_secret" in caplog.text


def test_an_unreachable_peer_shows_as_unreachable(cluster, dead_port) -> None:
    address = f"127.0.0.1:{dead_port}"
    decode = cluster.new_node(
        "kv_consumer", FMT, "F", handshake_timeout_s=0.2, extra={"warm_peers": [address]}
    )
    cluster.pump(
        [decode],
        lambda: decode.worker.metrics.peer_states.get(address) == "unreachable",
        "the peer's unreachable state",
    )
    assert decode.worker.metrics.peer_failures == {"unreachable": 1}
