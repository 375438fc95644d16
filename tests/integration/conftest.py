"""The session's vLLM servers (:mod:`tests.integration.vllm_pool`): the ``vllm_pool``
fixture, the order that lets a module take over the servers of the module before it, and
the teardown that stops idle servers the next module will not use."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.vllm_pool import ServerPool, run_after

# module -> the module whose servers it takes over (the same configurations): it runs
# right after that one, so that no server idles through a module that does not use it
RUNS_AFTER = {
    "test_vllm_router.py": "test_vllm_cold_start.py",  # the pull trio: P 64, D 32, reference
    "test_vllm_pp.py": "test_vllm_dp.py",  # the PP-1 / DP-1 kv_both server (C = D)
}

_POOL = pytest.StashKey[ServerPool]()
_SUMMARY = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def vllm_pool(request: pytest.FixtureRequest) -> Iterator[ServerPool]:
    pool = ServerPool()
    request.config.stash[_POOL] = pool
    try:
        yield pool
    finally:
        pool.close()
        del request.config.stash[_POOL]
        taken = ", ".join(pool.reused) or "none"
        request.config.stash[_SUMMARY] = (
            f"vLLM servers: {pool.started} started by the pool; taken over: {taken}"
        )


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _SUMMARY in config.stash:
        terminalreporter.write_line(config.stash[_SUMMARY])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    items[:] = run_after(items, {here / f: here / lead for f, lead in RUNS_AFTER.items()})


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After a module's last test (its fixtures handed their servers back), stop the idle
    servers unless the next module uses the pool (its first request stops what it does
    not take)."""
    try:
        return (yield)
    finally:
        pool = item.config.stash.get(_POOL, None)
        leaving = nextitem is None or nextitem.path != item.path
        if pool is not None and leaving:
            if nextitem is None or "vllm_pool" not in getattr(nextitem, "fixturenames", ()):
                pool.stop_idle()
