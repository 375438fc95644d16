"""Settings the worker reads from ``extra`` reach the NIXL engine it builds."""

from __future__ import annotations

import pytest

from kvbridge.connector.transfer.nixl_config import MergeRuns, ProgressMode
from kvbridge.connector.worker.nixl_setup import nixl_engine


@pytest.mark.parametrize(
    ("progress_us", "merge", "mode"),
    [
        (0, MergeRuns.OFF, ProgressMode.PROGRESS_THREAD_OFF),
        (2000, MergeRuns.ON, ProgressMode.PROGRESS_THREAD_DELAY),
    ],
)
def test_the_engine_gets_the_settings(progress_us, merge, mode):
    engine = nixl_engine(f"settings-{progress_us}", progress_us, merge=merge)
    try:
        cfg = engine.config  # type: ignore[attr-defined]
        assert (cfg.merge, cfg.progress) == (merge, mode)
        if progress_us:
            assert cfg.progress_delay_us == progress_us
    finally:
        engine.close()
