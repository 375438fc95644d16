"""The session's vLLM server pool without vLLM: which server a module gets back, which are
started and stopped, and the order that puts a module after the one it takes over from."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvbridge.examples.vllm.servers import ServerSpec
from tests.integration import vllm_pool
from tests.integration.vllm_pool import ServerPool, configuration, run_after

MODEL = Path("/models/tiny-llama")


class FakeService:
    def __init__(self, name: str, slot: int) -> None:
        self.name, self.slot, self.running = name, slot, False

    def alive(self) -> bool:
        return self.running


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Started and stopped services by name, in order, instead of vLLM processes."""
    log: dict[str, list] = {"started": [], "stopped": []}

    def start_all(services: list[FakeService], timeout_s: float) -> None:
        for s in services:
            s.running = True
            log["started"].append(s.name)

    def stop_all(services: list[FakeService]) -> None:
        for s in services:
            s.running = False
            log["stopped"].append(s.name)

    monkeypatch.setattr(
        vllm_pool, "vllm_service", lambda spec, logs, slot: FakeService(spec.name, slot)
    )
    monkeypatch.setattr(vllm_pool, "start_all", start_all)
    monkeypatch.setattr(vllm_pool, "stop_all", stop_all)
    return log


def _spec(name: str, block_size: int = 32, **fields: object) -> ServerSpec:
    return ServerSpec(name, MODEL, block_size=block_size, **fields)  # type: ignore[arg-type]


def test_the_configuration_is_every_field_but_the_name() -> None:
    assert configuration(_spec("C")) == configuration(_spec("D", index=3))
    assert configuration(_spec("C")) != configuration(_spec("C", block_size=64))
    assert configuration(_spec("C")) != configuration(_spec("C", extra_args=("--seed", "1")))
    assert configuration(_spec("C")) != configuration(_spec("C", env={"X": "1"}))


def test_the_next_module_takes_over_equal_configurations(launched, tmp_path) -> None:
    pool = ServerPool()
    with pool.serving([_spec("D"), _spec("P", data_parallel_size=2)], tmp_path) as first:
        d = first["D"]
    assert sorted(pool.idle) == ["D", "P"]
    with pool.serving([_spec("A", pipeline_parallel_size=2), _spec("C")], tmp_path) as second:
        assert second["C"] is d and d.alive()  # the same process, under this module's name
        assert second["A"].slot == 0
    # P idled into a module that did not take it: stopped before A started
    assert launched["started"] == ["D", "P", "A"]
    assert launched["stopped"] == ["P"]
    assert pool.reused == ["C <- D"] and pool.started == 3
    pool.close()
    assert sorted(launched["stopped"]) == ["A", "D", "P"] and pool.idle == []


def test_fresh_servers_are_started_anew_and_handed_back(launched, tmp_path) -> None:
    pool = ServerPool()
    with pool.serving([_spec("reference")], tmp_path):
        pass
    with pool.serving([_spec("reference")], tmp_path, fresh=True) as cold:
        assert cold["reference"].alive()
    assert launched["started"] == ["reference", "reference"]
    assert len(launched["stopped"]) == 1 and pool.idle == ["reference"]


def test_servers_not_shared_or_dead_are_stopped_not_kept(launched, tmp_path) -> None:
    pool = ServerPool()
    with pool.serving([_spec("L32a")], tmp_path, share=False):
        pass
    with pool.serving([_spec("G32a"), _spec("L128a", 128)], tmp_path) as running:
        running["G32a"].running = False  # killed by its test
    assert pool.idle == ["L128a"]
    assert launched["stopped"] == ["L32a", "G32a"]


def test_a_name_twice_in_one_request_is_refused(launched, tmp_path) -> None:
    pool = ServerPool()
    with pytest.raises(ValueError, match=r"unique.*\['C', 'C'\]"):
        with pool.serving([_spec("C"), _spec("C", 64)], tmp_path):
            pass
    assert launched["started"] == []


@dataclasses.dataclass
class Item:
    path: Path
    name: str


def test_a_follower_runs_right_after_its_leader_in_its_own_order() -> None:
    a, lead, mid, follow = (Path(f"/t/{n}.py") for n in ("a", "lead", "mid", "follow"))
    items = [
        Item(a, "a1"),
        Item(lead, "l1"),
        Item(lead, "l2"),
        Item(mid, "m1"),
        Item(follow, "f2"),
        Item(follow, "f1"),
    ]
    got = [i.name for i in run_after(items, {follow: lead})]
    assert got == ["a1", "l1", "l2", "f2", "f1", "m1"]
    # a leader not in the run: nothing moves
    alone = [i for i in items if i.path != lead]
    assert [i.name for i in run_after(alone, {follow: lead})] == ["a1", "m1", "f2", "f1"]
