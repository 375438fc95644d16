"""Test-wide hooks: the ``gpu`` tier is skipped, by name, on a machine without CUDA."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu tier: no CUDA device here (scripts/gpu_check.sh)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
