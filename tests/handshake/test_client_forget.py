"""HandshakeClient.get against forget(): a fetch that began before a peer restarted never
reaches whoever forgot the peer and asked again.

A worker's handshake threads share one client; each handshake forgets the peer first, then
gets it. The old process's answer can arrive late, after another thread forgot the peer:
it goes to the call that fetched it, and is not cached. The fetches are stand-ins the test
releases in order (no network), so the interleaving is exact.
"""

from __future__ import annotations

import threading

import msgspec

from kvbridge.handshake.client import ClientConfig, HandshakeClient
from kvbridge.handshake.messages import WorkerDescription
from tests.handshake.descriptions import make_description

WAIT_S = 10.0
OLD_PORT, NEW_PORT, NO_PORT = 1, 2, 3
KEY = ("prefill-0", 0)
OLD = make_description()
NEW = msgspec.structs.replace(OLD, agent_name="prefill-0-agent-0-v2")


class LateOld:
    """``fetch`` stand-in: the old process (OLD_PORT) answers only when released; the
    restarted one (NEW_PORT) at once, after ``before_new`` ran; NO_PORT must not be
    asked (the answer is cached)."""

    def __init__(self) -> None:
        self.old_asked = threading.Event()
        self.old_may_answer = threading.Event()
        self.before_new = lambda: None
        self.ports: list[int] = []

    def __call__(self, host: str, port: int) -> WorkerDescription:
        self.ports.append(port)
        if port == OLD_PORT:
            self.old_asked.set()
            assert self.old_may_answer.wait(WAIT_S), f"not released within {WAIT_S} s"
            return OLD
        assert port == NEW_PORT, f"port {port} asked: the description was not cached"
        self.before_new()
        return NEW


def _get_in_thread(client: HandshakeClient, got: list[WorkerDescription]) -> threading.Thread:
    thread = threading.Thread(target=lambda: got.append(client.get(*KEY, "127.0.0.1", OLD_PORT)))
    thread.start()
    return thread


def test_an_old_answer_arriving_mid_handshake_is_not_handed_to_the_newer_caller() -> None:
    """Thread A fetches from the old process; the peer restarts; B forgets it and fetches
    the new one; A's old answer lands while B's fetch runs. B gets (and the cache keeps)
    the new description; A gets the one it fetched."""
    fetch = LateOld()
    got_old: list[WorkerDescription] = []
    with HandshakeClient(ClientConfig(timeout_s=1.0, retries=0)) as client:
        client.fetch = fetch  # type: ignore[method-assign]
        a = _get_in_thread(client, got_old)
        assert fetch.old_asked.wait(WAIT_S), f"A did not fetch within {WAIT_S} s"

        def old_answer_lands() -> None:
            fetch.old_may_answer.set()
            a.join(WAIT_S)
            assert not a.is_alive(), f"A did not finish within {WAIT_S} s"

        fetch.before_new = old_answer_lands
        client.forget(*KEY)
        got_new = client.get(*KEY, "127.0.0.1", NEW_PORT)

        assert got_new.agent_name == NEW.agent_name
        assert [d.agent_name for d in got_old] == [OLD.agent_name]
        assert client.get(*KEY, "127.0.0.1", NO_PORT).agent_name == NEW.agent_name
    assert fetch.ports == [OLD_PORT, NEW_PORT]


def test_a_fetch_in_flight_when_its_peer_was_forgotten_is_not_cached() -> None:
    fetch = LateOld()
    got_old: list[WorkerDescription] = []
    with HandshakeClient(ClientConfig(timeout_s=1.0, retries=0)) as client:
        client.fetch = fetch  # type: ignore[method-assign]
        a = _get_in_thread(client, got_old)
        assert fetch.old_asked.wait(WAIT_S), f"A did not fetch within {WAIT_S} s"
        client.forget(*KEY)
        fetch.old_may_answer.set()
        a.join(WAIT_S)
        assert not a.is_alive(), f"A did not finish within {WAIT_S} s"
        assert [d.agent_name for d in got_old] == [OLD.agent_name]

        assert client.get(*KEY, "127.0.0.1", NEW_PORT).agent_name == NEW.agent_name
        assert client.get(*KEY, "127.0.0.1", NO_PORT).agent_name == NEW.agent_name
    assert fetch.ports == [OLD_PORT, NEW_PORT]


def test_a_fetch_with_no_forget_meanwhile_is_cached() -> None:
    fetch = LateOld()
    with HandshakeClient(ClientConfig(timeout_s=1.0, retries=0)) as client:
        client.fetch = fetch  # type: ignore[method-assign]
        assert client.get(*KEY, "127.0.0.1", NEW_PORT).agent_name == NEW.agent_name
        client.forget("prefill-0", 1)  # another key
        assert client.get(*KEY, "127.0.0.1", NO_PORT).agent_name == NEW.agent_name
    assert fetch.ports == [NEW_PORT]
