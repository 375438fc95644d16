"""Decode loads under tensor parallelism, scheduler side: every worker rank loads its
heads of a request, and the load ends only when each rank has reported it (vLLM hands
the scheduler every rank's report). One rank's failure makes the whole load a failure,
whichever rank reports first."""

from __future__ import annotations

import pytest

from kvbridge.connector.common.config import FailurePolicy, KVRole
from kvbridge.connector.common.metadata import LoadFailure, WorkerOutput
from kvbridge.connector.scheduler.lifecycle import LoadState
from tests.connector.test_scheduler import Engine, admit, decode_req


def _loaded(rid: str) -> WorkerOutput:
    return WorkerOutput(finished_recving=frozenset({rid}))


def _failed(rid: str, reason: str = "rank 1: transfer timed out") -> WorkerOutput:
    failure = LoadFailure(
        request_id=rid, reason=reason, invalid_block_ids=((0, 1),), num_valid_tokens=0
    )
    return WorkerOutput(failed_loads=(failure,))


def _loading(tp_size: int, **config) -> Engine:
    eng = Engine(KVRole.CONSUMER, tp_size=tp_size, **config)
    admit(eng, decode_req("d", 64))
    eng.step()  # the load leaves for the workers
    assert eng.sched.load_state("d") is LoadState.LOADING
    return eng


def test_a_load_is_loaded_only_when_every_rank_reported_it() -> None:
    eng = _loading(tp_size=2)
    _, events = eng.step(_loaded("d"))  # rank 0
    assert events.loaded_request_ids == frozenset()
    assert eng.sched.load_state("d") is LoadState.LOADING
    assert eng.sched.defers_free("d")  # rank 1 may still write into the blocks
    _, events = eng.step(_loaded("d"))  # rank 1
    assert events.loaded_request_ids == {"d"}
    assert eng.sched.load_outcomes == {LoadState.LOADED: 1}


@pytest.mark.parametrize("failing_rank_first", [True, False])
@pytest.mark.parametrize(
    ("policy", "outcome"),
    [(FailurePolicy.RECOMPUTE, LoadState.RECOMPUTED), (FailurePolicy.FAIL, LoadState.FAILED)],
)
def test_one_rank_failing_fails_the_load_once_every_rank_reported(
    failing_rank_first: bool, policy: FailurePolicy, outcome: LoadState
) -> None:
    eng = _loading(tp_size=2, failure_policy=policy)
    reports = [_failed("d"), _loaded("d")]
    if not failing_rank_first:
        reports.reverse()
    _, first = eng.step(reports[0])
    assert first.loaded_request_ids == frozenset() and not first.recompute and not first.failed
    _, events = eng.step(reports[1])
    assert events.loaded_request_ids == frozenset()
    ended = events.recompute if outcome is LoadState.RECOMPUTED else events.failed
    assert [f.reason for f in ended] == ["rank 1: transfer timed out"]
    assert eng.sched.load_outcomes == {outcome: 1}


def test_reports_of_several_ranks_in_one_step_each_count() -> None:
    """vLLM may hand the scheduler both ranks' reports in one step: two outputs, folded
    one after the other."""
    eng = _loading(tp_size=2)
    eng.sched.update_connector_output(_loaded("d"))
    events = eng.sched.update_connector_output(_loaded("d"))
    assert events.loaded_request_ids == {"d"}
    eng.sched.update_connector_output(_loaded("d"))  # a third report matches nothing
    assert eng.sched.load_outcomes == {LoadState.LOADED: 1}


def test_an_aborted_load_is_freed_after_the_last_rank_ended_it() -> None:
    eng = _loading(tp_size=4)
    eng.sched.request_aborted("d")
    eng.step()
    for rank in range(3):
        _, events = eng.step(_failed("d", "cancelled") if rank % 2 else _loaded("d"))
        assert events.free_request_ids == frozenset(), rank
        assert eng.pool.num_used == 4  # ranks still reading may write into them
    _, events = eng.step(_loaded("d"))
    assert events.free_request_ids == {"d"}
    assert eng.sched.load_outcomes == {LoadState.ABORTED: 1}
    eng.assert_clean()


def test_a_rank_failing_before_the_abort_went_out_fails_the_aborted_load() -> None:
    """Rank 0's own failure came before the engine aborted the request; rank 1 then
    cancels its part on our abort ("aborted by the engine"): the load failed."""
    eng = _loading(tp_size=2, failure_policy=FailurePolicy.FAIL)
    eng.step(_failed("d"))  # rank 0, on its own
    eng.sched.request_aborted("d")
    eng.step()  # the abort goes out to the workers
    _, events = eng.step(_failed("d", "aborted by the engine"))  # rank 1
    assert events.free_request_ids == {"d"}
    assert [f.reason for f in events.failed] == ["rank 1: transfer timed out"]
    assert eng.sched.load_outcomes == {LoadState.FAILED: 1}
    eng.assert_clean()


def test_at_tp_1_the_first_report_ends_the_load() -> None:
    eng = _loading(tp_size=1)
    _, events = eng.step(_failed("d"))
    assert [f.request_id for f in events.recompute] == ["d"]
    assert eng.sched.load_outcomes == {LoadState.RECOMPUTED: 1}
