"""The engines ``kvbridge bench transfer`` builds are the worker's: shared (the worker's
progress thread calls them too) and running NIXL's progress thread exactly when
``--nixl-progress-us`` asks for one (before, the bench's factories ignored the setting)."""

from __future__ import annotations

import pytest

from kvbridge.cli.bench.transfer_child import engine_config
from kvbridge.connector.transfer.nixl_config import MergeRuns, ProgressMode


@pytest.mark.parametrize(
    ("progress_us", "mode", "delay_us"),
    [(0, ProgressMode.PROGRESS_THREAD_OFF, None), (2000, ProgressMode.PROGRESS_THREAD_DELAY, 2000)],
)
def test_the_bench_engine_runs_the_progress_thread_asked_for(progress_us, mode, delay_us) -> None:
    cfg = engine_config("bench-D-x", MergeRuns.ON, progress_us)
    assert (cfg.agent_name, cfg.merge, cfg.shared, cfg.progress) == (
        "bench-D-x",
        MergeRuns.ON,
        True,
        mode,
    )
    if delay_us is not None:
        assert cfg.progress_delay_us == delay_us
