"""Test-wide hooks, so that a machine without an optional part skips its tests by name:

- the ``gpu`` tier is skipped on a machine without CUDA;
- a test module that imports vLLM is skipped, with the reason, where vLLM is not installed
  (a GPU host running ``scripts/gpu_check.sh`` without vLLM is the usual case), instead of
  failing the collection of the whole run.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

VLLM_MISSING = "needs vLLM, which is not installed here (pip install -e '.[vllm]')"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu tier: no CUDA device here (scripts/gpu_check.sh)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


class _VLLMOptionalModule(pytest.Module):
    """A test module whose import fails only because vLLM is missing: skipped, by name."""

    def collect(self) -> Iterable[pytest.Item | pytest.Collector]:
        try:
            return super().collect()
        except self.CollectError as exc:
            cause = exc.__cause__
            # vLLM itself absent; a module missing *inside* an installed vLLM (its API
            # moved) is a failure, not a skip
            if isinstance(cause, ModuleNotFoundError) and cause.name == "vllm":
                pytest.skip(f"{self.nodeid} {VLLM_MISSING}: {cause}", allow_module_level=True)
            raise


def pytest_pycollect_makemodule(module_path, parent: pytest.Collector) -> pytest.Module | None:
    if module_path.name == "__init__.py":
        return None  # packages: pytest's own
    return _VLLMOptionalModule.from_parent(parent, path=module_path)
