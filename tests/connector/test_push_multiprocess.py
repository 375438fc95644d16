"""Push mode, prefill in a child OS process: a fault while its WRITE into decode is in flight.

The push-mode counterpart of ``test_prefill_fault_while_read_in_flight``
(test_worker_multiprocess.py). Decode sends ``Push``; the child posts NIXL WRITEs into
decode's blocks and, armed with ``freeze_after_write``, says so and SIGSTOPs itself in the
same step, before any further NIXL call. Under ``UCX_TLS=tcp`` a WRITE ends only when the
writer has progressed past the target's acknowledgement, and decode is not driven until
the child has stopped, so the WRITE is provably still running when decode's deadline
passes. Socket buffers far below the load's bytes (``UCX_TCP_SNDBUF``/``RCVBUF``) keep
most of it inside the frozen writer: those bytes can only land once it runs again::

    decode                                  child (prefill, push mode)
    load -> Push ----------------------->   WRITEs posted, "frozen", SIGSTOP
    deadline: fails, Done(ok=False) ---->   (frozen: queued in its socket)
    held: not reported, blocks kept         .
    .                                       SIGCONT: WRITE bytes land, WRITE ends,
    Pushed <--------------------------------  Pushed(ok=False) (cancelled)
    failure reported, blocks given back:
    not one byte changes after this

Killed instead of resumed, the child answers nothing: decode ends the hold once it finds
the prefill gone, which takes a notification that fails (NIXL tells a passive side
nothing about a dead peer; NIXL_NOTES.md): its Done(ok=False), or the empty Heartbeat it
sends every ``PROBE_S`` to each prefill that owes it a push round
(``kvbridge.connector.worker.decode.claims``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvbridge.connector.common.metadata import ConnectorMetadata
from tests.connector.conftest import (
    Cluster,
    Node,
    Request,
    check_loaded,
    expectations,
    new_id,
    plan_request,
)
from tests.connector.test_worker_multiprocess import (
    FAILURE_BOUND_S,
    KINDS,
    SAME,
    Child,
    cache_digest,
    disjoint_local_ids,
    load_from_child,
)

pytestmark = pytest.mark.integration

TIMEOUT_S = 1.0  # decode's transfer_timeout_s
STOP_TIMEOUT_S = 5.0
SOCKET_BUFFER = "4k"  # the kernel makes it 8 KiB; a 256-token load moves more than that
SETTLE_STEPS = 200


@dataclass
class MidWrite:
    """A push load whose prefill stopped right after posting its WRITEs."""

    child: Child
    decode: Node
    req: Request
    warm: Request
    rng: np.random.Generator

    def ended(self) -> bool:
        return self.req.load_id in self.decode.failed or self.req.load_id in self.decode.loaded


def wait_stopped(child: Child, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Until the kernel shows the child stopped (it stops itself just after saying so)."""
    stat = Path(f"/proc/{child.proc.pid}/stat")
    deadline = time.monotonic() + timeout_s
    while True:
        state = stat.read_text().rpartition(")")[2].split()[0]  # after "(command name)"
        if state in ("T", "t"):
            return
        if time.monotonic() > deadline or child.proc.poll() is not None:
            raise AssertionError(
                f"child {child.engine_id} not stopped within {timeout_s} s (state {state})"
            )
        time.sleep(0.001)  # a bounded poll of /proc: the child signals itself


@pytest.fixture
def push_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Child]:
    """A push-mode prefill child; the UCX settings hold for it and for the decode agent the
    test builds next."""
    for var, value in (
        ("UCX_TLS", "tcp"),  # WRITEs complete asynchronously (NIXL_NOTES.md)
        ("UCX_TCP_SNDBUF", SOCKET_BUFFER),
        ("UCX_TCP_RCVBUF", SOCKET_BUFFER),
    ):
        monkeypatch.setenv(var, value)
    engine_id = new_id("P")
    log = tmp_path / f"{engine_id}.log"
    child = Child(SAME, engine_id=engine_id, kv_port=0, seed=5, log=log, transfer_mode="push")
    try:
        yield child
    finally:
        child.close()


def freeze_mid_write(cluster: Cluster, child: Child) -> MidWrite:
    """Warm push load (handshakes both ways, connection up), then a 256-token push load
    whose prefill stops with its WRITEs posted; decode not driven since its Push."""
    decode = cluster.new_node(
        "kv_consumer", SAME, KINDS, transfer_timeout_s=TIMEOUT_S, extra={"transfer_mode": "push"}
    )
    decode.fill(6)
    rng = np.random.default_rng(3)
    warm = plan_request(child, decode, 0, 64, rng)
    load_from_child(cluster, child, decode, warm)

    req = plan_request(child, decode, 0, 256, rng)
    disjoint_local_ids(req, warm, rng=rng)
    child.send(req.send_id, req.remote_ids, req.remote_first)
    child.command(cmd="freeze_after_write")
    child.wait_for("armed")
    decode.load(req.spec(child))  # the peer is READY: the Push goes out in this call
    frozen = child.wait_for("frozen")
    wait_stopped(child)
    assert frozen["live_handles"] > 0, f"no WRITE handle live when the child stopped: {frozen}"
    return MidWrite(child, decode, req, warm, rng)


