"""The worker's set-up thread, its counted agents, and the messages that wait for them.

A fake engine records what reaches NIXL; the set-up thread is real.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.worker.agent_gate import AgentGate
from kvbridge.connector.worker.outbox import Outbox
from kvbridge.connector.worker.peer_setup import PeerSetup
from kvbridge.connector.worker.requester_agents import RequesterAgents
from tests.connector.pair_harness import FakeClock

WAIT_S = 10.0


class _Engine:
    """What the set-up thread and the outbox call, recorded."""

    def __init__(self) -> None:
        self.loaded: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.gone: set[str] = set()
        self.sent: list[tuple[str, bytes]] = []

    def add_peer(self, metadata: bytes) -> str:
        name = metadata.decode()
        self.loaded.add(name)
        self.calls.append(("add", name))
        return name

    def remove_peer(self, name: str) -> None:
        self.loaded.discard(name)
        self.calls.append(("remove", name))

    def peer_gone(self, name: str) -> bool:
        return name in self.gone

    def send_notif(self, agent: str, msg: bytes) -> None:
        self.sent.append((agent, msg))


@pytest.fixture
def engine() -> _Engine:
    return _Engine()


@pytest.fixture
def setup(engine: _Engine) -> Iterator[PeerSetup]:
    setup = PeerSetup(engine, AgentGate(), handshake_threads=1)  # type: ignore[arg-type]
    yield setup
    setup.close()


def _settled(setup: PeerSetup) -> None:
    ran = threading.Event()
    setup.nixl(ran.set)
    assert ran.wait(WAIT_S), "timed out waiting for the set-up thread's jobs"


def test_a_shared_agent_goes_with_its_last_holder_or_at_once_when_disconnected(setup, engine):
    setup.nixl(lambda: (setup.load_agent(b"x"), setup.load_agent(b"x")) and None)
    _settled(setup)
    assert setup.agents == {"x": 2} and engine.calls == [("add", "x"), ("add", "x")]
    setup.nixl(lambda: setup.unload_agent("x"))
    _settled(setup)
    assert setup.agents == {"x": 1} and "x" in engine.loaded  # the other holder keeps it

    # NIXL reported it disconnected: only a removal lets the next add connect afresh
    setup.nixl(lambda: (setup.load_agent(b"x"), None)[1])
    engine.gone.add("x")
    setup.nixl(lambda: setup.unload_agent("x"))
    _settled(setup)
    assert not setup.has_agent("x") and "x" not in engine.loaded
    assert engine.calls[-1] == ("remove", "x")


def test_a_requester_agent_removed_under_it_is_added_again_at_its_next_notification(setup, engine):
    agents = RequesterAgents(setup, clock=FakeClock())
    agents.asked("d", b"d")
    assert not agents.ensure("d")  # the set-up thread adds it
    _settled(setup)
    assert agents.ensure("d") and engine.calls == [("add", "d")]
    engine.gone.add("d")  # a directory held it too and dropped it, disconnected
    setup.nixl(lambda: setup.unload_agent("d"))
    _settled(setup)
    assert not agents.ensure("d")  # gone from NIXL: added again, the message waits
    _settled(setup)
    assert agents.ensure("d") and engine.calls == [("add", "d"), ("remove", "d"), ("add", "d")]


def test_a_failed_add_fails_every_waiting_message_by_name_until_the_requester_asks_again(
    setup, engine
):
    agents = RequesterAgents(setup, clock=FakeClock())
    agents.asked("d", b"e")  # metadata naming another agent: the add is undone, failed
    assert not agents.ensure("d")
    _settled(setup)
    agents.take_added()
    assert agents.ensure("d") and agents.ensure("d")  # both go out (and fail by name)
    assert engine.calls == [("add", "e"), ("remove", "e")]  # one add, not one per message
    agents.asked("d", b"d")  # it handshakes again: the next notification adds it
    assert not agents.ensure("d")


def test_messages_to_one_agent_leave_in_order_when_the_first_waited_for_its_add(engine):
    ready = {"x": False}
    outbox = Outbox(engine, None, None, ConnectorMetrics(), ensure_agent=lambda a: ready[a])  # type: ignore[arg-type]
    from kvbridge.connector.common.notifications import Done, decode_notification

    assert outbox.send_raw("x", Done(request_id="first"))
    ready["x"] = True  # added: a reply made in the next round must not overtake it
    assert outbox.send_raw("x", Done(request_id="second"))
    assert engine.sent == []
    outbox.flush()
    assert [decode_notification(m).request_id for _, m in engine.sent] == ["first", "second"]


def test_closing_skips_set_ups_nobody_polls_and_runs_the_removals(setup, engine):
    held = threading.Event()
    let_go = threading.Event()

    def stuck() -> None:  # a set-up held in NIXL
        held.set()
        assert let_go.wait(WAIT_S)

    setup.nixl(stuck)
    assert held.wait(WAIT_S)
    setup.nixl(lambda: (setup.load_agent(b"late"), None)[1])  # a set-up: skipped on close
    engine.loaded.add("old")
    setup.nixl(lambda: engine.remove_peer("old"), teardown=True)
    closing = threading.Thread(target=setup.close)
    closing.start()
    deadline = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):  # until close() has begun (it then waits for us)
        if setup._closing:
            break
        deadline.wait(0.01)
    assert setup._closing, "timed out waiting for close() to begin"
    let_go.set()
    closing.join(WAIT_S)
    assert not closing.is_alive()
    assert engine.calls == [("remove", "old")]


def test_a_paused_set_up_lets_rounds_in_and_takes_the_gate_back() -> None:
    """A set-up waiting on a READ's progress (``AgentGate.paused``) does not defer rounds;
    outside the pause rounds are deferred again, and a pause outside a set-up is a bug."""
    gate = AgentGate()
    seen: list[bool] = []

    def round_now() -> None:
        with gate.round() as held:
            seen.append(held)

    with gate.setup():
        other = threading.Thread(target=round_now)
        other.start()
        other.join(5.0)
        assert gate.setting_up
        with gate.paused():
            assert not gate.held()
            assert not gate.setting_up  # busy rounds may run while the set-up waits
            other = threading.Thread(target=round_now)
            other.start()
            other.join(5.0)
        assert gate.held() and gate.setting_up
        other = threading.Thread(target=round_now)
        other.start()
        other.join(5.0)
    assert seen == [False, True, False]
    assert gate.rounds_deferred == 2
    with pytest.raises(RuntimeError, match="outside setup"):
        with gate.paused():
            pass
