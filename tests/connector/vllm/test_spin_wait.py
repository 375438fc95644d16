"""vLLM's wait between engine steps spins on ``time.sleep(0)`` once kvbridge is loaded.

``kvbridge.connector.vllm.spin_wait`` flips vLLM 0.32's ``USE_SCHED_YIELD`` (read at
every wait) on vLLM's CPU platform, as ``extra.engine_step_wait`` says. Checked against
the installed vLLM's own ``sched_yield`` function, so that a vLLM that renames or drops
the flag fails here by name, not as slow loads.
"""

from __future__ import annotations

import os
import sys
import types

import pytest

from kvbridge.connector.common.config import ConfigError, KVTransferConfig
from kvbridge.connector.vllm import spin_wait

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the switch applies on Linux only"
)


@pytest.fixture
def vllm_utils():
    import vllm.distributed.utils as utils

    saved = utils.USE_SCHED_YIELD
    utils.USE_SCHED_YIELD = True  # as vLLM 0.32 sets it on Python >= 3.11.1
    try:
        yield utils
    finally:
        utils.USE_SCHED_YIELD = saved


def _yields_of(utils: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which primitive vLLM's own ``sched_yield()`` calls now."""
    calls: list[str] = []
    monkeypatch.setattr(os, "sched_yield", lambda: calls.append("sched_yield"))
    monkeypatch.setattr(utils.time, "sleep", lambda s: calls.append(f"sleep({s})"))
    utils.sched_yield()
    return calls


def test_on_vllms_cpu_platform_the_step_wait_sleeps_instead_of_yielding(
    vllm_utils, monkeypatch
) -> None:
    assert _yields_of(vllm_utils, monkeypatch) == ["sched_yield"]  # vLLM's own choice
    assert spin_wait.apply("auto", cpu_platform=True) is False
    assert _yields_of(vllm_utils, monkeypatch) == ["sleep(0)"]


def test_on_other_platforms_auto_keeps_vllms_wait(vllm_utils, monkeypatch) -> None:
    assert spin_wait.apply("auto", cpu_platform=False) is True
    assert _yields_of(vllm_utils, monkeypatch) == ["sched_yield"]
    assert spin_wait.apply("sleep0", cpu_platform=False) is False  # forced
    assert _yields_of(vllm_utils, monkeypatch) == ["sleep(0)"]


def test_sched_yield_keeps_vllms_wait_on_the_cpu_platform(vllm_utils, monkeypatch) -> None:
    config = KVTransferConfig.from_dict(
        {"kv_role": "kv_both", "engine_id": "e", "extra": {"engine_step_wait": "sched_yield"}}
    )
    assert spin_wait.apply(config.extra.engine_step_wait, cpu_platform=True) is True
    assert _yields_of(vllm_utils, monkeypatch) == ["sched_yield"]


def test_the_default_is_auto_and_other_values_are_refused() -> None:
    assert (
        KVTransferConfig.from_dict({"kv_role": "kv_both", "engine_id": "e"}).extra.engine_step_wait
        == "auto"
    )
    with pytest.raises(
        ConfigError, match=r"engine_step_wait='spin' must be one of 'auto', 'sleep0', 'sched_yield'"
    ):
        KVTransferConfig.from_dict(
            {"kv_role": "kv_both", "engine_id": "e", "extra": {"engine_step_wait": "spin"}}
        )


def test_a_vllm_without_the_flag_is_left_alone_and_said(caplog) -> None:
    other = types.ModuleType("vllm.distributed.utils")
    with caplog.at_level("WARNING", logger="kvbridge"):
        assert spin_wait.apply("sleep0", cpu_platform=True, module=other) is True
    assert not hasattr(other, "USE_SCHED_YIELD")
    assert "has no USE_SCHED_YIELD" in caplog.text
