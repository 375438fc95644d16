"""Messages that reach prefill before their request (``prefill.early``): kept until it is
added, bounded by ``MAX_EARLY`` requests of each kind. At the cap a new request's message
is refused, while one for a request already waiting (a claim sent again, a second rank's
``Done``) is kept: it adds no request. Before the split out of ``sender.py`` the cap
refused those too, so a claim sent again was refused while its first send stayed queued
and was answered later."""

from __future__ import annotations

from kvbridge.connector.common.metrics import ConnectorMetrics
from kvbridge.connector.common.notifications import Done, Prepare
from kvbridge.connector.worker.prefill.early import MAX_EARLY, Early


def _full() -> Early:
    early = Early(ConnectorMetrics(), wait_s=30.0, clock=lambda: 0.0)
    for i in range(MAX_EARLY):
        assert early.keep_prepare(Prepare(request_id=f"r{i}", rewrites=[], claim=1), "d")
        assert early.keep_done(Done(request_id=f"r{i}"), "d")
    return early


def test_at_the_cap_a_new_request_is_refused_and_a_waiting_one_kept() -> None:
    early = _full()
    assert not early.keep_prepare(Prepare(request_id="new", rewrites=[]), "d")
    assert not early.keep_done(Done(request_id="new"), "d")
    # the same reader's claim sent again replaces its first send; another rank's is added
    assert early.keep_prepare(Prepare(request_id="r7", rewrites=[], claim=2), "d")
    assert early.keep_prepare(Prepare(request_id="r7", rewrites=[], reader_rank=1), "d")
    assert early.keep_done(Done(request_id="r7", reader_rank=1), "d")
    prepares, dones = early.take("r7")
    assert [(p.claim, p.reader_rank) for _, p in prepares] == [(2, 0), (0, 1)]
    assert [d.reader_rank for _, d in dones] == [0, 1]
    assert early.take("new") == ([], [])


def test_what_waited_too_long_is_refused_or_dropped() -> None:
    now = [0.0]
    metrics = ConnectorMetrics()
    early = Early(metrics, wait_s=5.0, clock=lambda: now[0])
    early.keep_prepare(Prepare(request_id="a", rewrites=[], claim=3), "d")
    early.keep_done(Done(request_id="b"), "d")
    now[0] = 6.0  # past the claim's wait, not the Done's
    assert [(agent, p.claim) for agent, p in early.expire()] == [("d", 3)]
    assert metrics.bad_notifications == 0
    now[0] = 200.0  # past EARLY_DONE_TTL_S: the Done is dropped and counted
    assert early.expire() == []
    assert metrics.bad_notifications == 1
    assert early.take("b") == ([], [])