def hold_past_deadline(w: MidWrite) -> str:
    """Drive decode past its deadline and past it again: the failed load stays held (not
    reported) while the frozen prefill may still write. Returns the cache digest then."""
    metrics = w.decode.worker.metrics
    drive(w, lambda: metrics.held_overdue == 1, "the held load to be overdue")
    assert metrics.loads_held == 1
    assert not w.ended(), "a failed load was reported while the prefill's WRITE could land"
    return cache_digest(w.decode)


def drive(
    w: MidWrite,
    until: Callable[[], bool],
    what: str,
    timeout_s: float = 2 * TIMEOUT_S + FAILURE_BOUND_S,
) -> None:
    """Step decode (only: the child drives itself) until ``until()``, or fail naming it."""
    deadline = time.monotonic() + timeout_s
    while not until():
        w.decode.collect()
        if time.monotonic() > deadline:
            failed = {k: v.reason for k, v in w.decode.failed.items()}
            raise AssertionError(f"no {what} within {timeout_s} s; failed: {failed}")


def settled(w: MidWrite, given_back: str) -> None:
    """After the give-back not one byte of decode's cache changes."""
    for _ in range(SETTLE_STEPS):
        w.decode.collect()
        w.child.drain()
    assert cache_digest(w.decode) == given_back, "a WRITE landed after the blocks were given back"


def test_frozen_push_writer_holds_load_until_write_ended(
    cluster: Cluster, push_child: Child
) -> None:
    w = freeze_mid_write(cluster, push_child)
    handshakes = w.decode.worker.metrics.handshakes
    while_frozen = hold_past_deadline(w)

    os.kill(w.child.proc.pid, signal.SIGCONT)
    drive(w, w.ended, "the held failure once the WRITE ended", FAILURE_BOUND_S)
    failure = w.decode.failed[w.req.load_id]
    assert "timed out" in failure.reason and w.child.engine_id in failure.reason, failure.reason
    assert failure.num_valid_tokens == 0
    given_back = cache_digest(w.decode)
    # the WRITE outlived decode's deadline: most of its bytes landed after the resume,
    # into blocks decode still held
    assert given_back != while_frozen, "no byte of the WRITE landed after the resume"
    settled(w, given_back)
    drive(
        w,
        lambda: (w.child.drain(), w.req.send_id in w.child.sent)[1],
        f"the resumed child to free {w.req.send_id} on Done(ok=False)",
        FAILURE_BOUND_S,
    )
    again = plan_request(w.child, w.decode, 0, 128, w.rng)
    disjoint_local_ids(again, w.warm, w.req, rng=w.rng)
    want = expectations(w.child, w.decode, again)
    load_from_child(cluster, w.child, w.decode, again)
    check_loaded(w.child, w.decode, again, want)
    assert w.child.digest() == w.child.replica_digest()
    # the hold ended on prefill's answer, not by dropping it as dead
    assert w.decode.worker.metrics.handshakes == handshakes
    assert w.decode.worker.metrics.bad_notifications == 0


def test_push_writer_killed_before_deadline_ends_hold(cluster: Cluster, push_child: Child) -> None:
    """Killed while frozen, before decode's next step: at its deadline decode tells the
    prefill Done(ok=False); that notification fails, the prefill's agent is dropped as
    dead and the hold ends at once."""
    w = freeze_mid_write(cluster, push_child)
    w.child.kill()
    drive(w, w.ended, "LoadFailure (prefill killed mid-WRITE)", TIMEOUT_S + FAILURE_BOUND_S)
    failure = w.decode.failed[w.req.load_id]
    assert "timed out" in failure.reason, failure.reason
    assert failure.num_valid_tokens == 0
    assert w.decode.worker.metrics.held_overdue == 0
    settled(w, cache_digest(w.decode))


def test_push_writer_killed_while_held_ends_hold_on_abort(
    cluster: Cluster, push_child: Child
) -> None:
    """Killed after decode's Done(ok=False) reached the frozen prefill, then the engine
    gives the request up: the abort reports nothing early (the load is held); the hold
    ends once a probe to the dead prefill fails and its agent is dropped, and the failure
    is reported once."""
    w = freeze_mid_write(cluster, push_child)
    hold_past_deadline(w)
    w.child.kill()
    params = w.req.spec(w.child).params
    w.decode.worker.bind_connector_metadata(
        ConnectorMetadata(reqs_to_abort=((w.req.load_id, params),))
    )
    w.decode.worker.start_load_kv()
    drive(w, w.ended, "the held failure once the abort found the prefill gone")
    failure = w.decode.failed[w.req.load_id]
    assert "timed out" in failure.reason, failure.reason
    settled(w, cache_digest(w.decode))


def test_push_writer_killed_while_held_is_detected(cluster: Cluster, push_child: Child) -> None:
    """Killed after decode's Done(ok=False) reached the frozen prefill: nothing else is
    sent to it, so only the probes find it gone (within PROBE_S and a step)."""
    w = freeze_mid_write(cluster, push_child)
    hold_past_deadline(w)
    w.child.kill()
    drive(w, w.ended, "the hold to end after the prefill was killed", FAILURE_BOUND_S)
    assert "timed out" in w.decode.failed[w.req.load_id].reason
    settled(w, cache_digest(w.decode))
